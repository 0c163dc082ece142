use super::*;
use crate::decision_log::{Counters, DecisionLog, Settings};
use crate::proto::rate_limit_descriptor::Entry;
use crate::proto::rate_limit_response::Code;
use crate::proto::{RateLimitDescriptor, RateLimitRequest};

/// Every windowed algorithm, per consumer.
const RULES: &str = r#"domain: d
descriptors:
  - key: user
    rate_limits:
      - {name: per-second, requests_per_unit: 4, unit: second}
      - {name: sliding, requests_per_unit: 9, period: 10s, algorithm: sliding_window}
  - key: log
    rate_limit: {name: log, requests_per_unit: 3, period: 2s, algorithm: sliding_log}
  - key: bucket
    rate_limit: {name: bucket, requests_per_unit: 5, period: 5s, algorithm: token_bucket, burst: 2}
"#;

fn rules(text: &str) -> RuleSet {
    crate::config::load_sources(&[("t.yaml".into(), text.into())]).unwrap_or_else(|e| panic!("{e}"))
}

fn counters() -> Counters {
    let c = |n: &str| prometheus::IntCounter::new(n, "test").unwrap();
    Counters {
        lines: c("l"),
        dropped_queue: c("q"),
        dropped_write: c("w"),
        dropped_large: c("x"),
    }
}

/// A small deterministic generator (the seed is the test's).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn request(rng: &mut Rng) -> RateLimitRequest {
    let key = ["user", "log", "bucket"][rng.below(3) as usize];
    let value = format!("c{}", rng.below(5));
    RateLimitRequest {
        domain: "d".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: key.into(),
                value,
            }],
            hits_addend: (rng.below(4) == 0).then_some(2),
            ..Default::default()
        }],
        hits_addend: 0,
    }
}

/// The service on a memory store (its clock moved by the test) logging every decision of 20 000
/// random requests into `dir`: the lines, and (admitted, denied).
async fn live_log(dir: &std::path::Path) -> (Vec<Line>, u64, u64) {
    let path = dir.join("d.log");
    let log = DecisionLog::start(
        Settings {
            path: path.clone(),
            max_bytes: 1 << 30,
            files: 2,
            sample: 1.0,
            redact: String::new(),
            salt: Vec::new(),
            queue: 100_000,
        },
        counters(),
    )
    .unwrap();
    let clock = Arc::new(VirtualClock::default());
    let dyn_clock: Arc<dyn Clock> = Arc::clone(&clock) as Arc<dyn Clock>;
    let limiter = RateLimiter::new(
        rules(RULES),
        StoreStack::memory(Arc::clone(&dyn_clock), 10_000),
        ServiceOptions {
            decision_log: Some(log.clone()),
            ..ServiceOptions::default()
        },
        Telemetry::new(dyn_clock).unwrap(),
    );
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let mut now = 1_796_600_000_000_000u64;
    let (mut admitted, mut denied) = (0u64, 0u64);
    for _ in 0..20_000 {
        // Bursts and gaps: 0 to 400 ms between requests, often the same instant.
        now += rng.below(4) * rng.below(100_000);
        clock.set_us(now);
        let r = limiter.should_rate_limit(request(&mut rng)).await.unwrap();
        if r.overall_code == Code::OverLimit as i32 {
            denied += 1;
        } else {
            admitted += 1;
        }
    }
    assert!(admitted > 1_000 && denied > 1_000, "{admitted} {denied}");
    assert!(log.flush(Duration::from_secs(10)));
    let (lines, skipped) = read_logs(&[path]).unwrap();
    assert_eq!(skipped.lines, 0);
    assert_eq!(lines.len(), 20_000);
    (lines, admitted, denied)
}

/// The log of `live_log` replayed against the same config: every answer is the logged one.
#[tokio::test]
async fn the_enforced_config_replayed_gives_back_every_logged_answer() {
    let dir = tempfile::tempdir().unwrap();
    let (lines, admitted, denied) = live_log(dir.path()).await;
    let mut seen = 0;
    let report = replay(
        "same",
        rules(RULES),
        ServiceOptions::default(),
        &lines,
        5,
        &mut |n| seen = n,
    )
    .await
    .unwrap();
    assert_eq!(seen, 20_000);
    assert_eq!(report.requests, Totals { admitted, denied });
    assert_eq!(report.logged, report.requests);
    assert_eq!((report.newly_denied, report.newly_admitted), (0, 0));
    for l in &report.limits {
        assert_eq!(l.newly_denied, 0, "{l:?}");
        assert_eq!(l.logged_denied, l.descriptors.denied, "{l:?}");
    }
    // Halved, the same log: more denied, and who they are.
    let halved = RULES
        .replace("requests_per_unit: 4,", "requests_per_unit: 2,")
        .replace("requests_per_unit: 9,", "requests_per_unit: 4,");
    let lower = replay(
        "halved",
        rules(&halved),
        ServiceOptions::default(),
        &lines,
        3,
        &mut |_| {},
    )
    .await
    .unwrap();
    assert!(lower.requests.denied > denied, "{:?}", lower.requests);
    assert_eq!(lower.newly_admitted, 0, "a lower limit admits nothing more");
    assert_eq!(
        lower.newly_denied,
        lower.requests.denied - denied,
        "every new denial was admitted then"
    );
    let per_second = lower
        .limits
        .iter()
        .find(|l| l.limit == "per-second")
        .unwrap();
    assert!(per_second.newly_denied > 0);
    assert!(per_second.top.len() <= 3 && !per_second.top.is_empty());
    assert!(per_second
        .top
        .windows(2)
        .all(|w| w[0].denied >= w[1].denied));
    // The renderings name what they show.
    let whole = Report {
        lines: lines.len() as u64,
        first_us: lines[0].t,
        last_us: lines[lines.len() - 1].t,
        configs: vec![report, lower],
    };
    let text = table(&whole);
    assert!(
        text.contains("halved") && text.contains("per-second"),
        "{text}"
    );
    let picture = svg(&whole);
    assert!(picture.starts_with("<svg") && picture.trim_end().ends_with("</svg>"));
    let most = &whole.configs[0].limits[0].limit;
    assert!(
        picture.contains(&format!("who {most} would stop")),
        "{picture}"
    );
}

#[test]
fn consumer_values_are_escaped_in_the_picture() {
    let mut c = ConfigReport::empty("a<b>.yaml", 0, 1);
    c.limits = vec![LimitReport {
        limit: "l".into(),
        descriptors: Totals::default(),
        logged_denied: 0,
        newly_denied: 0,
        top: vec![Consumer {
            consumer: "user=\"><script>\u{1b}[2J\u{0}".into(),
            denied: 3,
            logged_denied: 0,
            requests: 4,
        }],
    }];
    c.timeline[0] = (1, 1, 0);
    c.timeline.push((0, 2, 1));
    let s = svg(&Report {
        lines: 3,
        first_us: 0,
        last_us: 1,
        configs: vec![c],
    });
    assert!(
        !s.contains("<script>") && s.contains("&lt;script&gt;"),
        "{s}"
    );
    assert!(!s.contains("a<b>"));
    assert!(
        !s.contains('\u{1b}') && !s.contains('\u{0}'),
        "no control characters"
    );
}

#[test]
fn consumers_carry_no_control_or_direction_character_to_the_terminal() {
    let shown = super::report::printable("[[\"user\",\"a\\u001b\u{9b}2J\u{202e}b\u{7f}\"]]");
    assert!(
        !shown.chars().any(|c| c.is_control() || c == '\u{202e}'),
        "{shown}"
    );
    assert!(
        shown.contains("\\u{9b}") && shown.contains("\\u{202e}"),
        "{shown}"
    );
}
