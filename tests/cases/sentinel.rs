//! `REDIS_TYPE=sentinel` against a real master, replica and three sentinels: decisions exact
//! under concurrency, then the master killed, the replica promoted, and decisions resuming on the
//! same sluice, with the counts carried over.

use super::store::redis_settings;
use crate::support::sentinel::{SentinelSetup, MASTER_NAME};
use crate::support::*;
use sluice::clock::ManualClock;
use sluice::proto::rate_limit_response::Code;
use sluice::service::ServiceOptions;
use sluice::store::redis::{RedisKind, RedisSettings, RedisStore, SentinelSettings};
use sluice::store::CounterStore;
use std::sync::Arc;
use std::time::Duration;

const RULES: &str = r#"
domain: s
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 10}
"#;

/// `n` concurrent calls on "k=`value`", spread over `servers` (each its own connection).
async fn codes_on(servers: &[&TestServer], value: &str, n: usize) -> (usize, usize) {
    let mut tasks = Vec::new();
    for i in 0..n {
        let mut client = servers[i % servers.len()].client().await;
        let req = one("s", &[("k", value)]);
        tasks.push(tokio::spawn(async move {
            client.should_rate_limit(req).await.map(|r| r.into_inner())
        }));
    }
    let (mut ok, mut over) = (0, 0);
    for t in tasks {
        match code(&t.await.expect("task").expect("call")) {
            Code::Ok => ok += 1,
            Code::OverLimit => over += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    (ok, over)
}

async fn codes(s: &TestServer, value: &str, n: usize) -> (usize, usize) {
    codes_on(&[s], value, n).await
}

fn sentinel_store(
    setup: &SentinelSetup,
    clock: &ManualClock,
    sentinel_auth: Option<&str>,
) -> Arc<dyn CounterStore> {
    let settings = RedisSettings {
        sentinel: Some(SentinelSettings {
            master_name: MASTER_NAME.into(),
            auth: sentinel_auth.map(str::to_string),
        }),
        // Short, so calls against the dead master fail fast and the pool reconnects.
        timeout: Duration::from_millis(500),
        ..redis_settings(setup.urls(), RedisKind::Sentinel)
    };
    Arc::new(
        RedisStore::new(&settings)
            .expect("sentinel store")
            .with_test_clock(Arc::new(clock.clone())),
    )
}

/// The first decision on "k=`value`" that is not UNAVAILABLE (calls fail until the pool has a
/// connection to the new master; the loop only bounds a hang).
async fn first_decision(s: &TestServer, value: &str) -> sluice::proto::RateLimitResponse {
    poll_until("a decision after the failover", || async {
        let mut client = s.client().await;
        match client.should_rate_limit(one("s", &[("k", value)])).await {
            Ok(r) => Ok(r.into_inner()),
            Err(e) => {
                assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
                Err(e)
            }
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_follow_a_failover_without_a_restart() {
    // The sentinels require a password (REDIS_SENTINEL_AUTH); the master does not.
    let mut setup = SentinelSetup::start_with_password(Some("sentinel-secret"));
    let clock = ManualClock::new(T0);
    let store = sentinel_store(&setup, &clock, Some("sentinel-secret"));
    let other = sentinel_store(&setup, &clock, Some("sentinel-secret"));
    let s =
        TestServer::start_on(RULES, ServiceOptions::default(), Some(store), clock.clone()).await;
    let s2 = TestServer::start_on(RULES, ServiceOptions::default(), Some(other), clock).await;

    // Exact under concurrency, as on standalone: 60 callers through two sluice instances, a
    // limit of 10.
    assert_eq!(codes_on(&[&s, &s2], "a", 60).await, (10, 50));
    s2.stop().await;
    // Another counter, partly used before the failover.
    assert_eq!(codes(&s, "b", 4).await, (4, 0));
    assert!(
        setup.master.cli(&["KEYS", "*"]).contains("k=b"),
        "the counters live on the master the sentinels named"
    );
    setup.wait_replicated();

    setup.kill_master_and_fail_over();

    let first = first_decision(&s, "b").await;
    // The 5th hit of "b": its four earlier hits survived on the promoted replica.
    assert_eq!(code(&first), Code::Ok);
    assert_eq!(first.statuses[0].limit_remaining, 5);
    assert_eq!(
        codes(&s, "b", 8).await,
        (5, 3),
        "exact after the failover too"
    );
    assert_eq!(codes(&s, "a", 3).await, (0, 3), "\"a\" stays used up");
    assert!(
        setup.replica.cli(&["KEYS", "*"]).contains("k=b"),
        "decided on the promoted replica"
    );
    s.stop().await;
}

/// A master demoted to a replica keeps running (the sentinels close its clients as they
/// reconfigure it): sluice must reconnect to the master the sentinels name, not to the address
/// it used before, and carry on without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_master_is_left_for_the_promoted_one() {
    let setup = SentinelSetup::start();
    let clock = ManualClock::new(T0);
    let store = sentinel_store(&setup, &clock, None);
    let s = TestServer::start_on(RULES, ServiceOptions::default(), Some(store), clock).await;
    assert_eq!(codes(&s, "c", 3).await, (3, 0));
    setup.wait_replicated();

    setup.force_failover();

    let first = first_decision(&s, "c").await;
    assert_eq!(code(&first), Code::Ok);
    assert_eq!(first.statuses[0].limit_remaining, 6, "the 4th hit of \"c\"");
    assert_eq!(codes(&s, "c", 8).await, (6, 2));
    s.stop().await;
}

/// Counting on Sentinel (the standalone path behind another connector): a token budget's report
/// past the limit is recorded (envoyproxy counting), and a rejected request charges nothing in
/// an all_or_nothing domain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counting_follows_the_domain_on_sentinel() {
    let setup = SentinelSetup::start();
    let clock = ManualClock::new(T0);
    let store = sentinel_store(&setup, &clock, None);
    let rules = r#"
domain: s
descriptors:
  - key: budget
    rate_limit: {unit: hour, requests_per_unit: 1000}
"#;
    let s = TestServer::start_on(rules, ServiceOptions::default(), Some(store), clock).await;
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let mut check = desc(&[("budget", "u")]);
        check.hits_addend = Some(0);
        let denied = code(&s.call(request("s", vec![check])).await) == Code::OverLimit;
        statuses.push(denied);
        if !denied {
            let mut report = desc(&[("budget", "u")]);
            report.hits_addend = Some(400);
            s.call(request("s", vec![report])).await;
        }
    }
    assert_eq!(
        statuses,
        [false, false, false, true, true],
        "400, 800, 1200: the 4th is denied"
    );
    s.stop().await;
}

/// A two-descriptor request with one descriptor over its limit, on Sentinel: envoyproxy
/// counting charges the other; STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT and all_or_nothing do not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_descriptor_and_the_other_one_on_sentinel() {
    let setup = SentinelSetup::start();
    let rules = "domain: two\ndescriptors:\n  - key: a\n    rate_limit: {unit: hour, requests_per_unit: 10}\n  - key: b\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";
    let aon = rules.replace("domain: two\n", "domain: two\ncounting: all_or_nothing\n");
    let stop = ServiceOptions {
        stop_increment_when_over: true,
        ..ServiceOptions::default()
    };
    for (n, (yaml, options, left)) in [
        (rules.to_string(), ServiceOptions::default(), 9),
        (rules.to_string(), stop, 10),
        (aon, ServiceOptions::default(), 10),
    ]
    .into_iter()
    .enumerate()
    {
        let clock = ManualClock::new(T0);
        let store = sentinel_store(&setup, &clock, None);
        let s = TestServer::start_on(&yaml, options, Some(store), clock).await;
        let (a, b) = (format!("a{n}"), format!("b{n}"));
        let b_req = one("two", &[("b", b.as_str())]);
        s.call(b_req.clone()).await;
        assert_eq!(code(&s.call(b_req).await), Code::OverLimit);
        let both = request(
            "two",
            vec![desc(&[("a", a.as_str())]), desc(&[("b", b.as_str())])],
        );
        assert_eq!(code(&s.call(both).await), Code::OverLimit);
        let mut peek = desc(&[("a", a.as_str())]);
        peek.hits_addend = Some(0);
        let r = s.call(request("two", vec![peek])).await;
        assert_eq!(r.statuses[0].limit_remaining, left, "case {n}");
        s.stop().await;
    }
}

/// The quota service's demand boards through Sentinel: two replicas (two stores) meet on one
/// counter's board, and after a failover the board, replicated, is still there on the promoted
/// master and takes new postings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demand_boards_work_through_sentinel_and_survive_a_failover() {
    use sluice::config::{Limit, Unit};
    use sluice::store::demand::{DemandBoard, Posting};
    use sluice::store::LimitCheck;
    let setup = SentinelSetup::start();
    let clock = ManualClock::new(T0);
    let settings = RedisSettings {
        sentinel: Some(SentinelSettings {
            master_name: MASTER_NAME.into(),
            auth: None,
        }),
        timeout: Duration::from_millis(500),
        ..redis_settings(setup.urls(), RedisKind::Sentinel)
    };
    let board = || -> Arc<dyn DemandBoard> {
        Arc::new(
            RedisStore::new(&settings)
                .expect("sentinel store")
                .with_test_clock(Arc::new(clock.clone()))
                .board(),
        )
    };
    let (a, b) = (board(), board());
    let key = LimitCheck::for_tests("rlqs", "k", Limit::fixed(600, Unit::Minute), 1).key;
    let fresh = Duration::from_secs(15);
    let posting = |stream: &str, rate: f64| Posting {
        stream: Arc::from(stream),
        rate: Some(rate),
        reserved: 6,
    };
    a.post(&key, &posting("a-1", 4.0), fresh)
        .await
        .expect("post");
    let seen = b
        .post(&key, &posting("b-1", 0.5), fresh)
        .await
        .expect("post");
    assert_eq!(seen.len(), 2, "{seen:?}");
    setup.wait_replicated();
    setup.force_failover();
    let seen = poll_until("a posting on the promoted master", || async {
        a.post(&key, &posting("a-1", 3.0), fresh).await
    })
    .await;
    assert!(seen.contains(&posting("b-1", 0.5)), "replicated: {seen:?}");
    assert!(seen.contains(&posting("a-1", 3.0)), "{seen:?}");
}

/// A leased resource above per-consumer limits on Sentinel (issue 40): the master the
/// sentinels name grants the slices; through a failover (the counters replicated first) both
/// replicas keep spending their slices and refill them on the promoted master, never more than
/// the resource's 30 admitted in all; what they give back when they stop lands there too, so it
/// then holds exactly what was admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_slices_follow_a_failover() {
    use super::leased::{consumer, metric, resource_left, HOT};
    let mut setup = SentinelSetup::start();
    let clock = ManualClock::new(T0);
    let options = || ServiceOptions {
        counting: sluice::config::Counting::AllOrNothing,
        ..ServiceOptions::default()
    };
    let start = |store| TestServer::start_on(HOT, options(), Some(store), clock.clone());
    let a = start(sentinel_store(&setup, &clock, None)).await;
    let b = start(sentinel_store(&setup, &clock, None)).await;
    let mut ok = 0;
    for i in 0..3 {
        for j in 0..4 {
            let replica = if (i + j) % 2 == 0 { &a } else { &b };
            ok += u32::from(code(&replica.call(consumer(&format!("c{i}"))).await) == Code::Ok);
        }
    }
    assert_eq!(
        ok, 12,
        "12 asked of a resource of 30, each consumer at its 4"
    );
    let grants = metric(&a, "sluice_slice_grants_total").await
        + metric(&b, "sluice_slice_grants_total").await;
    assert!(
        (1..12).contains(&grants),
        "{grants} grants for 12 requests: the resource was decided from slices"
    );
    setup.wait_replicated();

    setup.kill_master_and_fail_over();

    // Every request until the pool reaches the promoted master is UNAVAILABLE (its consumer
    // check has nowhere to go) and gives its resource unit back to the slice.
    let failed = std::sync::atomic::AtomicU32::new(0);
    for i in 3..12 {
        for j in 0..4 {
            let replica = if (i + j) % 2 == 0 { &a } else { &b };
            let r = poll_until("a decision after the failover", || async {
                let mut client = replica.client().await;
                match client.should_rate_limit(consumer(&format!("c{i}"))).await {
                    Ok(r) => Ok(r.into_inner()),
                    Err(e) => {
                        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
                        failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        Err(e)
                    }
                }
            })
            .await;
            ok += u32::from(code(&r) == Code::Ok);
        }
    }
    // 48 asked of 30 (36 past the failover): never over; at most one slice per replica (each
    // at most max_slice, 10) unspent while the other ran dry.
    assert!(
        ok <= 30 && ok + 2 * 10 >= 30,
        "{ok} admitted of a resource of 30"
    );
    a.stop().await;
    b.stop().await;
    let left = resource_left(sentinel_store(&setup, &clock, None), &clock).await;
    assert_eq!(
        left,
        30 - ok,
        "the promoted master holds the {ok} admitted once the slices came back ({failed:?} calls \
         failed over)"
    );
    assert!(
        setup.replica.cli(&["KEYS", "*"]).contains("resource=api"),
        "decided on the promoted replica"
    );
}
