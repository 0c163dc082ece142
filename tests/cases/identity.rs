//! One identity per counter (issue 50, items 1 and 2): a limit's counter is the same whatever
//! the shape of the request that reaches it, whatever `leased:` says above it, and a pinned
//! window (a leased or a calendar one) is decided on the store's clock at its edges.
//!
//! - A resource limit above a leased resource is one counter for requests that stop at the
//!   leased node and for requests that go below it (memory, Redis, Cluster).
//! - On Redis, a leased window of 1500 ms keeps its plain key (`<key>:<index>`, the one the
//!   limit has without `leased:`) and that key outlives the window on the store's clock; a
//!   pinned window that ended on the store's clock longer than its grace ago is never charged
//!   again: a leased one is charged in the store's current window, a calendar one is refused,
//!   and a give-back to it returns nothing to any window.

use crate::cases::store::{make_redis_store, make_store, Backend};
use crate::support::{code, one, TestServer, T0};
use sluice::config::{Leasing, Limit, Period, Quota};
use sluice::proto::rate_limit_response::Code;
use sluice::store::{CounterStore, LimitCheck};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// The review's config: 10/min on `team` (depth 2) above a leased `project` with `user` below.
const TEAM_ABOVE_LEASED: &str = r#"
domain: d
counting: all_or_nothing
descriptors:
  - key: org
    value: a
    descriptors:
      - key: team
        value: t
        rate_limit: {unit: minute, requests_per_unit: 10, applies_to_descendants: true}
        descriptors:
          - key: project
            value: p
            leased: {}
            rate_limit: {unit: minute, requests_per_unit: 1000, applies_to_descendants: true}
            descriptors:
              - key: user
                rate_limit: {unit: minute, requests_per_unit: 1000}
"#;

/// The memory variant: 5/min on `org` (depth 1), `leased` on `team`, `user` below.
const ORG_ABOVE_LEASED: &str = r#"
domain: d
counting: all_or_nothing
descriptors:
  - key: org
    value: a
    rate_limit: {unit: minute, requests_per_unit: 5, applies_to_descendants: true}
    descriptors:
      - key: team
        value: t
        leased: {}
        rate_limit: {unit: minute, requests_per_unit: 1000, applies_to_descendants: true}
        descriptors:
          - key: user
            rate_limit: {unit: minute, requests_per_unit: 1000}
"#;

/// Alternates a request that stops at the leased node with one that goes below it, 3x the
/// limit above: exactly `limit` admitted (one counter), never 2x (one per request shape).
async fn alternated(kind: &str, yaml: &str, shallow: &[(&str, &str)], limit: usize) {
    let (store, clock, _backend) = make_store(kind).await;
    let server =
        TestServer::start_on(yaml, sluice::ServiceOptions::default(), Some(store), clock).await;
    let mut deep = shallow.to_vec();
    deep.push(("user", "u"));
    let mut admitted = 0;
    for i in 0..3 * limit {
        let entries = if i % 2 == 0 { shallow } else { &deep[..] };
        admitted += usize::from(code(&server.call(one("d", entries)).await) == Code::Ok);
    }
    server.stop().await;
    assert_eq!(
        admitted, limit,
        "{kind}: the limit above the leased node admitted {admitted} of {limit}: it must be one \
         counter for every request depth"
    );
}

async fn a_resource_above_a_leased_one_is_one_counter(kind: &str) {
    alternated(
        kind,
        TEAM_ABOVE_LEASED,
        &[("org", "a"), ("team", "t"), ("project", "p")],
        10,
    )
    .await;
    alternated(kind, ORG_ABOVE_LEASED, &[("org", "a"), ("team", "t")], 5).await;
}

test_with_stores!(resource_above_leased_on, [memory, redis, cluster], kind => a_resource_above_a_leased_one_is_one_counter);

/// The slack the test-only time override adds to every TTL (head.lua: an hour), in the whole
/// seconds `TTL` reads: a key must not expire in real time while the manual clock stands still.
const SLACK_S: i64 = 3_600;

fn us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).expect("in range")
}

/// A check of `hits` on the leased 20 per 1500 ms limit, its window pinned to `window` as the
/// plan pins a leased one (`None`: a plain check, the limit without `leased:`).
fn leased_1500(hits: u64, window: Option<(Duration, Duration)>) -> LimitCheck {
    let period = Period::from_millis(1500).expect("positive");
    let limit = Limit {
        requests_per_unit: 20,
        period,
        algorithm: sluice::config::Algorithm::FixedWindow,
        burst: 0,
    };
    let mut c = LimitCheck::for_tests("d", "api", limit, hits);
    c.window = window.map(|(s, e)| (us(s), us(e)));
    c.slice = window.map(|_| Leasing {
        max_slice: 1,
        ahead: Period::from_millis(100).expect("positive"),
        global: false,
    });
    c
}

async fn decide(store: &Arc<dyn CounterStore>, c: &LimitCheck) -> (bool, u32) {
    let d = store
        .decide(std::slice::from_ref(c))
        .await
        .expect("decided");
    (d.outcomes[0].allowed, d.outcomes[0].remaining)
}

fn redis_of(backend: &Backend) -> &crate::support::redis::RedisServer {
    match backend {
        Backend::Redis(r) => r,
        _ => panic!("a standalone Redis"),
    }
}

/// Finding 1: the window [T0 + 1.5 s, T0 + 3 s) starts on a half second. Its key is the plain
/// one (what the limit counts on without `leased:`), and it lives past the window's end by the
/// grace on the store's clock (before: `<key>:c<whole seconds>`, expiring 0.5 s early, then
/// rewritten with a 1 ms TTL).
#[tokio::test]
async fn a_leased_window_of_1500ms_keeps_its_plain_key_past_its_end() {
    let (store, clock, backend) = make_redis_store("redis").await;
    let store: Arc<dyn CounterStore> = store;
    let window = (
        T0 + Duration::from_millis(1500),
        T0 + Duration::from_secs(3),
    );
    clock.set(T0 + Duration::from_millis(2900));
    assert_eq!(
        decide(&store, &leased_1500(3, Some(window))).await,
        (true, 17)
    );
    // The same counter as the limit without `leased:` (a check-only plain request).
    assert_eq!(
        decide(&store, &leased_1500(0, None)).await,
        (true, 17),
        "a plain check in the same window sees the leased grant: one counter"
    );
    let index = us(window.0) / 1_500_000;
    let keys = redis_of(&backend).keys_with_ttl();
    let (key, ttl) = keys
        .iter()
        .find(|(k, _)| k.ends_with(&format!(":{index}")))
        .unwrap_or_else(|| panic!("no key of window index {index}: {keys:?}"));
    // 100 ms left in the window, 1500 ms of grace after it: 1.6 s, which `TTL` rounds to 2
    // (before: 1 ms, read as 0).
    let left_s = ttl - SLACK_S;
    assert!(
        left_s >= 1,
        "{key}: {left_s} s left on the store's clock, for a window that ends in 100 ms and a \
         grace of 1500 ms"
    );
    assert!(
        !keys.iter().any(|(k, _)| k.contains(":c")),
        "no calendar-style key for an epoch-aligned window: {keys:?}"
    );
}

/// Finding 2: a pinned window that ended on the store's clock longer than its grace ago (a
/// replica whose clock lags by more) is never charged again. A leased grant is decided in the
/// store's current window; a give-back to the dead one returns nothing anywhere.
#[tokio::test]
async fn a_leased_grant_on_a_window_the_store_saw_end_counts_in_the_current_one() {
    let (store, clock, backend) = make_redis_store("redis").await;
    let store: Arc<dyn CounterStore> = store;
    let dead = (T0, T0 + Duration::from_millis(1500));
    // The store is 10 s on: the window ended 8.5 s ago, its grace 1.5 s.
    clock.set(T0 + Duration::from_secs(10));
    assert_eq!(
        decide(&store, &leased_1500(4, Some(dead))).await,
        (true, 16)
    );
    assert_eq!(
        decide(&store, &leased_1500(0, None)).await,
        (true, 16),
        "the grant was charged in the store's current window"
    );
    let dead_index = us(dead.0) / 1_500_000;
    let keys = redis_of(&backend).keys_with_ttl();
    assert!(
        !keys
            .iter()
            .any(|(k, _)| k.ends_with(&format!(":{dead_index}"))),
        "nothing written to the dead window's key: {keys:?}"
    );
    for (k, ttl) in &keys {
        assert!(
            ttl - SLACK_S >= 1,
            "{k}: a key written with a TTL of {} s past the slack",
            ttl - SLACK_S
        );
    }
    // A give-back of 4 to the dead window: nothing returned to the current one.
    let mut back = leased_1500(4, Some(dead));
    back.refund = true;
    decide(&store, &back).await;
    assert_eq!(
        decide(&store, &leased_1500(0, None)).await,
        (true, 16),
        "a give-back to a window the store saw end gives nothing to the current one"
    );
}

/// A calendar day's limit, as the config loads it.
fn calendar_day() -> Limit {
    let rules = crate::support::rules(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: day, requests_per_unit: 5, calendar: {}}\n",
    );
    let node = &rules.domains["d"].root.bare["k"];
    match node.rate_limits[0].quota {
        Quota::Limited(l) => l,
        Quota::Unlimited => panic!("limited"),
    }
}

/// A calendar window that ended on the store's clock longer than its grace ago: a charge is
/// refused and writes nothing (before: granted, on a fresh key with a 1 ms TTL).
#[tokio::test]
async fn a_calendar_window_the_store_saw_end_is_never_charged() {
    let (store, clock, backend) = make_redis_store("redis").await;
    let store: Arc<dyn CounterStore> = store;
    let limit = calendar_day();
    let cal = limit
        .period
        .calendar()
        .expect("a calendar period")
        .calendar();
    let window = cal.window_at(us(T0)).expect("a window");
    let mut c = LimitCheck::for_tests("d", "x", limit, 1);
    c.window = Some(window);
    // The store's clock is a day and 5 minutes past the window's end.
    clock.set(Duration::from_micros(window.1) + Duration::from_secs(86_400 + 300));
    let (allowed, _) = decide(&store, &c).await;
    assert!(
        !allowed,
        "a charge on a calendar window the store saw end a day ago was granted"
    );
    let keys = redis_of(&backend).keys_with_ttl();
    assert!(keys.is_empty(), "nothing written: {keys:?}");
    // Within its grace (a minute after its end on the store's clock) it is still counted.
    clock.set(Duration::from_micros(window.1) + Duration::from_secs(30));
    assert_eq!(decide(&store, &c).await, (true, 4));
    let keys = redis_of(&backend).keys_with_ttl();
    assert!(
        keys.iter().all(|(_, ttl)| ttl - SLACK_S >= 20),
        "the window's key lives out its grace: {keys:?}"
    );
}

/// A replica's clock: the store's manual clock, offset by `ms` (negative: it lags the store).
#[derive(Debug)]
struct Offset {
    clock: sluice::clock::ManualClock,
    ms: i64,
}

impl sluice::clock::Clock for Offset {
    fn now(&self) -> Duration {
        let now = sluice::clock::Clock::now(&self.clock);
        let by = Duration::from_millis(self.ms.unsigned_abs());
        if self.ms < 0 {
            now - by
        } else {
            now + by
        }
    }
}

/// One replica's check on the leased 1 000 per second limit, its window pinned by its own clock.
fn leased_per_second(replica_now: Duration, hits: u64) -> LimitCheck {
    let limit = Limit::fixed(1_000, sluice::config::Unit::Second);
    let mut c = LimitCheck::for_tests("d", "api", limit, hits);
    let now = us(replica_now);
    let start = now - now % 1_000_000;
    c.window = Some((start, start + 1_000_000));
    c.slice = Some(Leasing {
        max_slice: 10,
        ahead: Period::from_millis(100).expect("positive"),
        global: false,
    });
    c
}

/// Replicas whose clocks are offset from one Redis (the store's clock is the manual one the
/// script decides on), under load far above a leased 1 000/s limit: every window's counter
/// holds at most the limit; in store time, what one second admits is within the bound of
/// docs/semantics.md ("Clocks and pinned windows": limit x (1 + ceil(offset spread / period)));
/// with every replica lagging by the same 200 ms (a store whose clock runs ahead), each
/// replica-clock window admits at most the limit, and a window offered more than it admits at
/// least the limit less what the slices may strand (replicas x max_slice).
async fn skewed_replicas(offsets_ms: &[i64], seed: u64) {
    use sluice::store::slices::{SlicedDecider, Slices};
    use sluice::store::{Decider, Plain};
    let (store, clock, backend) = make_redis_store("redis").await;
    let store: Arc<dyn CounterStore> = store;
    clock.set(T0 + Duration::from_millis(500));
    let replicas: Vec<(i64, SlicedDecider)> = offsets_ms
        .iter()
        .map(|&ms| {
            let own = Arc::new(Offset {
                clock: clock.clone(),
                ms,
            });
            let slices = Slices::new(Arc::clone(&store), own, (1000, false));
            (
                ms,
                SlicedDecider::new(slices, Arc::new(Plain(Arc::clone(&store)))),
            )
        })
        .collect();
    let mut rng = crate::support::Rng::new(seed);
    // (store second, replica window) -> admitted
    let mut by_store: HashMap<u64, u64> = HashMap::new();
    let mut by_replica_window: HashMap<u64, u64> = HashMap::new();
    let mut offered: HashMap<u64, u64> = HashMap::new();
    let end = T0 + Duration::from_secs(8);
    while sluice::clock::Clock::now(&clock) < end {
        clock.advance(Duration::from_micros(1 + rng.below(4_000)));
        let store_now = sluice::clock::Clock::now(&clock);
        let (ms, r) = &replicas[rng.below(replicas.len() as u64) as usize];
        let replica_now = Offset {
            clock: clock.clone(),
            ms: *ms,
        };
        let replica_now = sluice::clock::Clock::now(&replica_now);
        let burst = 1 + rng.below(12);
        let window = replica_now.as_secs();
        *offered.entry(window).or_default() += burst;
        let calls = (0..burst).map(|_| r.decide_by(vec![leased_per_second(replica_now, 1)], None));
        for d in futures_util::future::join_all(calls).await {
            if d.expect("decided").admitted {
                *by_store.entry(store_now.as_secs()).or_default() += 1;
                *by_replica_window.entry(window).or_default() += 1;
            }
        }
    }
    let mut seconds: Vec<_> = by_store.iter().collect();
    seconds.sort();
    eprintln!("seed {seed}, offsets {offsets_ms:?}: admitted per store second {seconds:?}");
    let spread = offsets_ms.iter().max().unwrap_or(&0) - offsets_ms.iter().min().unwrap_or(&0);
    let bound = 1_000 * (1 + u64::try_from(spread).unwrap_or(0).div_ceil(1_000));
    for (second, admitted) in &by_store {
        assert!(
            *admitted <= bound,
            "seed {seed}, offsets {offsets_ms:?}: store second {second} admitted {admitted}, \
             bound {bound}"
        );
    }
    // Every window's counter on Redis holds at most the limit.
    let redis = redis_of(&backend);
    for (key, _) in redis.keys_with_ttl() {
        let count: u64 = redis.cli(&["GET", &key]).trim().parse().unwrap_or(0);
        assert!(count <= 1_000, "seed {seed}: {key} holds {count}");
    }
    if spread == 0 {
        let stranded = replicas.len() as u64 * 10;
        for (window, admitted) in &by_replica_window {
            assert!(
                *admitted <= 1_000,
                "seed {seed}, offsets {offsets_ms:?}: window {window} admitted {admitted}"
            );
            // Windows the run saw whole (not its first or last), offered well over the limit.
            let whole = *window > T0.as_secs() && *window + 1 < end.as_secs();
            if whole && offered[window] >= 1_500 {
                assert!(
                    *admitted + stranded >= 1_000,
                    "seed {seed}: window {window} offered {}, admitted {admitted}",
                    offered[window]
                );
            }
        }
    }
}

#[tokio::test]
async fn replicas_two_seconds_apart_on_one_redis_stay_within_the_bound() {
    skewed_replicas(&[-2_000, -200, 0, 200, 2_000], 50).await;
}

#[tokio::test]
async fn a_redis_whose_clock_runs_200ms_ahead_admits_the_limit_per_window() {
    skewed_replicas(&[-200, -200, -200], 51).await;
}
