//! Store-level behaviour, run against every store implementation through one macro (in the
//! style of Limitador's `test_with_all_storage_impls!`): memory, real Redis and a real 3-master
//! Redis Cluster. Each test receives a fresh store and the manual clock that drives it.

use crate::support::redis::{
    start_cluster, start_redis, start_valkey, start_valkey_cluster, RedisCluster, RedisServer,
};
use sluice::clock::ManualClock;
use sluice::config::Unit;
use sluice::store::memory::MemoryStore;
use sluice::store::redis::{RedisKind, RedisSettings, RedisStore};
use sluice::store::{CounterStore, LimitCheck};
use std::sync::Arc;
use std::time::Duration;

/// What keeps a store's backend alive for the length of a test (real redis-server processes).
#[allow(dead_code)]
pub enum Backend {
    Memory,
    Redis(RedisServer),
    Cluster(RedisCluster),
}

/// Starts one store of the named kind on a manual clock at `crate::support::T0`. The Redis stores
/// run against real redis-server processes and receive the clock as the script's time override
/// (tests only; production uses the Redis server clock).
pub async fn make_store(kind: &str) -> (Arc<dyn CounterStore>, ManualClock, Backend) {
    if kind == "memory" {
        let clock = ManualClock::new(crate::support::T0);
        return (
            Arc::new(MemoryStore::new(Arc::new(clock.clone()))),
            clock,
            Backend::Memory,
        );
    }
    let (store, clock, backend) = make_redis_store(kind).await;
    (store, clock, backend)
}

/// [`make_store`]'s Redis kinds, as the Redis store itself (what only it does: write-backs).
pub async fn make_redis_store(kind: &str) -> (Arc<RedisStore>, ManualClock, Backend) {
    let clock = ManualClock::new(crate::support::T0);
    let (urls, redis_kind, backend) = match kind {
        "redis" => {
            let server = start_redis(&[]).await;
            (
                vec![server.url()],
                RedisKind::Single,
                Backend::Redis(server),
            )
        }
        "cluster" => {
            let cluster = start_cluster().await;
            (
                cluster.seeds(),
                RedisKind::Cluster,
                Backend::Cluster(cluster),
            )
        }
        "valkey" => {
            let server = start_valkey().await;
            (
                vec![server.url()],
                RedisKind::Single,
                Backend::Redis(server),
            )
        }
        "valkey_cluster" => {
            let cluster = start_valkey_cluster().await;
            (
                cluster.seeds(),
                RedisKind::Cluster,
                Backend::Cluster(cluster),
            )
        }
        other => panic!("unknown store kind {other}"),
    };
    let store = Arc::new(
        RedisStore::new(&redis_settings(urls, redis_kind))
            .expect("redis store")
            .with_test_clock(Arc::new(clock.clone())),
    );
    (store, clock, backend)
}

pub fn redis_settings(urls: Vec<String>, kind: RedisKind) -> RedisSettings {
    RedisSettings {
        urls,
        kind,
        sentinel: None,
        auth: None,
        pool_size: 4,
        // Generous: a loaded CI machine must not turn slowness into failures.
        timeout: Duration::from_secs(10),
        key_prefix: "sluice_test:".into(),
        expiration_jitter: Duration::ZERO,
        tls: Default::default(),
    }
}

pub fn redis_store(
    urls: Vec<String>,
    kind: RedisKind,
    clock: &ManualClock,
) -> Arc<dyn CounterStore> {
    Arc::new(
        RedisStore::new(&redis_settings(urls, kind))
            .expect("redis store")
            .with_test_clock(Arc::new(clock.clone())),
    )
}

/// A sluice on `yaml` whose store is a Redis store built from `settings` exactly as given (the
/// Redis server clock, no test clock); the service clock is a manual clock at T0.
pub async fn server_on_redis_settings(
    yaml: &str,
    settings: &RedisSettings,
) -> crate::support::TestServer {
    let store: Arc<dyn CounterStore> = Arc::new(RedisStore::new(settings).expect("redis store"));
    crate::support::TestServer::start_on(
        yaml,
        sluice::service::ServiceOptions::default(),
        Some(store),
        ManualClock::new(crate::support::T0),
    )
    .await
}

fn check(value: &str, limit: u32, unit: Unit, hits: u64) -> LimitCheck {
    LimitCheck::for_tests(
        "store-test",
        value,
        sluice::config::Limit::fixed(limit, unit),
        hits,
    )
}

test_with_all_stores!(
    admits_up_to_the_limit,
    |store: Arc<dyn CounterStore>, _clock| async move {
        let c = [check("a", 3, Unit::Minute, 1)];
        let mut remaining = Vec::new();
        for _ in 0..5 {
            let d = store.decide(&c).await.expect("decide");
            remaining.push((d.admitted, d.outcomes[0].remaining));
        }
        assert_eq!(
            remaining,
            [(true, 2), (true, 1), (true, 0), (false, 0), (false, 0)]
        );
    }
);

test_with_all_stores!(
    denial_charges_no_limit,
    |store: Arc<dyn CounterStore>, _clock| async move {
        let full = check("full", 1, Unit::Hour, 1);
        assert!(
            store
                .decide(std::slice::from_ref(&full))
                .await
                .expect("decide")
                .admitted
        );
        let other = check("other", 5, Unit::Hour, 1);
        let d = store
            .decide(&[other.clone(), full.clone()])
            .await
            .expect("decide");
        assert!(!d.admitted);
        assert!(d.outcomes[0].allowed && !d.outcomes[1].allowed);
        let d = store.decide(&[other]).await.expect("decide");
        assert_eq!(
            d.outcomes[0].remaining, 4,
            "the denied request charged nothing"
        );
    }
);

test_with_all_stores!(
    window_rolls_over_with_the_clock,
    |store: Arc<dyn CounterStore>, clock: ManualClock| async move {
        let c = [check("w", 1, Unit::Second, 1)];
        assert!(store.decide(&c).await.expect("decide").admitted);
        assert!(!store.decide(&c).await.expect("decide").admitted);
        clock.advance(Duration::from_millis(1000));
        let d = store.decide(&c).await.expect("decide");
        assert!(d.admitted);
        assert_eq!(d.outcomes[0].reset, Duration::from_secs(1));
    }
);

test_with_all_stores!(
    shadow_checks_never_deny,
    |store: Arc<dyn CounterStore>, _clock| async move {
        let mut shadow = check("s", 1, Unit::Hour, 1);
        shadow.shadow = true;
        for i in 0..3 {
            let d = store
                .decide(std::slice::from_ref(&shadow))
                .await
                .expect("decide");
            assert!(d.admitted);
            assert_eq!(d.outcomes[0].allowed, i == 0);
        }
    }
);

test_with_all_stores!(
    same_counter_twice_in_one_request_adds_up,
    |store: Arc<dyn CounterStore>, _clock| async move {
        let c = check("twice", 3, Unit::Hour, 2);
        let d = store.decide(&[c.clone(), c.clone()]).await.expect("decide");
        assert!(!d.admitted, "2 + 2 hits do not fit in 3");
        assert_eq!(d.outcomes[0].remaining, 3, "denied: nothing charged");
        let d = store
            .decide(std::slice::from_ref(&c))
            .await
            .expect("decide");
        assert!(d.admitted);
        assert_eq!(d.outcomes[0].remaining, 1);
    }
);

test_with_all_stores!(
    checks_refunds_and_limit_zero,
    |store: Arc<dyn CounterStore>, _clock| async move {
        let one = check("r", 2, Unit::Hour, 1);
        for _ in 0..2 {
            assert!(
                store
                    .decide(std::slice::from_ref(&one))
                    .await
                    .expect("decide")
                    .admitted
            );
        }
        let probe = check("r", 2, Unit::Hour, 0);
        let d = store
            .decide(std::slice::from_ref(&probe))
            .await
            .expect("decide");
        assert!(!d.admitted, "a check on a full counter fails");
        let mut refund = check("r", 2, Unit::Hour, 5);
        refund.refund = true;
        let d = store.decide(&[refund]).await.expect("decide");
        assert!(d.admitted);
        assert_eq!(d.outcomes[0].remaining, 2, "never below zero");
        let d = store.decide(&[probe]).await.expect("decide");
        assert!(d.admitted);
        assert_eq!(d.outcomes[0].remaining, 2, "a check charges nothing");
        let zero = check("z", 0, Unit::Second, 1);
        assert!(!store.decide(&[zero]).await.expect("decide").admitted);
    }
);

test_with_all_stores!(
    values_with_layout_characters_are_separate_counters,
    |store: Arc<dyn CounterStore>, _clock| async move {
        // Values that would collide under a naive `key_value` join, or break a hash tag.
        let values = [
            "a_b", "a", "{x}", "}{", "a:b", "a|b=c", "%7B", "雪", "é:{é}",
        ];
        for v in values {
            let mut c = check(v, 1, Unit::Hour, 1);
            let mut entries = c.key.entries.to_vec();
            entries.push(("consumer".into(), format!("{v}|{v}")));
            c.key.entries = entries.into();
            let d = store
                .decide(std::slice::from_ref(&c))
                .await
                .expect("decide");
            assert!(d.admitted, "first hit on {v:?} is its own counter");
            let d = store
                .decide(std::slice::from_ref(&c))
                .await
                .expect("decide");
            assert!(!d.admitted, "second hit on {v:?} sees the first");
        }
    }
);

test_with_all_stores!(
    a_decision_older_than_the_stored_window_keeps_the_newer_count,
    |store: Arc<dyn CounterStore>, clock: ManualClock| async move {
        // A request decided with a `now` before the stored window (it waited across a window
        // edge; a Redis failover onto a slower clock): the newer window's count is never
        // overwritten by the older window's.
        let t1 = crate::support::T0 + Duration::from_secs(20); // 20 s into a minute window
        for alg in [
            sluice::config::Algorithm::FixedWindow,
            sluice::config::Algorithm::SlidingWindow,
        ] {
            let mut c = check(&format!("edge-{alg:?}"), 5, Unit::Minute, 1);
            c.key.limit.algorithm = alg;
            clock.set(t1);
            for _ in 0..3 {
                let d = store
                    .decide(std::slice::from_ref(&c))
                    .await
                    .expect("decide");
                assert!(d.admitted, "{alg:?}");
            }
            clock.set(t1 - Duration::from_secs(30)); // the previous window
            let d = store
                .decide(std::slice::from_ref(&c))
                .await
                .expect("decide");
            assert!(d.admitted, "{alg:?}");
            clock.set(t1);
            let probe = LimitCheck {
                hits: 0,
                ..c.clone()
            };
            let left = store.decide(&[probe]).await.expect("decide").outcomes[0].remaining;
            if alg == sluice::config::Algorithm::SlidingWindow {
                // Both stores take the newer window as the current one.
                assert_eq!(left, 1, "{alg:?}: 3 + the late request in the newer window");
            } else {
                // Memory counts the late request in the newer window (1 left); Redis keeps one
                // key per window and counts it in the older one's (2 left). Overwritten, 4.
                assert!(
                    left <= 2,
                    "{alg:?}: the newer window's 3 hits were kept ({left} left)"
                );
            }
        }
    }
);

/// A request over a request cap gets INVALID_ARGUMENT naming the cap and never reaches the
/// store, so it takes no shard lock (the memory store's locks are taken inside `decide`).
#[tokio::test]
async fn a_request_over_the_caps_never_reaches_the_store() {
    use crate::support::*;
    let clock = ManualClock::new(crate::support::T0);
    let store = Arc::new(sluice::store::fake::FakeStore::new(Arc::new(clock.clone())));
    let yaml = "domain: caps\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 10}\n";
    let s = TestServer::start_on(
        yaml,
        sluice::service::ServiceOptions::default(),
        Some(store.clone()),
        clock,
    )
    .await;
    let long_key = "k".repeat(257);
    let cases = [
        (
            "MAX_DESCRIPTORS_PER_REQUEST",
            request(
                "caps",
                (0..65).map(|i| desc(&[("k", &i.to_string())])).collect(),
            ),
        ),
        (
            "MAX_ENTRIES_PER_DESCRIPTOR",
            request(
                "caps",
                vec![desc(&(0..17).map(|_| ("k", "v")).collect::<Vec<_>>())],
            ),
        ),
        ("MAX_DESCRIPTOR_KEY_BYTES", one("caps", &[(&long_key, "v")])),
        (
            "MAX_DESCRIPTOR_VALUE_BYTES",
            one("caps", &[("k", &"v".repeat(4097))]),
        ),
    ];
    let mut client = s.client().await;
    for (cap, req) in cases {
        let e = client.should_rate_limit(req).await.expect_err(cap);
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{cap}: {e:?}");
        assert!(e.message().contains(cap), "{cap}: {e:?}");
    }
    assert_eq!(store.calls(), 0);
    // A request within the caps does reach it.
    let r = s.call(one("caps", &[("k", "v")])).await;
    assert_eq!(r.statuses[0].limit_remaining, 9);
    assert_eq!(store.calls(), 1);
    s.stop().await;
}

// envoyproxy's quota mode (#1045/#1059) at the store: a request is denied if an enforced limit
// denies or if every quota limit denies; a quota limit that denies inside an admitted request
// is not charged, and a denied request charges nothing (on a Cluster, the quota charge made in
// one slot is undone when another slot's enforced limit denies).
// Two all-or-nothing refunds of one request in two Cluster slots (with a charge that admits):
// the refunds wait for the verdict, then both apply (a random differential seed found the
// refund step deferring itself again, without end, when its refunds spanned slots).
test_with_all_stores!(
    refunds_in_two_slots_apply_once_the_request_is_admitted,
    |store: Arc<dyn CounterStore>, _clock| async move {
        let (qa, qb) = (check("qa", 5, Unit::Hour, 3), check("qb", 5, Unit::Hour, 3));
        assert!(
            store
                .decide(&[qa.clone(), qb.clone()])
                .await
                .expect("charge")
                .admitted
        );
        let refund = |c: &LimitCheck| LimitCheck {
            hits: 2,
            refund: true,
            ..c.clone()
        };
        let other = check("qc", 5, Unit::Hour, 1);
        let d = store
            .decide(&[refund(&qa), refund(&qb), other])
            .await
            .expect("refunds");
        assert!(d.admitted);
        let read = store
            .decide(&[check("qa", 5, Unit::Hour, 0), check("qb", 5, Unit::Hour, 0)])
            .await
            .expect("read");
        assert_eq!(
            (read.outcomes[0].remaining, read.outcomes[1].remaining),
            (4, 4),
            "3 charged, 2 given back, on each"
        );
    }
);

test_with_all_stores!(
    quota_mode_denies_only_when_every_quota_limit_does,
    |store: Arc<dyn CounterStore>, _clock| async move {
        let quota = |value: &str, limit: u32| {
            let mut c = check(value, limit, Unit::Hour, 1);
            c.quota = true;
            c
        };
        let (qa, qb) = (quota("qa", 1), quota("qb", 3));
        let both = [qa.clone(), qb.clone()];
        let cluster = format!("{store:?}").contains("cluster");
        let mut seen = Vec::new();
        for _ in 0..4 {
            let d = store.decide(&both).await.expect("decide");
            assert!(
                !cluster || d.steps == 2,
                "the Cluster case must span slots: {d:?}"
            );
            seen.push((
                d.admitted,
                (d.outcomes[0].allowed, d.outcomes[0].remaining),
                (d.outcomes[1].allowed, d.outcomes[1].remaining),
            ));
        }
        assert_eq!(
            seen,
            [
                (true, (true, 0), (true, 2)),
                // qa is over, qb still allows: admitted, and only qb is charged.
                (true, (false, 0), (true, 1)),
                (true, (false, 0), (true, 0)),
                // Every quota limit denies: denied.
                (false, (false, 0), (false, 0)),
            ]
        );

        // An enforced limit that denies denies the request, whatever its quota limits say, and
        // the quota limit's charge (in another slot on a Cluster) is taken back.
        let enforced = check("e", 2, Unit::Hour, 1);
        let mut qc = quota("qc", 5);
        qc.key.limit.algorithm = sluice::config::Algorithm::SlidingLog;
        let mixed = [enforced, qc.clone()];
        assert!(store.decide(&mixed).await.expect("decide").admitted);
        assert!(store.decide(&mixed).await.expect("decide").admitted);
        let d = store.decide(&mixed).await.expect("decide");
        assert!(!d.admitted, "the enforced limit is full");
        assert!(!d.outcomes[0].allowed && d.outcomes[1].allowed);
        let mut peek = qc;
        peek.hits = 0;
        let d = store.decide(&[peek]).await.expect("decide");
        assert_eq!(
            d.outcomes[0].remaining, 3,
            "only the two admitted requests charged qc"
        );
    }
);
