//! `FAILURE_MODE=local` on a real 3-master Redis Cluster when one master is gone: a request
//! spanning a healthy slot and a dead one is decided locally, and what the healthy slot already
//! recorded is counted once (review A3), through the library's own layers (Redis store, the
//! local layer) on a manual clock.

use super::store::redis_settings;
use crate::support::redis::{start_cluster, RedisCluster};
use sluice::clock::ManualClock;
use sluice::config::{Limit, Unit};
use sluice::store::fallback::{LocalFallback, LocalSettings};
use sluice::store::redis::{RedisKind, RedisSettings, RedisStore};
use sluice::store::{CounterStore, LimitCheck, StoreSignals};
use std::sync::Arc;
use std::time::Duration;

/// The local layer over the Cluster `cluster`, on `clock` (the script's time too).
fn local_over(cluster: &RedisCluster, clock: &ManualClock) -> LocalFallback {
    local_over_with(cluster, clock, LocalSettings::default().max_late_calls)
}

fn local_over_with(cluster: &RedisCluster, clock: &ManualClock, late: usize) -> LocalFallback {
    let settings = RedisSettings {
        timeout: Duration::from_secs(2),
        ..redis_settings(cluster.seeds(), RedisKind::Cluster)
    };
    let redis = RedisStore::new(&settings)
        .expect("redis store")
        .with_test_clock(Arc::new(clock.clone()));
    LocalFallback::new(
        Arc::new(redis),
        None,
        LocalSettings {
            whole_store: false,
            // Every request tries its slots again: the test decides when a slot is back.
            retry_every: Duration::ZERO,
            budget: Duration::from_secs(2),
            max_late_calls: late,
            ..LocalSettings::default()
        },
        Arc::new(clock.clone()),
        &StoreSignals::new("test"),
    )
}

/// A recorded check (envoyproxy counting, the default): `hits` on `key=value` of domain `ca`.
fn recorded(key: &str, value: &str, hits: u64) -> LimitCheck {
    let mut c = LimitCheck::for_tests("ca", value, Limit::fixed(10, Unit::Hour), hits);
    let entries = vec![(key.to_string(), value.to_string())];
    c.key.entries = Arc::from(entries);
    c.record = true;
    c
}

/// A value of `key` whose counter lives on another master than `user=a`'s, and that master.
fn elsewhere(cluster: &RedisCluster, key: &str) -> (String, usize) {
    let user = cluster.master_of("{ca|user=a}");
    (0..64)
        .map(|i| format!("p{i}"))
        .map(|v| {
            let m = cluster.master_of(&format!("{{ca|{key}={v}}}"));
            (v, m)
        })
        .find(|(_, m)| *m != user)
        .expect("a value on another master")
}

/// Review A3: `[user=a]` and `[path=p]` in different slots, the second slot's master gone. The
/// request is decided locally (FAILURE_MODE=local); the healthy slot recorded its hit in Redis,
/// and the local layer's write-back must not record it a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_slot_never_counts_the_healthy_slots_hits_twice() {
    let mut cluster = start_cluster().await;
    let (path, dead) = elsewhere(&cluster, "path");
    let clock = ManualClock::new(crate::support::T0);
    let store = local_over(&cluster, &clock);
    let request = [recorded("user", "a", 1), recorded("path", &path, 1)];
    let d = store.decide(&request).await.expect("both slots answer");
    assert!(d.admitted && d.steps > 0, "{d:?}");
    assert_eq!(d.outcomes[0].remaining, 9);

    cluster.node_mut(dead).stop();
    let d = store.decide(&request).await.expect("decided locally");
    assert!(d.admitted, "{d:?}");
    assert_eq!(
        store.owed(),
        1,
        "only the dead slot's counter owes a write-back"
    );
    store.write_back_now().await;

    // user=a's slot is healthy: it holds exactly the two hits admitted.
    let probe = recorded("user", "a", 0);
    let d = store.decide(&[probe]).await.expect("user=a's slot answers");
    assert!(d.steps > 0, "decided by the store: {d:?}");
    assert_eq!(
        d.outcomes[0].remaining,
        8,
        "user=a counted 2 hits, not {}",
        10 - d.outcomes[0].remaining
    );
}

/// A check on `key=value` of domain `ca` under `limit`, `hits`, with a lease call for `id`.
fn leased(
    key: &str,
    value: &str,
    limit: Limit,
    hits: u64,
    id: &str,
    reservations: Option<sluice::config::Reservations>,
) -> LimitCheck {
    let mut c = LimitCheck::for_tests("ca", value, limit, hits);
    c.key.entries = Arc::from(vec![(key.to_string(), value.to_string())]);
    c.lease = Some(sluice::store::LeaseCall {
        id: Arc::from(id),
        release: false,
        reservations,
    });
    c
}

/// Review A10: a request holding a reservation (400 of a 1 000-token budget) in one slot and an
/// `in_flight` take (max 1) in another, both decided dry and committed one after the other. An
/// intruder takes the last slot between the dry decisions and the commits, so the reservation
/// commits and the take is then denied: the request is denied, and the reservation it made
/// must be taken back (no settle ever comes for a denied request), as must a slot taken before
/// a later slot's denial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_slots_denial_takes_back_the_lease_changes_committed_before_it() {
    use sluice::config::{Algorithm, Period, Reservations};
    use sluice::store::redis::keys::{hash_tag, tag_slot};
    let cluster = start_cluster().await;
    let clock = ManualClock::new(crate::support::T0);
    let budget = Limit::fixed(1000, Unit::Hour);
    let slots = Limit {
        requests_per_unit: 1,
        period: Period::from_millis(60_000).expect("1 min"),
        algorithm: Algorithm::InFlight,
        burst: 0,
    };
    let terms = Reservations {
        lease: Period::from_millis(300_000).expect("5 min"),
        max: 16,
        min_estimate: 1,
    };
    let reserve = leased("model", "m", budget, 400, "r1", Some(terms));
    // A take in another slot than the reservation's, ordered after it.
    let take = (0..64)
        .map(|i| leased("tenant", &format!("t{i}"), slots, 1, "r1", None))
        .find(|t| tag_slot(&hash_tag(&t.key)) != tag_slot(&hash_tag(&reserve.key)))
        .expect("a tenant in another slot");
    let settings = RedisSettings {
        timeout: Duration::from_secs(2),
        ..redis_settings(cluster.seeds(), RedisKind::Cluster)
    };
    let plain = RedisStore::new(&settings).expect("redis store");
    let take_key = plain.key_of(&take.key);
    let node = cluster.master_of(&take_key);
    let port = cluster.ports()[node];
    let store = plain
        .with_test_clock(Arc::new(clock.clone()))
        .with_commit_hook(intruder(port, take_key));
    let d = store
        .decide(&[reserve.clone(), take.clone()])
        .await
        .expect("decided");
    assert!(!d.admitted, "the take is denied at its commit: {d:?}");

    // The reservation is gone: the whole budget is left, and a reservation of 1 000 fits.
    let mut peek = reserve.clone();
    peek.lease = None;
    peek.hits = 0;
    let left = store.decide(&[peek]).await.expect("peek").outcomes[0].remaining;
    assert_eq!(
        left, 1000,
        "the denied request's reservation was taken back"
    );
    let full = leased("model", "m", budget, 1000, "r2", Some(terms));
    assert!(store.decide(&[full]).await.expect("decided").admitted);

    // Two takes in two slots: the first commits, then an intruder fills the second, which
    // denies at its commit: the slot the denied request took is free again.
    let first = (0..64)
        .map(|i| leased("tenant", &format!("u{i}"), slots, 1, "r3", None))
        .find(|t| tag_slot(&hash_tag(&t.key)) != tag_slot(&hash_tag(&take.key)))
        .expect("a tenant in another slot");
    let second = (0..64)
        .map(|i| leased("tenant", &format!("v{i}"), slots, 1, "r3", None))
        .find(|t| {
            let s = tag_slot(&hash_tag(&t.key));
            s != tag_slot(&hash_tag(&take.key)) && s != tag_slot(&hash_tag(&first.key))
        })
        .expect("a tenant in a third slot");
    let plain = RedisStore::new(&settings).expect("redis store");
    let second_key = plain.key_of(&second.key);
    let port = cluster.ports()[cluster.master_of(&second_key)];
    let store = plain
        .with_test_clock(Arc::new(clock.clone()))
        .with_commit_hook(intruder(port, second_key));
    let d = store
        .decide(&[first.clone(), second])
        .await
        .expect("decided");
    assert!(
        !d.admitted,
        "the second take is denied at its commit: {d:?}"
    );
    let mut other = first.clone();
    other.lease = Some(sluice::store::LeaseCall {
        id: Arc::from("r4"),
        release: false,
        reservations: None,
    });
    let d = store.decide(&[other]).await.expect("decided");
    assert!(d.admitted, "the denied request holds no slot: {d:?}");
}

/// A commit hook that, once, takes `key`'s last `in_flight` slot (max 1) for an intruder whose
/// lease ends far in the future, on the master at `port`.
fn intruder(port: u16, key: String) -> Arc<dyn Fn() + Send + Sync> {
    let once = std::sync::atomic::AtomicBool::new(false);
    Arc::new(move || {
        if !once.swap(true, std::sync::atomic::Ordering::SeqCst) {
            let out = std::process::Command::new("redis-cli")
                .args(["-p", &port.to_string(), "ZADD", &key, "9000000000000000"])
                .arg("intruder")
                .output()
                .expect("redis-cli runs");
            assert!(out.status.success(), "{out:?}");
        }
    })
}

/// Review B1: a master that hangs (SIGSTOP, a partition) holds every call sent to it. Built as
/// `FAILURE_MODE=local` builds it (REDIS_TIMEOUT 500 ms, LOCAL_STORE_PATIENCE 60 s, the
/// Cluster's slots suspected one by one): once `max_late_calls` calls to the hung master are
/// awaited (4 096 by default; 3 here), requests whose counters live on the healthy masters are
/// still decided by Redis, exactly (the old code sent every request of the replica local from
/// then on), and further calls to the hung master are dropped at their deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_master_never_sends_the_healthy_masters_requests_local() {
    let cluster = start_cluster().await;
    let clock = ManualClock::new(crate::support::T0);
    let quick = Duration::from_millis(500);
    let settings = RedisSettings {
        timeout: quick,
        ..redis_settings(cluster.seeds(), RedisKind::Cluster)
    };
    let redis = RedisStore::patient(&settings, Duration::from_secs(60))
        .expect("redis store")
        .with_test_clock(Arc::new(clock.clone()));
    let signals = StoreSignals::new("test");
    let store = LocalFallback::new(
        Arc::new(redis),
        None,
        LocalSettings {
            whole_store: false,
            retry_every: Duration::ZERO,
            budget: quick,
            max_late_calls: 3,
            ..LocalSettings::default()
        },
        Arc::new(clock.clone()),
        &signals,
    );
    let hung = cluster.master_of("{ca|user=a}");
    let on_hung: Vec<String> = (0..500)
        .map(|i| format!("t{i}"))
        .filter(|v| cluster.master_of(&format!("{{ca|user={v}}}")) == hung)
        .take(6)
        .collect();
    assert_eq!(on_hung.len(), 6);
    let (path, _) = elsewhere(&cluster, "path");
    // Connected, every master answering.
    let d = store
        .decide(&[recorded("path", &path, 1)])
        .await
        .expect("answers");
    assert!(d.steps > 0 && d.outcomes[0].remaining == 9, "{d:?}");

    cluster.node(hung).signal("STOP");
    for v in &on_hung {
        let d = store
            .decide(&[recorded("user", v, 1)])
            .await
            .expect("decided locally");
        assert!(d.steps == 0 && d.admitted, "{v}: decided locally, {d:?}");
    }
    for n in 0..3 {
        let d = store
            .decide(&[recorded("path", &path, 1)])
            .await
            .expect("a healthy master answers");
        assert!(
            d.steps > 0,
            "request {n} on a healthy master was decided locally: {d:?}"
        );
        assert_eq!(d.outcomes[0].remaining, 8 - n, "counted on Redis, once");
    }
    assert_eq!(
        signals.local.late_calls_dropped.get(),
        3,
        "3 awaited, the other 3 dropped"
    );
    let other = (0..3).find(|&i| i != hung).unwrap();
    eprintln!(
        "{}",
        cluster
            .node(other)
            .try_cli(&["CLUSTER", "INFO"])
            .unwrap_or_default()
    );
    cluster.node(hung).signal("CONT");
}

/// Every node of `cluster` keeps serving its own slots while a master is marked failed. With
/// Redis's default (`cluster-require-full-coverage yes`), once the hung master is marked failed
/// (`cluster-node-timeout`, 5 s here) every node answers CLUSTERDOWN for every slot: that is the
/// operator's choice in Redis, not sluice's or the client's (docs/redis.md), and these tests
/// are about what sluice and the client do.
fn serve_partial_coverage(cluster: &RedisCluster) {
    for i in 0..3 {
        cluster
            .node(i)
            .cli(&["CONFIG", "SET", "cluster-require-full-coverage", "no"]);
    }
}

/// Review A11, across requests: with one master hung, requests alternating between its slots
/// and a healthy master's flipped `sluice_store_up` (and logged a line) on every request. The
/// store is down once, while the hung slot's last call failed, and up once that slot answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_outage_turns_the_store_down_once_not_once_per_request() {
    let cluster = start_cluster().await;
    serve_partial_coverage(&cluster);
    let clock = ManualClock::new(crate::support::T0);
    let settings = RedisSettings {
        timeout: Duration::from_secs(1),
        ..redis_settings(cluster.seeds(), RedisKind::Cluster)
    };
    let signals = StoreSignals::new("test");
    let store = RedisStore::new(&settings)
        .expect("redis store")
        .with_test_clock(Arc::new(clock.clone()))
        .reporting_to(&signals);
    let mut health = signals.health.subscribe();
    let hung = cluster.master_of("{ca|user=a}");
    let (path, _) = elsewhere(&cluster, "path");
    let healthy = || recorded("path", &path, 1);
    store.decide(&[healthy()]).await.expect("answers");
    assert!(!health.has_changed().expect("open"), "up from the start");

    cluster.node(hung).signal("STOP");
    let mut changes = Vec::new();
    for n in 0..3 {
        let e = store.decide(&[recorded("user", "a", 1)]).await;
        assert!(e.is_err(), "the hung master's slot cannot answer: {e:?}");
        if health.has_changed().expect("open") {
            changes.push((n, "hung", *health.borrow_and_update()));
        }
        let d = store.decide(&[healthy()]).await.expect("a healthy master");
        assert!(d.admitted, "{d:?}");
        if health.has_changed().expect("open") {
            changes.push((n, "healthy", *health.borrow_and_update()));
        }
    }
    assert_eq!(
        changes,
        [(0, "hung", false)],
        "down once, and it stayed down"
    );
    assert!(!signals.healthy());

    cluster.node(hung).signal("CONT");
    let d = store
        .decide(&[recorded("user", "a", 1)])
        .await
        .expect("answers again");
    assert!(d.admitted, "{d:?}");
    assert!(signals.healthy(), "up again once the hung slot answered");
}

/// Review B1, past the late calls' own timeout: once the calls left on a hung master time out
/// in the client (`LOCAL_STORE_PATIENCE`), the redis crate's Cluster connection keeps serving
/// the healthy masters (a slot refresh would hold every call while it asks the hung node; none
/// is started by a timeout). Their requests are decided by Redis and counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_masters_answer_after_the_hung_masters_late_calls_timed_out() {
    let cluster = start_cluster().await;
    serve_partial_coverage(&cluster);
    let clock = ManualClock::new(crate::support::T0);
    let quick = Duration::from_millis(500);
    let patience = Duration::from_secs(1);
    let settings = RedisSettings {
        timeout: quick,
        ..redis_settings(cluster.seeds(), RedisKind::Cluster)
    };
    let redis = RedisStore::patient(&settings, patience)
        .expect("redis store")
        .with_test_clock(Arc::new(clock.clone()));
    let signals = StoreSignals::new("test");
    let store = LocalFallback::new(
        Arc::new(redis),
        None,
        LocalSettings {
            whole_store: false,
            retry_every: Duration::ZERO,
            budget: quick,
            ..LocalSettings::default()
        },
        Arc::new(clock.clone()),
        &signals,
    );
    let hung = cluster.master_of("{ca|user=a}");
    let on_hung: Vec<String> = (0..500)
        .map(|i| format!("t{i}"))
        .filter(|v| cluster.master_of(&format!("{{ca|user={v}}}")) == hung)
        .take(4)
        .collect();
    let (path, _) = elsewhere(&cluster, "path");
    let d = store
        .decide(&[recorded("path", &path, 1)])
        .await
        .expect("answers");
    assert_eq!(d.outcomes[0].remaining, 9, "{d:?}");

    cluster.node(hung).signal("STOP");
    for v in &on_hung {
        let d = store
            .decide(&[recorded("user", v, 1)])
            .await
            .expect("decided locally");
        assert!(d.steps == 0 && d.admitted, "{v}: decided locally, {d:?}");
    }
    // Every late call has met its own timeout by now (a sleep only lets time pass: what is
    // asserted is what the store answers after it).
    tokio::time::sleep(patience + quick).await;
    for n in 0..3 {
        let d = store
            .decide(&[recorded("path", &path, 1)])
            .await
            .expect("a healthy master answers");
        assert!(
            d.steps > 0,
            "request {n} on a healthy master was decided locally: {d:?}"
        );
        assert_eq!(d.outcomes[0].remaining, 8 - n, "counted on Redis, once");
    }
    cluster.node(hung).signal("CONT");
}
