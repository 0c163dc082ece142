//! The Redis and Redis Cluster store end to end: several sluice instances sharing one Redis
//! admit exactly the limit, a denied request charges no key, one EVALSHA per decision, every
//! key has a TTL, and Redis faults answer UNAVAILABLE and heal without a restart.

use super::store::{redis_settings, redis_store, server_on_redis_settings};
use crate::support::redis::{start_cluster, start_redis};
use crate::support::*;
use sluice::clock::ManualClock;
use sluice::proto::rate_limit_response::Code;
use sluice::service::ServiceOptions;
use sluice::store::redis::RedisKind;
use sluice::store::CounterStore;
use std::sync::Arc;
use std::time::Duration;

const CALC: &str = r#"
domain: calc
counting: all_or_nothing
descriptors:
  - key: resource
    value: calc
    rate_limit: {unit: hour, requests_per_unit: 50}
    descriptors:
      - key: consumer
        rate_limit: {unit: hour, requests_per_unit: 5}
  - key: resource
    value: small
    rate_limit: {unit: hour, requests_per_unit: 5}
"#;

/// One sluice on the CALC config with a Redis store on a manual clock at T0.
async fn sluice_on(urls: Vec<String>, kind: RedisKind) -> TestServer {
    let clock = ManualClock::new(T0);
    TestServer::start_on(
        CALC,
        ServiceOptions::default(),
        Some(redis_store(urls, kind, &clock)),
        clock,
    )
    .await
}

/// Two sluice servers, each with its own Redis store (own connections), on one Redis.
async fn two_instances(urls: Vec<String>, kind: RedisKind) -> (TestServer, TestServer) {
    let clock = ManualClock::new(T0);
    let a = TestServer::start_on(
        CALC,
        ServiceOptions::default(),
        Some(redis_store(urls.clone(), kind, &clock)),
        clock.clone(),
    )
    .await;
    let b = TestServer::start_on(
        CALC,
        ServiceOptions::default(),
        Some(redis_store(urls, kind, &clock)),
        clock,
    )
    .await;
    (a, b)
}

/// Fires `n` concurrent calls alternating between the two servers; returns (ok, over).
pub(super) async fn concurrent(
    a: &TestServer,
    b: &TestServer,
    req: &sluice::proto::RateLimitRequest,
    n: usize,
) -> (usize, usize) {
    let mut tasks = Vec::new();
    for i in 0..n {
        let mut client = if i % 2 == 0 {
            a.client().await
        } else {
            b.client().await
        };
        let req = req.clone();
        tasks.push(tokio::spawn(async move {
            client.should_rate_limit(req).await.map(|r| r.into_inner())
        }));
    }
    let (mut ok, mut over) = (0, 0);
    for t in tasks {
        let r = t.await.expect("task").expect("call succeeds");
        match code(&r) {
            Code::Ok => ok += 1,
            Code::OverLimit => over += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    (ok, over)
}

async fn exactness(urls: Vec<String>, kind: RedisKind) {
    let (a, b) = two_instances(urls, kind).await;
    let big = one("calc", &[("resource", "calc")]);
    assert_eq!(concurrent(&a, &b, &big, 200).await, (50, 150));
    let small = one("calc", &[("resource", "small")]);
    assert_eq!(concurrent(&a, &b, &small, 10).await, (5, 5));
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_on_one_redis_admit_exactly_the_limit() {
    let redis = start_redis(&[]).await;
    exactness(vec![redis.url()], RedisKind::Single).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_on_one_cluster_admit_exactly_the_limit() {
    let cluster = start_cluster().await;
    exactness(cluster.seeds(), RedisKind::Cluster).await;
}

/// The count a fixed-window counter holds (its window key's value), or None.
fn count_in(
    keys: &[(String, i64)],
    redis_get: impl Fn(&str) -> String,
    needle: &str,
) -> Option<u64> {
    keys.iter()
        .find(|(k, _)| k.contains(needle))
        .and_then(|(k, _)| redis_get(k).trim().parse().ok())
}

#[tokio::test]
async fn a_denied_resource_plus_consumer_request_charges_neither_key() {
    let redis = start_redis(&[]).await;
    let s = sluice_on(vec![redis.url()], RedisKind::Single).await;
    // [resource=calc] (50/h) and [resource=calc, consumer=alice] (5/h) in one request.
    let both = request(
        "calc",
        vec![
            desc(&[("resource", "calc")]),
            desc(&[("resource", "calc"), ("consumer", "alice")]),
        ],
    );
    assert_eq!(admitted(&s, &both, 5).await, 5);
    let get = |k: &str| redis.cli(&["GET", k]);
    let keys = redis.keys_with_ttl();
    assert_eq!(count_in(&keys, get, "consumer=alice"), Some(5));
    assert_eq!(count_in(&keys, get, "resource=calc}:"), Some(5));
    // The consumer limit now denies: neither key moves.
    for _ in 0..3 {
        let r = s.call(both.clone()).await;
        assert_eq!(code(&r), Code::OverLimit);
    }
    let keys = redis.keys_with_ttl();
    assert_eq!(count_in(&keys, get, "consumer=alice"), Some(5));
    assert_eq!(
        count_in(&keys, get, "resource=calc}:"),
        Some(5),
        "resource not charged by denials"
    );
    s.stop().await;
}

#[tokio::test]
async fn one_evalsha_per_decision_and_every_key_has_a_ttl() {
    let redis = start_redis(&[]).await;
    let s = sluice_on(vec![redis.url()], RedisKind::Single).await;
    // Warm up: the first call may SCRIPT LOAD after NOSCRIPT.
    s.call(one("calc", &[("resource", "calc"), ("consumer", "warm")]))
        .await;
    redis.cli(&["CONFIG", "RESETSTAT"]);
    let single_group = request(
        "calc",
        vec![
            desc(&[("resource", "calc")]),
            desc(&[("resource", "calc"), ("consumer", "bob")]),
        ],
    );
    let decisions = 12; // 5 admitted, 7 denied by bob's 5/h
    for _ in 0..decisions {
        s.call(single_group.clone()).await;
    }
    assert_eq!(redis.evalsha_calls(), decisions);
    let keys = redis.keys_with_ttl();
    assert!(keys.len() >= 3, "{keys:?}");
    for (k, ttl) in &keys {
        assert!(*ttl > 0, "key {k} has no expiry (TTL {ttl})");
    }
    s.stop().await;
}

#[tokio::test]
async fn every_key_written_on_a_cluster_has_a_ttl_and_odd_values_work() {
    let cluster = start_cluster().await;
    let s = sluice_on(cluster.seeds(), RedisKind::Cluster).await;
    for consumer in ["{x}", "}{", "a:b", "a_b", "a|b=c", "雪", "é{é}:é", "%7B"] {
        let req = request(
            "calc",
            vec![
                desc(&[("resource", "calc")]),
                desc(&[("resource", "calc"), ("consumer", consumer)]),
            ],
        );
        // No CROSSSLOT: every key of the request carries the tag of [calc, resource=calc].
        assert_eq!(admitted(&s, &req, 6).await, 5, "consumer {consumer:?}");
    }
    let keys = cluster.keys_with_ttl();
    assert_eq!(keys.len(), 9, "8 consumers + 1 resource: {keys:?}");
    for (k, ttl) in &keys {
        assert!(*ttl > 0, "key {k} has no expiry (TTL {ttl})");
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_answers_unavailable_then_recovers_without_restart() {
    let mut redis = start_redis(&[]).await;
    let settings = sluice::store::redis::RedisSettings {
        timeout: std::time::Duration::from_secs(2),
        ..redis_settings(vec![redis.url()], RedisKind::Single)
    };
    let s = server_on_redis_settings(CALC, &settings).await;
    let req = one("calc", &[("resource", "small")]);
    assert_eq!(code(&s.call(req.clone()).await), Code::Ok);

    // A short blocking call (kill + reap); the multi-thread runtime keeps serving meanwhile.
    redis.stop();

    let mut client = s.client().await;
    for _ in 0..3 {
        let err = client
            .should_rate_limit(req.clone())
            .await
            .expect_err("Redis is down");
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    }

    redis.restart();
    // Decisions resume on the same sluice; the restarted Redis is empty, so the script is
    // reloaded after NOSCRIPT and the counter starts again.
    let resp = s.call(req.clone()).await;
    assert_eq!(code(&resp), Code::Ok);
    assert_eq!(resp.statuses[0].limit_remaining, 4);
    s.stop().await;
}

#[tokio::test]
async fn script_flush_does_not_break_the_next_call() {
    let redis = start_redis(&[]).await;
    let s = sluice_on(vec![redis.url()], RedisKind::Single).await;
    let req = one("calc", &[("resource", "small")]);
    assert_eq!(code(&s.call(req.clone()).await), Code::Ok);
    assert_eq!(redis.cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
    let r = s.call(req.clone()).await;
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 3);
    s.stop().await;
}

async fn cross_group_denial_refunds(store: Arc<dyn CounterStore>, clock: ManualClock) {
    let s = TestServer::start_on(CALC, ServiceOptions::default(), Some(store), clock).await;
    // resource=calc and resource=small carry different hash tags: two groups, two script calls.
    let both = request(
        "calc",
        vec![
            desc(&[("resource", "calc")]),
            desc(&[("resource", "small")]),
        ],
    );
    assert_eq!(admitted(&s, &both, 8).await, 5, "small (5/h) decides");
    // 3 denied requests were charged on calc's group and refunded: calc has 45 left, not 42.
    let r = s.call(one("calc", &[("resource", "calc")])).await;
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 44);
    s.stop().await;
}

test_with_redis_stores!(
    a_denial_in_one_group_refunds_the_other_groups_on,
    cross_group_denial_refunds
);

/// The minimal ACL documented in docs/redis.md: only what the script and the client need.
const ACL: &[&str] = &[
    "ACL",
    "SETUSER",
    "sluice",
    "on",
    ">s3cret",
    "~sluice_test:*",
    "resetchannels",
    "-@all",
    "+evalsha",
    "+script|load",
    "+ping",
    "+get",
    "+set",
    "+incrby",
    "+decrby",
    "+time",
    "+exists",
    "+zrange",
    "+zadd",
    "+zcard",
    "+zcount",
    "+zrem",
    "+zrevrange",
    "+zremrangebyrank",
    "+pexpire",
    "+del",
    "+cluster|slots",
    "+cluster|shards",
];

/// Every algorithm under one resource, so the ACL test runs every command the script can issue.
const ALL_ALGORITHMS: &str = r#"
domain: calc
counting: all_or_nothing
descriptors:
  - key: resource
    value: calc
    rate_limit: {requests_per_unit: 50, period: 10s, algorithm: sliding_log, applies_to_descendants: true}
    descriptors:
      - key: consumer
        rate_limits:
          - {requests_per_unit: 5, unit: hour}
          - {requests_per_unit: 5, unit: hour, algorithm: sliding_window}
          - {requests_per_unit: 5, unit: hour, algorithm: sliding_log}
          - {requests_per_unit: 5, unit: hour, algorithm: token_bucket}
  - key: other
    rate_limit: {requests_per_unit: 1, unit: hour}
"#;

async fn decide_as_acl_user(urls: Vec<String>, kind: RedisKind) {
    let settings = sluice::store::redis::RedisSettings {
        auth: Some("sluice:s3cret".into()),
        ..redis_settings(urls, kind)
    };
    let s = server_on_redis_settings(ALL_ALGORITHMS, &settings).await;
    let req = one("calc", &[("resource", "calc"), ("consumer", "acl")]);
    assert_eq!(admitted(&s, &req, 7).await, 5);
    // A refund exercises ZREMRANGEBYRANK on the log's newest entries.
    let mut refund = desc(&[("resource", "calc"), ("consumer", "acl")]);
    refund.hits_addend = Some(5);
    refund.is_negative_hits = true;
    let r = s.call(request("calc", vec![refund])).await;
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(admitted(&s, &req, 1).await, 1, "quota given back");
    // A request spanning two hash tags denied by one of them: on Cluster the other slot's
    // charges (every algorithm) are undone, as the ACL user too.
    let cross = request(
        "calc",
        vec![
            desc(&[("resource", "calc"), ("consumer", "acl2")]),
            desc(&[("other", "x")]),
        ],
    );
    assert_eq!(code(&s.call(cross.clone()).await), Code::Ok);
    let r = s.call(cross).await;
    assert_eq!(code(&r), Code::OverLimit);
    assert_eq!(
        r.statuses[0].limit_remaining, 4,
        "the denied request's charges were undone"
    );
    s.stop().await;
}

#[tokio::test]
async fn the_documented_minimal_acl_is_enough_on_redis() {
    let redis = start_redis(&[]).await;
    assert_eq!(redis.cli(ACL).trim(), "OK");
    decide_as_acl_user(vec![redis.url()], RedisKind::Single).await;
}

#[tokio::test]
async fn the_documented_minimal_acl_is_enough_on_cluster() {
    let cluster = start_cluster().await;
    for i in 0..3 {
        assert_eq!(cluster.cli(i, ACL).trim(), "OK");
    }
    decide_as_acl_user(cluster.seeds(), RedisKind::Cluster).await;
}

#[tokio::test]
async fn a_wrong_password_is_an_unavailable_answer_not_a_crash() {
    let redis = start_redis(&[]).await;
    assert_eq!(redis.cli(ACL).trim(), "OK");
    let settings = sluice::store::redis::RedisSettings {
        auth: Some("sluice:wrong".into()),
        ..redis_settings(vec![redis.url()], RedisKind::Single)
    };
    let s = server_on_redis_settings(CALC, &settings).await;
    let err = s
        .client()
        .await
        .should_rate_limit(one("calc", &[("resource", "small")]))
        .await
        .expect_err("auth fails");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(
        !err.message().contains("wrong"),
        "no secret in the error: {}",
        err.message()
    );
    s.stop().await;
}

/// EXPIRATION_JITTER_MAX_SECONDS: every key still expires after its window ends, but keys of one
/// window no longer expire in the same millisecond, and the jitter never more than doubles a
/// key's life (a per-second key is gone within a second of its window's end). Read with
/// PEXPIRETIME (absolute expiry), so the test does not depend on how long it runs.
#[tokio::test]
async fn expiration_jitter_spreads_expiry_without_outliving_the_window_twice() {
    const YAML: &str = "domain: jit\ndescriptors:\n  - key: hour\n    rate_limit: {unit: hour, requests_per_unit: 9}\n  - key: sec\n    rate_limit: {unit: second, requests_per_unit: 9}\n";
    let redis = start_redis(&[]).await;
    let mut expiries = Vec::new();
    for (prefix, jitter) in [("plain:", 0), ("jit:", 300)] {
        let settings = sluice::store::redis::RedisSettings {
            key_prefix: prefix.into(),
            expiration_jitter: std::time::Duration::from_secs(jitter),
            ..redis_settings(vec![redis.url()], RedisKind::Single)
        };
        let s = server_on_redis_settings(YAML, &settings).await;
        for i in 0..40 {
            let r = s
                .call(request(
                    "jit",
                    vec![
                        desc(&[("hour", &format!("h{i}"))]),
                        desc(&[("sec", &format!("s{i}"))]),
                    ],
                ))
                .await;
            assert_eq!(code(&r), Code::Ok);
        }
        // (key's window end, its absolute expiry), both in Unix milliseconds, per period.
        let mut hour = Vec::new();
        let mut sec = Vec::new();
        for key in redis.cli(&["KEYS", &format!("{prefix}*")]).lines() {
            let expiry: i64 = redis.cli(&["PEXPIRETIME", key]).trim().parse().expect("ms");
            assert_ne!(expiry, -1, "{key} has no expiry");
            if expiry == -2 {
                continue; // a per-second key that has already expired
            }
            let window: i64 = key
                .rsplit(':')
                .next()
                .and_then(|w| w.parse().ok())
                .expect("index");
            if key.contains("hour") {
                hour.push(((window + 1) * 3_600_000, expiry));
            } else if key.contains("sec") {
                sec.push(((window + 1) * 1_000, expiry));
            }
        }
        assert_eq!(hour.len(), 40, "{prefix}");
        // Every window's key lives its grace past its end (its period, at most a minute:
        // docs/semantics.md "Clocks and pinned windows"), then the jitter.
        let (hour_grace, sec_grace) = (60_000, 1_000);
        for &(end, expiry) in hour.iter() {
            assert!(
                expiry >= end + hour_grace && expiry <= end + hour_grace + 300_000 + 1,
                "{prefix} hour: {end} {expiry}"
            );
        }
        for &(end, expiry) in sec.iter() {
            assert!(
                // The jitter never more than doubles a key's life (its window and grace).
                expiry >= end + sec_grace && expiry <= end + 2 * (1_000 + sec_grace) + 1,
                "{prefix} second: {end} {expiry}"
            );
        }
        let spread = hour.iter().map(|h| h.1).max().unwrap_or(0)
            - hour.iter().map(|h| h.1).min().unwrap_or(0);
        expiries.push(spread);
        s.stop().await;
    }
    // Together: a key's TTL is relative (PEXPIRE), from the script's clock reading to
    // Redis's command time, so a busy machine preempting a script spreads them by a few ms
    // (2 ms beside a loaded suite run); the jitter spreads them by seconds.
    assert!(
        expiries[0] <= 50,
        "without jitter one window's keys expire together: {expiries:?}"
    );
    assert!(
        expiries[1] > 1_000,
        "with jitter they spread out: {expiries:?}"
    );
}

/// FAILURE_MODE=local's write-back: every check records its hits (a denied request's too), a
/// token applies once (a retry after a lost reply never charges twice), and a new token
/// charges again; a negative debt (recorded refund) gives hits back.
async fn write_back_once(kind: &str) {
    use sluice::store::WriteBack;
    let (store, _clock, _backend) = super::store::make_redis_store(kind).await;
    let limit = sluice::config::Limit::fixed(10, sluice::config::Unit::Minute);
    let mut owed = sluice::store::LimitCheck::for_tests("wb", "k", limit, 4);
    owed.record = true;
    let ttl = Duration::from_secs(60);
    let remaining = |store: Arc<sluice::store::redis::RedisStore>| async move {
        let probe = sluice::store::LimitCheck::for_tests("wb", "k", limit, 0);
        store.decide(&[probe]).await.expect("decides").outcomes[0].remaining
    };
    store
        .write_back(std::slice::from_ref(&owed), "replica-1", ttl)
        .await
        .expect("write-back");
    assert_eq!(remaining(Arc::clone(&store)).await, 6);
    // The same token again: a retry, applied once.
    store
        .write_back(std::slice::from_ref(&owed), "replica-1", ttl)
        .await
        .expect("retried write-back");
    assert_eq!(
        remaining(Arc::clone(&store)).await,
        6,
        "a retry charges nothing"
    );
    // A debt past the limit is recorded whole (the hits were admitted).
    owed.hits = 9;
    store
        .write_back(std::slice::from_ref(&owed), "replica-2", ttl)
        .await
        .expect("second write-back");
    assert_eq!(remaining(Arc::clone(&store)).await, 0);
    // A negative debt gives hits back: 13 - 5 = 8 used.
    owed.hits = 5;
    owed.refund = true;
    store
        .write_back(std::slice::from_ref(&owed), "replica-3", ttl)
        .await
        .expect("refund write-back");
    assert_eq!(remaining(Arc::clone(&store)).await, 2);
}

test_with_redis_stores!(a_write_back_applies_once_per_token_on, kind => write_back_once);
