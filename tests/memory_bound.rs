//! The memory store's real heap under a flood of distinct keys, measured by a counting global
//! allocator: 1 000 000 distinct consumers under a `day` limit against a store capped at 10 000
//! counters. The store never holds more than the cap, evicts (and counts) the rest, and its heap
//! stays under the documented bytes per counter. One test in this binary (the counts are
//! process-wide).
//!
//! `cargo test --release --test memory_bound -- --nocapture` prints the measured bytes.

#[path = "support/alloc.rs"]
mod support_alloc;

use sluice::clock::ManualClock;
use sluice::config::{Limit, Unit};
use sluice::store::memory::{MemoryStore, BYTES_PER_COUNTER};
use sluice::store::{CounterKey, CounterStore, LimitCheck};
use std::fmt::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use support_alloc::{live, PEAK};

const CAP: usize = 10_000;
const KEYS: usize = 1_000_000;

fn check(domain: &Arc<str>, consumer: usize) -> LimitCheck {
    LimitCheck {
        key: CounterKey {
            domain: Arc::clone(domain),
            // A realistic key: a resource and a consumer id as Envoy sends them.
            entries: Arc::from(vec![
                ("resource".into(), "api".into()),
                ("consumer".into(), format!("user-{consumer:07}")),
            ]),
            limit: Limit::fixed(1000, Unit::Day),
            overridden: false,
            domain_tag: false,
            own_tag: false,
            candidate: false,
        },
        hits: 1,
        refund: false,
        shadow: false,
        quota: false,
        record: false,
        stop_over: false,
        admin_limit: None,
        window: None,
        lease: None,
        leased: false,
        slice: None,
        candidate: false,
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_flood_of_distinct_keys_stays_within_the_cap_and_its_bytes() {
    let domain: Arc<str> = Arc::from("flood");
    let clock = ManualClock::new(Duration::from_secs(1_700_000_000));
    // Warm-up: lazily initialized std state is allocated before the baseline.
    {
        let s = MemoryStore::with_max_counters(Arc::new(clock.clone()), 10);
        assert!(
            s.decide(&[check(&domain, 0)])
                .await
                .expect("decide")
                .admitted
        );
    }
    let baseline = live();
    PEAK.store(baseline, Ordering::SeqCst);
    let store = MemoryStore::with_max_counters(Arc::new(clock.clone()), CAP);
    let mut most = 0;
    // One check, its consumer id rewritten in place: the loop allocates nothing of its own.
    let mut c = [check(&domain, 0)];
    for i in 0..KEYS {
        let entries = Arc::get_mut(&mut c[0].key.entries).expect("the only copy");
        let id = &mut entries[1].1;
        id.clear();
        write!(id, "user-{i:07}").expect("write");
        let d = store.decide(&c).await.expect("decide");
        assert!(d.admitted, "key {i}");
        if i % 10_000 == 9_999 {
            most = most.max(store.len());
            assert!(
                store.len() <= CAP,
                "{} counters after {i} keys",
                store.len()
            );
        }
        clock.advance(Duration::from_micros(50)); // 50 s in all: every counter stays live
    }
    let held = store.len();
    let heap = live() - baseline;
    let peak = PEAK.load(Ordering::SeqCst) - baseline;
    println!("memory store, {KEYS} distinct keys, cap {CAP} counters:");
    println!("  counters held:        {held} (most seen {most})");
    println!("  evictions:            {}", store.evictions());
    println!(
        "  live heap:            {heap} bytes ({} per counter)",
        heap / CAP
    );
    println!("  peak heap:            {peak} bytes (a request's own key included)");
    println!("  documented bound:     {} bytes", CAP * BYTES_PER_COUNTER);
    assert_eq!(held, CAP, "full");
    assert_eq!(
        store.evictions(),
        (KEYS - CAP) as u64,
        "every other counter was evicted"
    );
    assert!(
        heap <= CAP * BYTES_PER_COUNTER,
        "{heap} > {}",
        CAP * BYTES_PER_COUNTER
    );
    // A request's own key and answer (a few hundred bytes) are live next to the store.
    assert!(peak <= CAP * BYTES_PER_COUNTER + 4096, "peak {peak}");
    // The oldest counters gave way: the newest consumer is still counted.
    let d = store
        .decide(&[check(&domain, KEYS - 1)])
        .await
        .expect("decide");
    assert_eq!(d.outcomes[0].remaining, 998);
}
