//! The offenders tracker's real heap under an attack, measured by a counting global allocator
//! rather than by the tracker's own accounting. This binary holds exactly ONE test: the counter
//! is process-wide, so a second test running concurrently would pollute it.
//!
//! `cargo test --test offenders_memory -- --nocapture` prints the measured bytes and the bound.

use sluice::clock::ManualClock;
use sluice::telemetry::offenders::{OffenderSettings, Offenders};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

#[path = "support/alloc.rs"]
mod support_alloc;
use support_alloc::{live, PEAK};

/// A multiple of 60 s, so minute buckets start exactly here.
const T0: Duration = Duration::from_secs(1_700_000_040);
const DOMAINS: [&str; 2] = ["edge", "api"];
const HEAVY: &str = "remote_address=198.51.100.66";
/// Extra bytes tolerated between floods and around the tracker's own accounting (the two Arcs
/// of the clock, ~48 bytes, plus anything libtest allocates meanwhile).
const SLACK: usize = 4096;

/// 100 000 denials from 50 000 distinct values (each twice, the two passes interleaving the
/// whole set), the heavy hitter every 20th record (~5%), alternating between the two domains,
/// 4 ms apart: 7 minutes, so more bucket boundaries than the ring has buckets.
fn flood(o: &Offenders, clock: &ManualClock, value: impl Fn(u64) -> String) {
    let mut attack = 0u64;
    let mut record = 0usize;
    while attack < 100_000 {
        record += 1;
        clock.advance(Duration::from_millis(4));
        if record % 20 == 19 {
            o.record(DOMAINS[(record / 20) % 2], HEAVY, 1);
        } else {
            o.record(DOMAINS[record % 2], &value(attack % 50_000), 1);
            attack += 1;
        }
    }
}

fn assert_heavy_on_top(o: &Offenders) {
    for domain in DOMAINS {
        let top = o.top(domain, 1).map(|r| r.offenders).unwrap_or_default();
        assert_eq!(
            top.first().map(|t| t.descriptor.as_str()),
            Some(HEAVY),
            "{domain}: {top:?}"
        );
    }
}

#[test]
fn offenders_memory_is_bounded_and_independent_of_distinct_values() {
    // Warm-up: whatever std initializes lazily on first use (thread-locals, formatting) is
    // allocated here, not counted against the tracker.
    {
        let clock = ManualClock::new(T0);
        let o = Offenders::new(OffenderSettings::default(), Arc::new(clock.clone()));
        o.record("warm-up", &format!("v={}", 1), 1);
        assert!(o.top("warm-up", 1).is_some());
    }
    let baseline = live();
    let clock = ManualClock::new(T0);
    let offenders = Offenders::new(OffenderSettings::default(), Arc::new(clock.clone()));
    let bound = offenders.settings().memory_bound_bytes();
    // The same settings restricted to the two domains in use: a much tighter check.
    let bound_two_domains = OffenderSettings {
        max_domains: DOMAINS.len(),
        ..offenders.settings()
    }
    .memory_bound_bytes();

    flood(&offenders, &clock, |v| {
        format!("remote_address=10.a.{v:05}")
    });
    let first = live() - baseline;
    let first_accounted = offenders.heap_bytes();
    assert_heavy_on_top(&offenders);

    // 100 000 new distinct values of the same shape: buffers are reused, nothing grows.
    flood(&offenders, &clock, |v| {
        format!("remote_address=10.b.{v:05}")
    });
    let second = live() - baseline;
    assert_heavy_on_top(&offenders);

    // Values far past max_descriptor_bytes (multibyte, so cuts land mid-char): every string
    // in the tracker at full length, the bound's worst case for these two domains.
    flood(&offenders, &clock, |v| format!("{v:05}{}", "é".repeat(200)));
    let long = live() - baseline;
    let long_accounted = offenders.heap_bytes();
    let peak = PEAK.load(Ordering::SeqCst) - baseline;
    assert_heavy_on_top(&offenders);

    drop(offenders);
    drop(clock);
    let leftover = live().saturating_sub(baseline);

    println!(
        "offenders memory (default settings, 2 domains, live heap delta via global allocator):"
    );
    println!(
        "  after flood 1 (50k distinct):    {first} bytes (tracker accounts {first_accounted})"
    );
    println!("  after flood 2 (50k new):         {second} bytes");
    println!("  after flood 3 (max-length):      {long} bytes (tracker accounts {long_accounted})");
    println!("  peak during the floods:          {peak} bytes");
    println!("  left after drop:                 {leftover} bytes");
    println!("  bound for 2 domains:             {bound_two_domains} bytes");
    println!("  memory_bound_bytes() (default):  {bound} bytes");

    assert!(first <= bound, "{first} > {bound}");
    assert!(first <= bound_two_domains, "{first} > {bound_two_domains}");
    assert!(
        second <= first + SLACK,
        "grew with distinct values: {first} -> {second}"
    );
    assert!(long <= bound_two_domains, "{long} > {bound_two_domains}");
    // The tracker's own accounting matches what the allocator saw.
    assert!(first_accounted <= first && first <= first_accounted + SLACK);
    assert!(long_accounted <= long && long <= long_accounted + SLACK);
    assert!(leftover <= SLACK, "{leftover} bytes left after drop");
}
