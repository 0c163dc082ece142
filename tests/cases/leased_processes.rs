//! Leased limits across real replicas: three `sluice` processes on one real Redis, loaded with
//! `sluice bench` over gRPC at once, each deciding one hot resource from its slices.
//!
//! - 20 000/min offered several times over in one window: never more than 20 000 admitted in
//!   total, at least 19 000, and once every replica has stopped (SIGTERM: each gives its
//!   unspent slice back) the counter holds exactly what was admitted.
//! - A limit never reached: at most 0.01 script calls per decision (counted by Redis).
//! - SIGTERM of one of three replicas mid-window: its unspent slice comes back at once (the
//!   counter holds exactly what it admitted), so the other two can spend it.
//! - Three replicas on a 3-master Cluster, a leased resource above per-consumer limits: never
//!   over either, the script calls spread over the masters, and the counters hold exactly what
//!   was admitted once every slice is back.
//!
//! Nothing here is timed: the windows are a minute long and a run starts early in one (it waits
//! for the next when fewer than 20 s are left), and what is asserted are counts.

use crate::support::binary::{bench_load, serve, SluiceProcess};
use crate::support::redis::{start_cluster, start_redis, RedisServer};
use std::time::Duration;

fn config(limit: u64, max_slice: Option<u32>) -> String {
    let leased = match max_slice {
        Some(n) => format!("{{max_slice: {n}}}"),
        None => "{}".to_string(),
    };
    // all_or_nothing: a request a slice cannot decide (its waits for refills ran out) goes to
    // the store as a charge, never as a hit recorded past the limit as envoyproxy counting
    // records it, so the counter equals what was admitted once every slice is back.
    format!(
        "domain: hot\ncounting: all_or_nothing\ndescriptors:\n  - key: resource\n    value: api\n    leased: {leased}\n    \
         rate_limit: {{unit: minute, requests_per_unit: {limit}}}\n"
    )
}

/// Three replicas on `redis` serving `yaml`.
async fn replicas(
    redis: &RedisServer,
    yaml: &str,
    n: usize,
) -> (tempfile::TempDir, Vec<SluiceProcess>) {
    replicas_on(
        &[("REDIS_URL", &redis.url()), ("REDIS_TYPE", "single")],
        yaml,
        n,
    )
    .await
}

/// `n` replicas with the store settings `store` serving `yaml`.
async fn replicas_on(
    store: &[(&str, &str)],
    yaml: &str,
    n: usize,
) -> (tempfile::TempDir, Vec<SluiceProcess>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("hot.yaml");
    std::fs::write(&path, yaml).expect("write config");
    let mut out = Vec::new();
    for _ in 0..n {
        let mut c = serve(&path);
        for (k, v) in store {
            c.env(k, v);
        }
        out.push(SluiceProcess::spawn(c).await);
    }
    (dir, out)
}

/// Waits for the next minute when fewer than 20 s of this one are left, so a run stays in one
/// window (a wait, never a measurement).
fn seconds_into_the_minute() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970");
    now.as_secs() % 60
}

async fn early_in_a_minute() {
    let into = seconds_into_the_minute();
    if into >= 40 {
        tokio::time::sleep(Duration::from_secs(61 - into)).await;
    }
}

/// `sluice bench` on `target` for `secs`: (ok, over_limit).
async fn load(target: String, duration: &str) -> (u64, u64) {
    load_as(target, duration, "resource=api", 1).await
}

/// [`load`] with the descriptor template `descriptor` (`{id}` one of `consumers`).
async fn load_as(target: String, duration: &str, descriptor: &str, consumers: u64) -> (u64, u64) {
    bench_load(&target, ("hot", descriptor, consumers), 0, duration).await
}

/// The resource's counter value(s) in Redis (one key per window).
fn counters(redis: &RedisServer) -> Vec<(String, u64)> {
    let keys = redis.cli(&["KEYS", "*resource=api*"]);
    keys.lines()
        .filter(|k| !k.is_empty())
        .map(|k| {
            let v = redis.cli(&["GET", k]).trim().parse().unwrap_or(0);
            (k.to_string(), v)
        })
        .collect()
}

async fn stop_all(replicas: &mut [SluiceProcess]) -> String {
    let mut logs = String::new();
    for r in replicas.iter_mut() {
        r.sigterm();
        let (code, log) = r.exit().await;
        assert_eq!(code, Some(0), "clean exit:\n{log}");
        logs.push_str(&log);
    }
    logs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_never_admit_over_a_hot_limit_and_spend_nearly_all_of_it() {
    let redis = start_redis(&[]).await;
    let (_dir, mut rs) = replicas(&redis, &config(20_000, None), 3).await;
    early_in_a_minute().await;
    // Rounds of load on all three at once until 5x the limit was offered, within the minute.
    let (mut ok, mut offered, mut rounds) = (0, 0, 0);
    while offered < 100_000 && seconds_into_the_minute() < 50 {
        let (a, b, c) = tokio::join!(
            load(rs[0].grpc_url(), "1s"),
            load(rs[1].grpc_url(), "1s"),
            load(rs[2].grpc_url(), "1s")
        );
        ok += a.0 + b.0 + c.0;
        offered += a.0 + a.1 + b.0 + b.1 + c.0 + c.1;
        rounds += 1;
    }
    let logs = stop_all(&mut rs).await;
    eprintln!("offered {offered} in {rounds} rounds, admitted {ok}");
    assert!(
        offered >= 25_000,
        "the load must exceed the limit well: {offered}"
    );
    assert!(ok <= 20_000, "{ok} admitted against 20 000");
    assert!(
        ok >= 19_000,
        "{ok} admitted of 20 000 with {offered} offered"
    );
    let windows = counters(&redis);
    assert_eq!(windows.len(), 1, "one window: {windows:?}");
    assert_eq!(
        windows[0].1, ok,
        "every replica stopped and gave its slice back: the counter holds what was admitted\n{logs}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_never_reached_costs_at_most_a_hundredth_of_a_script_call_per_decision() {
    let redis = start_redis(&[]).await;
    // `ahead: 1s`: a grant covers a second of a replica's demand, whatever the machine's speed.
    let yaml = config(1_000_000_000, None).replace("leased: {}", "leased: {ahead: 1s}");
    let (_dir, mut rs) = replicas(&redis, &yaml, 3).await;
    early_in_a_minute().await;
    let before = redis.evalsha_calls();
    let (a, b, c) = tokio::join!(
        load(rs[0].grpc_url(), "2s"),
        load(rs[1].grpc_url(), "2s"),
        load(rs[2].grpc_url(), "2s")
    );
    let calls = redis.evalsha_calls() - before;
    let decisions = a.0 + b.0 + c.0;
    eprintln!("{calls} script calls for {decisions} decisions");
    assert_eq!(a.1 + b.1 + c.1, 0, "nothing denied");
    assert!(decisions >= 600, "{decisions}");
    assert!(
        calls * 100 <= decisions,
        "{calls} script calls for {decisions} decisions: more than 0.01 per decision"
    );
    stop_all(&mut rs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_stopped_mid_window_gives_its_unspent_slice_back() {
    let redis = start_redis(&[]).await;
    // Large slices, so the stopped replica holds many units when it stops.
    let (_dir, mut rs) = replicas(&redis, &config(20_000, Some(5_000)), 3).await;
    early_in_a_minute().await;
    // Load until the replica holds units it has not spent (a load that ends exactly on an
    // empty slice would show nothing; a second short one does).
    let (mut a_ok, mut held) = (0, 0);
    for _ in 0..5 {
        a_ok += load(rs[0].grpc_url(), "300ms").await.0;
        held = counters(&redis).iter().map(|(_, v)| v).sum();
        if held > a_ok {
            break;
        }
    }
    rs[0].sigterm();
    let (code, log) = rs[0].exit().await;
    assert_eq!(code, Some(0), "{log}");
    assert!(
        held > a_ok,
        "the replica held an unspent slice when it stopped ({held} granted, {a_ok} admitted)"
    );
    assert!(log.contains("gave unspent slices"), "{log}");
    let after: u64 = counters(&redis).iter().map(|(_, v)| v).sum();
    assert_eq!(
        after, a_ok,
        "after SIGTERM the counter holds what the stopped replica admitted, its slice came back"
    );
    // The other two spend the rest: up to the limit minus what was admitted.
    let (b, c) = tokio::join!(load(rs[1].grpc_url(), "3s"), load(rs[2].grpc_url(), "3s"));
    let mut rest = rs.split_off(1);
    stop_all(&mut rest).await;
    let total = a_ok + b.0 + c.0;
    eprintln!(
        "stopped replica admitted {a_ok}, the others {} and {}",
        b.0, c.0
    );
    assert!(total <= 20_000, "{total} admitted against 20 000");
    let final_count: u64 = counters(&redis).iter().map(|(_, v)| v).sum();
    assert_eq!(
        final_count, total,
        "all slices back: the counter is what was admitted"
    );
    if b.1 + c.1 > 0 {
        // They ran dry: what they did not spend was at most their two last slices.
        assert!(total + 2 * 5_000 >= 20_000, "{total} admitted of 20 000");
    }
}

/// Three replicas on a real 3-master Cluster, a leased resource (5 000/min) above 100 consumers
/// (60/min each, 6 000 in all) loaded at once, several times over: never more than the resource
/// admitted, every consumer within its own limit, the script calls spread over the masters
/// (none above 60 %: the consumers' counters have hash tags of their own), and once all three
/// stopped (their slices back) the resource's counter holds what was admitted, as do the
/// consumers' together (all_or_nothing: a request charges its consumer only when admitted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_three_replicas_keep_the_resource_and_every_consumer_within_their_limits() {
    let cluster = start_cluster().await;
    let yaml = config(5_000, Some(50)).replace(
        "requests_per_unit: 5000}\n",
        "requests_per_unit: 5000, applies_to_descendants: true}\n    own_hash_tags: true\n    \
             descriptors:\n      - key: consumer\n        rate_limit: {unit: minute, \
             requests_per_unit: 60}\n",
    );
    assert!(yaml.contains("key: consumer"), "{yaml}");
    let seeds = cluster.seeds().join(",");
    let store = [("REDIS_URL", seeds.as_str()), ("REDIS_TYPE", "cluster")];
    let (_dir, mut rs) = replicas_on(&store, &yaml, 3).await;
    early_in_a_minute().await;
    let before: Vec<u64> = (0..3).map(|i| cluster.node(i).evalsha_calls()).collect();
    let descriptor = "resource=api,consumer=c{id}";
    let (mut ok, mut offered) = (0, 0);
    while offered < 20_000 && seconds_into_the_minute() < 50 {
        let (a, b, c) = tokio::join!(
            load_as(rs[0].grpc_url(), "1s", descriptor, 100),
            load_as(rs[1].grpc_url(), "1s", descriptor, 100),
            load_as(rs[2].grpc_url(), "1s", descriptor, 100)
        );
        ok += a.0 + b.0 + c.0;
        offered += a.0 + a.1 + b.0 + b.1 + c.0 + c.1;
    }
    let calls: Vec<u64> = (0..3)
        .map(|i| cluster.node(i).evalsha_calls() - before[i])
        .collect();
    let logs = stop_all(&mut rs).await;
    eprintln!("offered {offered}, admitted {ok}, script calls per master {calls:?}");
    assert!(
        offered >= 10_000,
        "the load must exceed the limit well: {offered}"
    );
    assert!(ok <= 5_000, "{ok} admitted against the resource's 5 000");
    // At most three last slices (3 x 50) unspent when the resource ran dry.
    assert!(ok >= 4_500, "{ok} admitted of 5 000 with {offered} offered");
    let total: u64 = calls.iter().sum();
    for c in &calls {
        assert!(
            *c * 100 <= total * 60,
            "script calls per master {calls:?}: one master above 60 %"
        );
    }
    // Every counter, from the masters (each key lives on one).
    let (mut resource, mut consumers, mut most) = (0, 0, 0);
    for i in 0..3 {
        for key in cluster.cli(i, &["KEYS", "*resource=api*"]).lines() {
            if key.is_empty() {
                continue;
            }
            let v: u64 = cluster.cli(i, &["GET", key]).trim().parse().unwrap_or(0);
            if key.contains("consumer=") {
                consumers += v;
                most = most.max(v);
            } else {
                resource += v;
            }
        }
    }
    assert!(
        most <= 60,
        "a consumer's counter holds {most}, its limit is 60"
    );
    assert_eq!(
        resource, ok,
        "every replica stopped and gave its slices back: the resource holds what was admitted\n{logs}"
    );
    assert_eq!(
        consumers, ok,
        "the consumers' counters hold what was admitted"
    );
}
