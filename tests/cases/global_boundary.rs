//! A window's boundary under steady load costs no round trip to home (issue 51: no request
//! waits on home while its region's pool has units): the next window's pool is filled 2 s
//! before the window ends. The fill was started by a grant from the pool in those 2 s; a limit
//! large enough that one replica's slice lasts the window (a billion a minute: slices of
//! 1.25 M units) makes none, and every window's first requests waited a refill's round trip
//! (the board's read and the grant: 300 ms at 150 ms; a p99 of 229 ms in each 8 s round of
//! `scripts/global_bench.py` that crossed a minute). Now a slice spent from in its window's
//! last 2 s starts the fill itself (`store/slices/take.rs`).
//!
//! In the model of `global_moved_model.rs` (a region of two replicas, home 75 ms away each way
//! on paused tokio time, the pools' clock following it): 100 requests a second from 50 s into
//! a minute to 5 s into the next. Checked: every request admitted, and none after the first
//! second waited at all (virtual time: a request that waits on home, or on a fill in flight,
//! waits some of its 150 ms round trip; one answered from the pool waits none).

use super::global_moved_model::{follow, home_and_board, region};
use crate::support::T0;
use sluice::clock::ManualClock;
use sluice::config::{Leasing, Limit, Period, Unit};
use sluice::store::{Decider, LimitCheck};
use std::time::Duration;

const LIMIT: u32 = 1_000_000_000;
/// A refill's round trip to home (ms).
const ROUND_TRIP: Duration = Duration::from_millis(150);

/// A request's check at `now`: a billion a minute, slices of up to 10 M units.
fn check(now: Duration) -> LimitCheck {
    let mut c = LimitCheck::for_tests("global", "api", Limit::fixed(LIMIT, Unit::Minute), 1);
    let p = 60_000_000u64;
    let now_us = u64::try_from(now.as_micros()).expect("in range");
    let start = now_us - now_us % p;
    c.window = Some((start, start + p));
    c.slice = Some(Leasing {
        max_slice: 10_000_000,
        ahead: Period::from_millis(100).expect("positive"),
        global: true,
    });
    c.record = false;
    c
}

#[tokio::test(start_paused = true)]
async fn a_window_boundary_under_steady_load_costs_no_round_trip_to_home() {
    let clock = ManualClock::new(T0);
    let (home, board) = home_and_board(&clock);
    let a = region("a", &clock, &home, &board);
    let from = Duration::from_secs(50);
    let started = tokio::time::Instant::now() - from;
    clock.set(T0 + from);
    let ticker = follow(&clock, started);
    // (sent at, into the minute; admitted; how long it waited).
    let mut answers = Vec::new();
    let mut step = 0u32;
    loop {
        let into = started.elapsed();
        if into >= Duration::from_secs(65) {
            break;
        }
        let rep = &a.replicas[usize::from(step % 2 == 1)];
        let sent = tokio::time::Instant::now();
        let d = rep.decider.decide_by(vec![check(T0 + into)], None).await;
        answers.push((into, d.is_ok_and(|d| d.admitted), sent.elapsed()));
        step += 1;
        tokio::time::sleep_until(started + from + Duration::from_millis(10) * step).await;
    }
    ticker.abort();
    let denied = answers.iter().filter(|(_, ok, _)| !ok).count();
    assert_eq!(denied, 0, "{denied} of {} denied", answers.len());
    // The first second pays the region's first refill (nothing was filled ahead of it).
    let waited: Vec<(Duration, Duration)> = answers
        .iter()
        .filter(|(into, _, wait)| *into >= from + Duration::from_secs(1) && !wait.is_zero())
        .map(|&(into, _, wait)| (into, wait))
        .collect();
    let first = answers.iter().map(|(_, _, w)| *w).max().unwrap_or_default();
    eprintln!(
        "{} requests; the longest wait {first:?} (the first refill); waited after \
         the first second: {waited:?}",
        answers.len()
    );
    assert!(
        first >= ROUND_TRIP,
        "the first request did not wait on home: no premise"
    );
    assert!(
        waited.is_empty(),
        "requests waited on home after the first second (sent at, waited): {waited:?}"
    );
}
