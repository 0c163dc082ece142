//! Store-level behaviour, run against every store implementation through one macro (in the
//! style of Limitador's `test_with_all_storage_impls!`). The Redis stores join the list when
//! they land; each test receives a fresh store and the manual clock that drives it.

use sluice::clock::ManualClock;
use sluice::config::Unit;
use sluice::store::memory::MemoryStore;
use sluice::store::{CounterKey, CounterStore, LimitCheck};
use std::sync::Arc;
use std::time::Duration;

/// Starts one store of the named kind on a manual clock at `crate::support::T0`.
async fn make_store(kind: &str) -> (Arc<dyn CounterStore>, ManualClock) {
    let clock = ManualClock::new(crate::support::T0);
    match kind {
        "memory" => (Arc::new(MemoryStore::new(Arc::new(clock.clone()))), clock),
        other => panic!("unknown store kind {other}"),
    }
}

macro_rules! test_with_all_stores {
    ($name:ident, $body:expr) => {
        mod $name {
            use super::*;
            #[tokio::test]
            async fn memory() {
                let (store, clock) = make_store("memory").await;
                ($body)(store, clock).await;
            }
        }
    };
}

fn check(value: &str, limit: u32, unit: Unit, hits: u64) -> LimitCheck {
    LimitCheck {
        key: CounterKey {
            domain: Arc::from("store-test"),
            entries: vec![("k".into(), value.into())],
            requests_per_unit: limit,
            unit,
            overridden: false,
        },
        hits,
        refund: false,
        shadow: false,
    }
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
