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
