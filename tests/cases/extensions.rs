//! The sluice extensions end to end on every store (memory, real Redis, real Cluster): the
//! resource + consumer seed scenario, several limits per descriptor, and a parity property test
//! showing the memory store and the Lua script decide identically for every algorithm.

use super::store::{make_store, Backend};
use crate::support::*;
use sluice::config::{Algorithm, Limit, Period};
use sluice::proto::rate_limit_response::Code;
use sluice::service::ServiceOptions;
use sluice::store::{CounterKey, LimitCheck};
use std::sync::Arc;
use std::time::Duration;

/// The resource + consumer example of docs/semantics.md: resource `calc` 5 per 10 s for everyone together
/// (a resource limit), each consumer 3 per 10 s, both sliding_log.
const SEED: &str = r#"
domain: calc
counting: all_or_nothing
descriptors:
  - key: resource
    value: calc
    rate_limit:
      requests_per_unit: 5
      period: 10s
      algorithm: sliding_log
      applies_to_descendants: true
    descriptors:
      - key: consumer
        rate_limits:
          - {requests_per_unit: 3, period: 10s, algorithm: sliding_log}
"#;

/// The hand simulation of the seed scenario for t = 0..29 s: consumer A calls every second,
/// B every two seconds (A first when both call at once). A request is admitted only if the
/// resource log (hits within the last 10 s) has fewer than 5 entries AND the consumer's has
/// fewer than 3; a denied request adds to neither.
///   t=0  A+ B+   (resource 2, A 1, B 1)
///   t=1  A+      (resource 3, A 2)
///   t=2  A+ B+   (resource 5, A 3, B 2)
///   t=3..9       everything denied (resource full; A full too)
///   t=10 A+ B+   (the t=0 hits left the window: t > now - 10 s)
///   ... the pattern repeats every 10 s.
fn seed_expected() -> Vec<(u64, &'static str, bool)> {
    let mut v = Vec::new();
    for t in 0..30u64 {
        let phase = t % 10;
        v.push((t, "A", phase <= 2));
        if t % 2 == 0 {
            v.push((t, "B", phase == 0 || phase == 2));
        }
    }
    v
}

async fn seed_scenario(kind: &str) {
    let (store, clock, backend) = make_store(kind).await;
    let s = TestServer::start_on(SEED, ServiceOptions::default(), Some(store), clock.clone()).await;
    let mut got = Vec::new();
    for (t, consumer, _) in seed_expected() {
        clock.set(T0 + Duration::from_secs(t));
        let before = counts(&backend);
        let r = s
            .call(one("calc", &[("resource", "calc"), ("consumer", consumer)]))
            .await;
        let ok = code(&r) == Code::Ok;
        got.push((t, consumer, ok));
        if let Some(after) = counts(&backend) {
            // Redis: the sorted sets never hold more than their limits, and a denial adds
            // nothing to either.
            for (key, n) in &after {
                let cap = if key.contains("consumer=") { 3 } else { 5 };
                assert!(*n <= cap, "{key} holds {n} entries at t={t}");
            }
            if !ok {
                assert_eq!(before, Some(after), "a denial at t={t} changed a counter");
            }
        }
    }
    assert_eq!(got, seed_expected(), "{kind}");
    s.stop().await;
}

/// Entries per sliding-log key (ZCARD), for the Redis backends; None for memory.
fn counts(backend: &Backend) -> Option<Vec<(String, u64)>> {
    let keys_and_card = |keys: Vec<(String, i64)>, card: &dyn Fn(&str) -> String| {
        let mut v: Vec<(String, u64)> = keys
            .into_iter()
            .map(|(k, _)| {
                let n = card(&k).trim().parse().unwrap_or(0);
                (k, n)
            })
            .collect();
        v.sort();
        v
    };
    match backend {
        Backend::Memory => None,
        Backend::Redis(r) => Some(keys_and_card(r.keys_with_ttl(), &|k| r.cli(&["ZCARD", k]))),
        Backend::Cluster(c) => Some(keys_and_card(c.keys_with_ttl(), &|k| {
            c.cli_cluster(&["ZCARD", k])
        })),
    }
}

test_with_all_stores!(seed_scenario_on, kind => seed_scenario);

const TWO_LIMITS: &str = r#"
domain: api
counting: all_or_nothing
descriptors:
  - key: client
    rate_limits:
      - {requests_per_unit: 10, unit: second}
      - {requests_per_unit: 20, unit: minute}
"#;

async fn twenty_first_in_a_minute_is_denied(kind: &str) {
    let (store, clock, _backend) = make_store(kind).await;
    let s = TestServer::start_on(
        TWO_LIMITS,
        ServiceOptions::default(),
        Some(store),
        clock.clone(),
    )
    .await;
    let req = one("api", &[("client", "c")]);
    assert_eq!(admitted(&s, &req, 11).await, 10, "{kind}: 10 per second");
    let r = s.call(req.clone()).await;
    assert_eq!(
        limit_of(&r.statuses[0]),
        Some((10, "SECOND".into())),
        "the denying limit speaks"
    );
    clock.advance(Duration::from_secs(1));
    assert_eq!(admitted(&s, &req, 10).await, 10, "{kind}: a fresh second");
    clock.advance(Duration::from_secs(1));
    let r = s.call(req.clone()).await;
    assert_eq!(code(&r), Code::OverLimit, "{kind}: the 21st in the minute");
    assert_eq!(limit_of(&r.statuses[0]), Some((20, "MINUTE".into())));
    assert_eq!(r.statuses[0].limit_remaining, 0);
    clock.advance(Duration::from_secs(58));
    assert_eq!(admitted(&s, &req, 1).await, 1, "{kind}: a fresh minute");
    s.stop().await;
}

test_with_all_stores!(several_limits_per_descriptor_on, kind => twenty_first_in_a_minute_is_denied);

#[tokio::test]
async fn odd_periods_report_an_honest_rate() {
    let s = TestServer::start(
        r#"
domain: odd
descriptors:
  - key: a
    rate_limit: {requests_per_unit: 5, period: 10s}
  - key: b
    rate_limit: {requests_per_unit: 5, period: 60s, algorithm: token_bucket}
  - key: c
    rate_limit: {requests_per_unit: 5, period: 11s, name: eleven}
"#,
    )
    .await;
    let r = s.call(one("odd", &[("a", "x")])).await;
    let l = r.statuses[0].current_limit.clone().expect("limit");
    assert_eq!((l.requests_per_unit, l.name.as_str()), (30, "5/10s"));
    assert_eq!(limit_of(&r.statuses[0]), Some((30, "MINUTE".into())));
    let r = s.call(one("odd", &[("b", "x")])).await;
    assert_eq!(
        limit_of(&r.statuses[0]),
        Some((5, "MINUTE".into())),
        "60s is a minute"
    );
    assert_eq!(
        r.statuses[0].limit_remaining, 4,
        "burst 4: 5 tokens, one used"
    );
    let r = s.call(one("odd", &[("c", "x")])).await;
    assert_eq!(limit_of(&r.statuses[0]), Some((5, "UNKNOWN".into())));
    s.stop().await;
}

// ---- parity: memory store vs the Lua script on real Redis ---------------------------------

fn limit(alg: Algorithm, rpu: u32, period_ms: u64, burst: u32) -> Limit {
    Limit {
        requests_per_unit: rpu,
        period: Period::from_millis(period_ms).expect("period"),
        algorithm: alg,
        burst: if alg == Algorithm::TokenBucket {
            burst
        } else {
            0
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_and_redis_decide_identically_for_every_algorithm() {
    let (redis, redis_clock, _b) = make_store("redis").await;
    let (memory, memory_clock, _m) = make_store("memory").await;
    let mut steps = 0;
    // (admitted, denied) per algorithm: the sequences must exercise both sides.
    let mut seen = [(0u32, 0u32); 4];
    for seed in 1..=32u64 {
        let mut rng = Rng::new(seed);
        let alg = Algorithm::ALL[(seed % 4) as usize];
        // The counting: all or nothing; envoyproxy (every check records); envoyproxy with
        // STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT; all or nothing with the shared limit
        // recording usage (`record_usage`).
        let counting = (seed / 4) % 4;
        let (record_shared, record_consumer, stop) = match counting {
            0 => (false, false, false),
            1 => (true, true, false),
            2 => (true, true, true),
            _ => (true, false, false),
        };
        // Two limits per request on the same resource (one per consumer, one shared), random
        // quotas and periods, so every path (admit, deny, window roll, refund) is hit.
        let shared = limit(
            alg,
            1 + rng.below(6) as u32,
            1000 * (1 + rng.below(5)),
            rng.below(3) as u32,
        );
        let per_consumer = limit(
            alg,
            1 + rng.below(4) as u32,
            500 * (1 + rng.below(6)),
            rng.below(3) as u32,
        );
        let domain: Arc<str> = Arc::from(format!("parity{seed}").as_str());
        let start = crate::support::T0 + Duration::from_micros(rng.below(1_000_000));
        redis_clock.set(start);
        memory_clock.set(start);
        for step in 0..40 {
            let consumer = format!("c{}", rng.below(3));
            let hits = [0, 1, 1, 1, 2, 3][rng.below(6) as usize];
            let refund = rng.below(10) == 0;
            let key = |entries: Vec<(String, String)>, l: Limit| CounterKey {
                domain: Arc::clone(&domain),
                entries: entries.into(),
                limit: l,
                overridden: false,
                domain_tag: false,
                own_tag: false,
                candidate: false,
            };
            let checks = vec![
                LimitCheck {
                    key: key(vec![("resource".into(), "r".into())], shared),
                    hits,
                    refund,
                    shadow: false,
                    quota: false,
                    record: record_shared,
                    stop_over: stop,
                    admin_limit: None,
                    window: None,
                    lease: None,
                    leased: false,
                    slice: None,
                    candidate: false,
                },
                LimitCheck {
                    key: key(
                        vec![
                            ("resource".into(), "r".into()),
                            ("consumer".into(), consumer),
                        ],
                        per_consumer,
                    ),
                    hits,
                    refund,
                    shadow: rng.below(8) == 0,
                    quota: false,
                    record: record_consumer,
                    stop_over: stop,
                    admin_limit: None,
                    window: None,
                    lease: None,
                    leased: false,
                    slice: None,
                    candidate: false,
                },
            ];
            let mut m = memory.decide(&checks).await.expect("memory decides");
            let r = redis.decide(&checks).await.expect("redis decides");
            // When each store decided is its own (the memory store's instant, for the decision
            // log); what it decided must be the same.
            m.at = r.at;
            assert_eq!(
                m, r,
                "seed {seed} step {step} ({alg:?}, counting {counting}, shared {shared:?}, consumer {per_consumer:?}, hits {hits}, refund {refund})"
            );
            steps += 1;
            let tally = &mut seen[(seed % 4) as usize];
            if m.admitted {
                tally.0 += 1;
            } else {
                tally.1 += 1;
            }
            // Advance 0..1.5 s in microseconds: window edges land anywhere.
            let dt = Duration::from_micros(rng.below(1_500_000));
            redis_clock.advance(dt);
            memory_clock.advance(dt);
        }
    }
    assert_eq!(steps, 32 * 40);
    for (i, (admitted, denied)) in seen.iter().enumerate() {
        assert!(
            *admitted > 20 && *denied > 20,
            "{:?}: {admitted} admitted, {denied} denied",
            Algorithm::ALL[i]
        );
    }
}

/// Measures Redis `MEMORY USAGE` of one counter per algorithm at a typical limit (100 per
/// minute, the counter full). Not a pass/fail test: run it to refresh the table in docs/performance.md with
/// `cargo test --test it measure_redis_memory -- --ignored --nocapture`.
#[tokio::test]
#[ignore = "measurement for docs/performance.md, not a check"]
async fn measure_redis_memory_per_counter() {
    let (store, _clock, backend) = make_store("redis").await;
    let Backend::Redis(redis) = &backend else {
        panic!("redis backend");
    };
    println!("| algorithm | key | MEMORY USAGE (bytes) |");
    for alg in Algorithm::ALL {
        let l = limit(alg, 100, 60_000, 99);
        let check = LimitCheck {
            key: CounterKey {
                domain: Arc::from("mem"),
                entries: Arc::from(vec![
                    ("resource".into(), "calc".into()),
                    ("consumer".into(), "alice".into()),
                ]),
                limit: l,
                overridden: false,
                domain_tag: false,
                own_tag: false,
                candidate: false,
            },
            hits: 1,
            record: false,
            stop_over: false,
            admin_limit: None,
            window: None,
            lease: None,
            leased: false,
            slice: None,
            candidate: false,
            refund: false,
            shadow: false,
            quota: false,
        };
        for _ in 0..100 {
            store
                .decide(std::slice::from_ref(&check))
                .await
                .expect("decide");
        }
        let keys = redis.keys_with_ttl();
        let (key, _) = keys
            .iter()
            .find(|(k, _)| k.contains(&format!(":{}:", short(alg))))
            .expect("key written");
        let bytes = redis.cli(&["MEMORY", "USAGE", key]);
        println!("| {} | `{key}` | {} |", alg.name(), bytes.trim());
    }
}

fn short(alg: Algorithm) -> &'static str {
    match alg {
        Algorithm::FixedWindow => "fw",
        Algorithm::SlidingWindow => "sw",
        Algorithm::SlidingLog => "slw",
        Algorithm::TokenBucket => "tb",
        Algorithm::InFlight => "if",
    }
}
