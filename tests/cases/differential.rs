//! The randomized differential test: random request sequences (descriptors, hits, overrides,
//! shadow and quota limits, all four algorithms, hierarchies, several limits per descriptor,
//! both countings, refunds, and, besides the golden seeds, `in_flight` slots and reservations)
//! under a manual clock that jumps across window edges, run through
//! the gRPC API on memory, Redis, a Redis Cluster, Valkey and a Valkey cluster. Every answer
//! (overall code, and per status its code, limit, remaining and reset) must be the same on the
//! five stores, and, for
//! the fixed seeds, the same as the golden answers recorded from the build before the store
//! redesign (`tests/golden/differential.txt`), so a refactor of the store cannot change a
//! decision unnoticed. Regression seeds (each once found the stores disagreeing) compare the
//! stores with each other, with and without STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT. Ten fresh
//! seeds, new on every run, do the same. Cluster is compared on every step of every seed; a
//! failure prints its seed (`SLUICE_DIFF_SEED=<seed>` replays it).
//!
//! `SLUICE_RECORD_GOLDEN=1` rewrites the golden file from the build under test (only ever from
//! a build whose behaviour is the reference).

use super::store::make_store;
use crate::support::*;
use futures_util::StreamExt;
use sluice::proto::rate_limit_descriptor::RateLimitOverride;
use sluice::proto::{RateLimitRequest, RateLimitResponse};
use sluice::service::ServiceOptions;
use std::fmt::Write;
use std::time::Duration;

/// The limits both domains have (every algorithm, shadow, quota mode), then each domain's own,
/// then the resource + consumer hierarchy.
const COMMON: &str = r#"  - key: api
    rate_limits:
      - {requests_per_unit: 4, unit: second}
      - {requests_per_unit: 9, period: 10s, algorithm: sliding_window}
  - key: log
    rate_limit: {requests_per_unit: 3, period: 2s, algorithm: sliding_log}
  - key: bucket
    rate_limit: {requests_per_unit: 5, period: 5s, algorithm: token_bucket, burst: 2}
  - key: shadow
    shadow_mode: true
    rate_limit: {requests_per_unit: 2, unit: second}
  - key: quota
    quota_mode: true
    rate_limit: {requests_per_unit: 6, unit: minute}
  - key: slot
    in_flight: {max: 2, lease: 3s, id_key: rid, done_key: rdone}
  - key: tok
    rate_limits:
      - {requests_per_unit: 20, unit: minute}
      - {requests_per_unit: 12, period: 5s, algorithm: sliding_window}
    reservations: {lease: 2s, id_key: rid, done_key: rdone, max: 3}
  - key: tokl
    rate_limit: {requests_per_unit: 10, period: 3s, algorithm: sliding_log}
    reservations: {lease: 2s, id_key: rid, done_key: rdone, max: 3}
  - key: tokb
    rate_limit: {requests_per_unit: 8, period: 4s, algorithm: token_bucket, burst: 4}
    in_flight: {max: 2, lease: 3s, id_key: rid, done_key: rdone}
    reservations: {lease: 4s, id_key: rid, done_key: rdone}
"#;
const HIERARCHY: &str = r#"  - key: resource
    value: r
    rate_limit: {requests_per_unit: 7, period: 3s, algorithm: sliding_log, applies_to_descendants: true}
    descriptors:
      - key: consumer
        rate_limits:
          - {requests_per_unit: 3, period: 3s}
          - {requests_per_unit: 20, unit: minute, algorithm: token_bucket}
"#;
/// envoyproxy counting: wildcards, `replaces`, `unlimited`.
const ENV_OWN: &str = r#"  - key: path
    value: /api/*
    rate_limit: {requests_per_unit: 3, unit: second, name: prefix}
  - key: path
    value: /api/admin
    rate_limit: {requests_per_unit: 1, unit: second, name: admin, replaces: [{name: prefix}]}
  - key: free
    rate_limit: {unlimited: true}
"#;
/// all_or_nothing: a limit that records usage.
const AON_OWN: &str = r#"  - key: budget
    rate_limit: {requests_per_unit: 30, unit: minute, record_usage: true}
"#;

fn domain_file(head: &str, own: &str) -> String {
    format!("{head}descriptors:\n{COMMON}{own}{HIERARCHY}")
}

/// Fixed seeds whose answers are golden.
const GOLDEN_SEEDS: [u64; 3] = [1, 2, 3];
/// Seeds that once found a difference between the stores (compared with each other only):
/// 1795489182115476029, two checks of one request on one counter in a Cluster slot whose charge
/// was undone reported different `remaining` than memory.
/// 1795490515931641160: a refund under STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT. 1795490535363210060:
/// an all-or-nothing refund in a Cluster slot whose request another slot denied.
/// 1795490851698986543: two checks on one counter, one not charged, on memory.
/// 1795491040869275339 and 1795491127042725332: a refund (or shadow) quota-mode limit counted in
/// the quota rule by the script and by Cluster, not by `Admission`.
/// 1795568438354380472: STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT, two checks on one counter,
/// the first not charged: standalone Redis's fast path reported the counter after the request,
/// not as it stood. 1795491180310110749, 1795491300476300946 and 1795491385093329822: once
/// known Cluster differences (an all_or_nothing refund spanning slots; two checks of one
/// counter under STOP), now decided exactly; 1795491385093329822 also found, with the in_flight
/// descriptors, a take of an id already holding its slot on a denied request reported after
/// the request by the script and as stored by memory. 722060521966259239: two quota-mode checks of one
/// counter on Cluster, the second denied and not charged, reports what it saw.
/// 1795607807879463867: an in_flight free under STOP on a request whose other limit was over:
/// not applied by memory, applied (and not undoable) in its own Cluster slot; a free is now
/// always applied. 1795655488708527156: a reservation of 0 hits on a Cluster request spanning
/// slots: its dry slot was never committed (nothing "charged"), so the reservation was not kept
/// and a retry of its id reserved again. 1795664549246848383: a Cluster slot naming one token
/// bucket twice (a plain charge and a settle's recorded excess) charged both, then undid the
/// charge the request's verdict did not take: the excess had been clamped after that charge,
/// so the bucket ended 2 s emptier than memory's; such a slot is now decided dry and
/// committed with the verdict. 1795568438354380472 (again, once the lease metrics were
/// compared): a free of a slot only an uncharged take of the same request held was reported
/// as freeing it. 1795721803375608294: a request taking an id's slot (denied: full) and then
/// freeing the same id: the memory store's decision saw its own denial (remaining 0), the
/// script's did not (1); and a Cluster slot written exactly kept the slot the others freed.
/// A denial is now remembered by the store after the request's other checks, on every store.
const REGRESSION_SEEDS: [u64; 15] = [
    1_795_721_803_375_608_294,
    1_795_664_549_246_848_383,
    1_795_655_488_708_527_156,
    1_795_607_807_879_463_867,
    1_795_568_438_354_380_472,
    722_060_521_966_259_239,
    1_795_491_180_310_110_749,
    1_795_491_300_476_300_946,
    1_795_491_385_093_329_822,
    1_795_489_182_115_476_029,
    1_795_490_515_931_641_160,
    1_795_490_535_363_210_060,
    1_795_490_851_698_986_543,
    1_795_491_040_869_275_339,
    1_795_491_127_042_725_332,
];
/// Fresh seeds per run (besides the regression seeds), each run with and without STOP.
const FRESH_SEEDS: u64 = 10;
/// Requests per sequence.
const STEPS: usize = 120;

/// One random request (and how far the clock moves before it).
fn random_request(rng: &mut Rng) -> (Duration, RateLimitRequest) {
    let domain = if rng.below(2) == 0 { "env" } else { "aon" };
    let n = 1 + rng.below(3) as usize;
    let mut descriptors = Vec::with_capacity(n);
    for _ in 0..n {
        let value = format!("v{}", rng.below(3));
        let consumer = format!("c{}", rng.below(3));
        let entries: Vec<(&str, String)> = match rng.below(10) {
            0 => vec![("api", value)],
            1 => vec![("log", value)],
            2 => vec![("bucket", value)],
            3 => vec![("shadow", value)],
            4 => vec![("quota", value)],
            5 => vec![(
                "path",
                ["/api/x", "/api/admin", "/other"][rng.below(3) as usize].into(),
            )],
            6 => vec![("free", value)],
            7 => vec![("budget", value)],
            _ => vec![("resource", "r".into()), ("consumer", consumer)],
        };
        let pairs: Vec<(&str, &str)> = entries.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut d = desc(&pairs);
        d.hits_addend = match rng.below(8) {
            0 => Some(0),
            1 => Some(2),
            2 => Some(5),
            _ => None,
        };
        if rng.below(20) == 0 {
            d.is_negative_hits = true;
            d.hits_addend = Some(1 + rng.below(2));
        }
        if rng.below(25) == 0 {
            d.limit = Some(RateLimitOverride {
                requests_per_unit: 2 + rng.below(3) as u32,
                unit: 1 + rng.below(2) as i32, // SECOND or MINUTE
            });
        }
        descriptors.push(d);
    }
    let mut r = request(domain, descriptors);
    r.hits_addend = if rng.below(6) == 0 { 2 } else { 0 };
    // Mostly small steps, sometimes across a window edge or a whole period.
    let dt = match rng.below(10) {
        0 => Duration::from_micros(rng.below(5_000_000)),
        1..=3 => Duration::from_micros(rng.below(1_000_000)),
        _ => Duration::from_micros(rng.below(100_000)),
    };
    (dt, r)
}

/// Sometimes one more descriptor, on the `in_flight` limit: a take, a free (of an id that may
/// or may not hold a slot) or a check. Drawn from its own generator, so the golden seeds (run
/// without it) keep their sequences.
fn maybe_lease(rng: &mut Rng, r: &mut RateLimitRequest) {
    if rng.below(3) != 0 {
        return;
    }
    // Sometimes two or three on one request (one slot counter, a take and a free of one id
    // seen in order, as on a copy).
    let n = [1, 1, 1, 2, 3][rng.below(5) as usize];
    let slot = format!("s{}", rng.below(2));
    for _ in 0..n {
        let id = format!("r{}", rng.below(6));
        let mut entries = vec![("slot", slot.as_str())];
        match rng.below(10) {
            0..=4 => entries.push(("rid", &id)),
            5..=8 => entries.push(("rdone", &id)),
            _ => {}
        }
        r.descriptors.push(desc(&entries));
    }
}

/// Sometimes one or two more descriptors on the limits with `reservations` (fixed, sliding
/// window, sliding_log, a token bucket beside an `in_flight` limit): a reservation of 0 to 6
/// hits, a settle at 0 to 6 (of an id that may or may not hold one) or a plain charge. From a
/// generator of its own, so the seeds found before keep their sequences.
fn maybe_reserve(rng: &mut Rng, r: &mut RateLimitRequest) {
    if rng.below(3) != 0 {
        return;
    }
    for _ in 0..[1, 1, 2][rng.below(3) as usize] {
        let key = ["tok", "tokl", "tokb"][rng.below(3) as usize];
        let value = format!("u{}", rng.below(2));
        let id = format!("q{}", rng.below(5));
        let mut entries = vec![(key, value.as_str())];
        match rng.below(10) {
            0..=4 => entries.push(("rid", &id)),
            5..=8 => entries.push(("rdone", &id)),
            _ => {}
        }
        let mut d = desc(&entries);
        d.hits_addend = Some(rng.below(7));
        r.descriptors.push(d);
    }
}

/// The answer as one comparable line.
fn answer_line(r: &RateLimitResponse) -> String {
    let mut line = format!("{}", r.overall_code);
    for s in &r.statuses {
        let limit = s
            .current_limit
            .as_ref()
            .map(|l| format!("{}/{}:{}", l.requests_per_unit, l.unit, l.name))
            .unwrap_or_else(|| "-".into());
        let reset = s
            .duration_until_reset
            .as_ref()
            .map(|d| format!("{}s{}n", d.seconds, d.nanos))
            .unwrap_or_else(|| "-".into());
        let _ = write!(line, " [{} {limit} {} {reset}]", s.code, s.limit_remaining);
    }
    line
}

/// Runs `seed`'s sequence on one store kind; returns one answer line per request.
async fn run(kind: &str, seed: u64, options: ServiceOptions, leases: bool) -> Vec<String> {
    let (store, clock, _backend) = make_store(kind).await;
    let base = sluice::app::Ingredients::for_tests(
        rules_of(&[
            ("env.yaml", &domain_file("domain: env\n", ENV_OWN)),
            (
                "aon.yaml",
                &domain_file("domain: aon\ncounting: all_or_nothing\n", AON_OWN),
            ),
        ]),
        std::sync::Arc::new(clock.clone()),
    );
    let config = sluice::server::ServerConfig::from_ingredients(sluice::app::Ingredients {
        store: crate::support::stack(store, "test"),
        options,
        ..base
    });
    let s = TestServer::start_config(config, clock.clone()).await;
    let mut rng = Rng::new(seed);
    let mut lease_rng = Rng::new(seed ^ 0x5eed_1ea5e);
    let mut reserve_rng = Rng::new(seed ^ 0x7e5e_47e5);
    let mut lines = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        let (dt, mut req) = random_request(&mut rng);
        if leases {
            maybe_lease(&mut lease_rng, &mut req);
            maybe_reserve(&mut reserve_rng, &mut req);
        }
        clock.advance(dt);
        if std::env::var("SLUICE_DIFF_DEBUG").is_ok() && kind == "memory" {
            println!("{} {:?} {:?}", lines.len(), dt, req);
        }
        let line = answer_line(&s.call(req).await);
        if std::env::var("SLUICE_DIFF_DEBUG").is_ok() {
            println!("{kind} {} {line}", lines.len());
            let (_, metrics) = http(s.http_addr, "GET", "/metrics", "").await;
            for l in metrics
                .lines()
                .filter(|l| l.starts_with("sluice_in_flight_slots{domain=\"aon"))
            {
                println!("{kind} {} {l}", lines.len());
            }
        }
        lines.push(line);
    }
    if leases {
        // What the store said each lease call did, as the lease metrics have it: slots and
        // reservations held, releases of nothing. (Ended leases are left out: the script drops
        // them on any call, the memory store when it writes the counter, so the count of the
        // moment differs while the sequence runs; tests/cases/lease_metrics.rs checks it.)
        let (_, metrics) = http(s.http_addr, "GET", "/metrics", "").await;
        let mut kept: Vec<&str> = metrics
            .lines()
            .filter(|l| {
                l.starts_with("sluice_in_flight_slots{")
                    || l.starts_with("sluice_reservations_outstanding{")
                    || l.starts_with("sluice_lease_releases_unmatched_total{")
            })
            .collect();
        kept.sort_unstable();
        lines.push(format!("lease metrics: {}", kept.join("; ")));
    }
    s.stop().await;
    lines
}

fn golden_path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/differential.txt")
}

/// The golden answers: `seed step line` per request.
fn read_golden() -> Vec<(u64, usize, String)> {
    let text = std::fs::read_to_string(golden_path()).expect("tests/golden/differential.txt");
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let mut parts = l.splitn(3, ' ');
            let seed = parts.next().and_then(|p| p.parse().ok()).expect("seed");
            let step = parts.next().and_then(|p| p.parse().ok()).expect("step");
            (seed, step, parts.next().unwrap_or_default().to_string())
        })
        .collect()
}

async fn compare(seed: u64, golden: Option<&[String]>) -> Vec<String> {
    compare_with(seed, golden, ServiceOptions::default(), false).await
}

/// Runs `seed` on the three stores and compares every answer, and with `golden` when given.
async fn compare_with(
    seed: u64,
    golden: Option<&[String]>,
    options: ServiceOptions,
    leases: bool,
) -> Vec<String> {
    let stop = options.stop_increment_when_over;
    // The five stores run side by side: each has its own servers and clock.
    let (memory, redis, cluster, valkey, valkey_cluster) = tokio::join!(
        run("memory", seed, options.clone(), leases),
        run("redis", seed, options.clone(), leases),
        run("cluster", seed, options.clone(), leases),
        run("valkey", seed, options.clone(), leases),
        run("valkey_cluster", seed, options, leases),
    );
    for (name, other) in [("Redis", &redis), ("Cluster", &cluster)] {
        assert_eq!(memory.len(), other.len(), "seed {seed}: memory vs {name}");
    }
    for step in 0..memory.len() {
        let m = &memory[step];
        for (name, other) in [
            ("Redis", &redis),
            ("Cluster", &cluster),
            ("Valkey", &valkey),
            ("Valkey Cluster", &valkey_cluster),
        ] {
            assert_eq!(
                m, &other[step],
                "seed {seed} step {step} (stop {stop}): memory vs {name}"
            );
        }
        if let Some(g) = golden.filter(|_| step < STEPS) {
            assert_eq!(
                m, &g[step],
                "seed {seed} step {step}: against the golden answer"
            );
        }
    }
    memory
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_agree_with_each_other_and_with_the_golden_answers() {
    if std::env::var("SLUICE_RECORD_GOLDEN").is_ok() {
        let mut out = String::from(
            "# Golden answers of tests/cases/differential.rs: seed, step, then the answer\n\
             # (overall code; per status: code, limit, remaining, reset). Recorded from the build\n\
             # before the store redesign (issue 23); rewrite only from a reference build.\n",
        );
        for seed in GOLDEN_SEEDS {
            for (step, line) in compare(seed, None).await.iter().enumerate() {
                let _ = writeln!(out, "{seed} {step} {line}");
            }
        }
        std::fs::create_dir_all(golden_path().parent().expect("dir")).expect("mkdir");
        std::fs::write(golden_path(), out).expect("write the golden answers");
        return;
    }
    let golden = read_golden();
    for seed in GOLDEN_SEEDS {
        let lines: Vec<String> = golden
            .iter()
            .filter(|(s, _, _)| *s == seed)
            .map(|(_, _, l)| l.clone())
            .collect();
        assert_eq!(lines.len(), STEPS, "seed {seed}: golden answers");
        compare(seed, Some(&lines)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_agree_on_fresh_random_sequences() {
    let seeds: Vec<u64> = match std::env::var("SLUICE_DIFF_SEED") {
        Ok(s) => vec![s.parse().expect("SLUICE_DIFF_SEED is a number")],
        Err(_) => {
            let base = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(7);
            let fresh = (0..FRESH_SEEDS).map(|i| base.wrapping_add(i) | 1 << 40);
            REGRESSION_SEEDS.into_iter().chain(fresh).collect()
        }
    };
    for seed in &seeds {
        println!("differential seed {seed} (SLUICE_DIFF_SEED={seed} replays it)");
    }
    // Every seed with and without envoyproxy's STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT (only
    // the keys over their limit are charged when one is), a few runs side by side: each run
    // waits on its round trips far more than it computes.
    let runs = seeds.into_iter().flat_map(|seed| {
        [false, true].map(|stop| {
            let options = ServiceOptions {
                stop_increment_when_over: stop,
                ..ServiceOptions::default()
            };
            // The lease limits too (in_flight slots taken, freed and ending with their lease;
            // reservations made, settled and ending with theirs). Boxed, and made inside the
            // box: a debug build's comparison future is large, and an array of them built on
            // the test thread's stack overflowed its 2 MiB.
            Box::pin(async move { compare_with(seed, None, options, true).await })
        })
    });
    futures_util::stream::iter(runs)
        .buffer_unordered(4)
        .collect::<Vec<_>>()
        .await;
}
