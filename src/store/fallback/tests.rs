//! The bound of docs/redis.md ("Deciding locally") against a simulation: N replicas (this layer
//! over one shared store that the test fails and heals), random demand splits, outage starts and
//! lengths, one fixed window. What all replicas admit stays within
//! `L + Σ_i ⌈D_i / N⌉ + Σ_{i unseen} ⌈C / N⌉ + W` (W: what the store admitted after it came
//! back while another replica had not yet written back), and once every debt is written back,
//! the store's counter equals what was admitted (nothing lost, nothing doubled).

use super::*;
use crate::clock::ManualClock;
use crate::config::{Limit, Unit};
use crate::store::fake::FakeStore;
use proptest::prelude::*;

const T0: Duration = Duration::from_secs(60 * 1_000_000 + 5);

struct Sim {
    store: Arc<FakeStore>,
    replicas: Vec<LocalFallback>,
}

fn sim(n: u32, clock: &ManualClock) -> Sim {
    let store = Arc::new(FakeStore::new(Arc::new(clock.clone())));
    let replicas = (0..n)
        .map(|i| {
            let signals = StoreSignals::new("test");
            let r = LocalFallback::new(
                Arc::clone(&store) as Arc<dyn crate::store::WriteBack>,
                None,
                LocalSettings {
                    max_counters: 1000,
                    ..LocalSettings::default()
                },
                Arc::new(clock.clone()),
                &signals,
            );
            r.set_roster(Roster {
                replicas: n,
                rank: Some(i),
            });
            r
        })
        .collect();
    Sim { store, replicas }
}

fn check(limit: u32) -> LimitCheck {
    LimitCheck::for_tests("d", "k", Limit::fixed(limit, Unit::Minute), 1)
}

/// What the store's counter holds: a check of 0 hits reports its remaining.
async fn store_count(store: &FakeStore, limit: u32) -> u32 {
    let mut c = check(limit);
    c.hits = 0;
    let d = store.decide(&[c]).await.expect("store answers");
    limit - d.outcomes[0].remaining
}

async fn run(n: u32, limit: u32, demand: Vec<u32>, before: usize, during: usize, after: usize) {
    let clock = ManualClock::new(T0);
    let s = sim(n, &clock);
    let c = check(limit);
    let mut admitted = 0u32;
    // Per replica: the store's count at its last answer for the counter (None: unseen).
    let mut last_seen: Vec<Option<u32>> = vec![None; n as usize];
    let mut stream = demand.iter().cycle().map(|&r| r as usize % n as usize);
    for _ in 0..before {
        let r = stream.next().unwrap_or(0);
        let d = s.replicas[r]
            .decide(std::slice::from_ref(&c))
            .await
            .expect("decides");
        admitted += u32::from(d.admitted);
        last_seen[r] = Some(store_count(&s.store, limit).await);
    }
    let at_outage = store_count(&s.store, limit).await;
    s.store
        .fail_with(Some(StoreError::Transient("down".into())));
    for _ in 0..during {
        let r = stream.next().unwrap_or(0);
        let d = s.replicas[r]
            .decide(std::slice::from_ref(&c))
            .await
            .expect("decides");
        admitted += u32::from(d.admitted);
    }
    s.store.fail_with(None);
    // The replicas' suspicion of the store ends. Each writes back before its own next store
    // decision; until every replica has, the store may admit what the others still owe (w).
    // (Both clocks: the window's is the wall clock, the cool-down's the monotonic one.)
    clock.advance(Duration::from_secs(2));
    tokio::time::advance(Duration::from_secs(2)).await;
    for r in &s.replicas {
        r.probe_now().await;
    }
    let mut w = 0u32;
    for _ in 0..after {
        let r = stream.next().unwrap_or(0);
        let others_owe = s
            .replicas
            .iter()
            .enumerate()
            .any(|(i, o)| i != r && o.owed() > 0);
        let d = s.replicas[r]
            .decide(std::slice::from_ref(&c))
            .await
            .expect("decides");
        admitted += u32::from(d.admitted);
        w += u32::from(d.admitted && others_owe);
    }
    // The background write-back of counters nobody asked about again.
    for r in &s.replicas {
        r.write_back_now().await;
    }
    let bound: u32 = limit
        + w
        + last_seen
            .iter()
            .map(|seen| match seen {
                Some(count) => (at_outage - count).div_ceil(n),
                None => at_outage.div_ceil(n),
            })
            .sum::<u32>();
    assert!(
        admitted <= bound,
        "{n} replicas, limit {limit}: admitted {admitted} > bound {bound} ({last_seen:?}, C {at_outage})"
    );
    for r in &s.replicas {
        assert_eq!(r.owed(), 0, "everything written back");
    }
    assert_eq!(
        store_count(&s.store, limit).await,
        admitted.min(limit),
        "the store's counter is what was admitted"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn admitted_stays_within_the_stated_bound_and_nothing_is_lost(
        n in 1u32..6,
        limit in 1u32..60,
        demand in proptest::collection::vec(0u32..6, 1..12),
        before in 0usize..80,
        during in 0usize..80,
        after in 0usize..40,
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("runtime");
        rt.block_on(run(n, limit, demand, before, during, after));
    }
}

/// Review A5: `in_flight` slots taken locally are still held when what the store last said
/// (the learned remaining) expires: the local counter they were taken on stays the one the
/// next requests meet, so the slots counted never exceed `max`.
#[tokio::test(start_paused = true)]
async fn local_slots_outlive_what_was_learned() {
    use crate::config::{Algorithm, Period};
    use crate::store::LeaseCall;
    let clock = ManualClock::new(T0);
    let s = sim(1, &clock);
    let limit = Limit {
        requests_per_unit: 4,
        period: Period::from_millis(60_000).expect("1 min"),
        algorithm: Algorithm::InFlight,
        burst: 0,
    };
    let take = |id: &str| {
        let mut c = LimitCheck::for_tests("d", "k", limit, 1);
        c.lease = Some(LeaseCall {
            id: Arc::from(id),
            release: false,
            reservations: None,
        });
        c
    };
    let r = &s.replicas[0];
    let d = r.decide(&[take("a")]).await.expect("decides");
    assert!(d.admitted && d.steps > 0, "the store takes a's slot: {d:?}");
    s.store
        .fail_with(Some(StoreError::Transient("down".into())));
    clock.advance(Duration::from_secs(1));
    let mut admitted = 0;
    for id in ["b", "c", "d", "e"] {
        admitted += u32::from(r.decide(&[take(id)]).await.expect("local").admitted);
    }
    assert_eq!(admitted, 3, "3 of the 3 slots the store said were left");
    // What was learned ends a lease after the store's answer; the local slots, a lease after
    // they were taken, are still held.
    clock.advance(Duration::from_millis(59_500));
    let mut more = 0;
    for id in ["f", "g", "h", "i"] {
        more += u32::from(r.decide(&[take(id)]).await.expect("local").admitted);
    }
    assert!(
        more <= 1,
        "{more} more admitted with 3 local slots and a's still held against max 4"
    );
}
