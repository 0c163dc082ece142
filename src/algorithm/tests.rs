//! Hand-computed cases for every algorithm (times in seconds, converted to microseconds).

use super::*;

const S: u64 = 1_000_000;
/// An epoch-aligned start for all windows used here (a multiple of 10 s and of 60 s).
const T0: u64 = 1_699_920_000 * S;

fn p(limit: u32, period_s: u64, algorithm: Algorithm, burst: u32) -> LimitParams {
    LimitParams {
        limit,
        period_us: period_s * S,
        algorithm,
        burst,
        window_start: None,
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Runs `hits` on `state` at `now`, keeping the new state only if allowed (as a store does).
fn step(state: &mut Option<State>, now: u64, params: LimitParams, hits: u64) -> Outcome {
    let (o, next) = decide(state.as_ref(), now, params, hits, Mode::Charge);
    if o.allowed {
        *state = Some(next);
    }
    o
}

// ---- fixed_window -------------------------------------------------------------------------

#[test]
fn fixed_window_admits_up_to_the_limit_and_resets_at_the_boundary() {
    let lp = p(3, 60, Algorithm::FixedWindow, 0);
    let mut st = None;
    let now = T0 + 10 * S;
    for rem in [2, 1, 0] {
        let o = step(&mut st, now, lp, 1);
        assert!(o.allowed);
        assert_eq!(o.remaining, rem);
        assert_eq!(secs(o.reset), 50.0);
    }
    let o = step(&mut st, now, lp, 1);
    assert!(!o.allowed);
    assert_eq!(o.remaining, 0);
    assert_eq!(secs(o.retry_after), 50.0);
    let o = step(&mut st, T0 + 60 * S, lp, 1);
    assert!(o.allowed, "next window");
    assert_eq!(o.remaining, 2);
}

#[test]
fn checks_limit_zero_and_oversized_requests() {
    for alg in Algorithm::ALL {
        let lp = p(0, 60, alg, 0);
        let (o, _) = decide(None, T0, lp, 1, Mode::Charge);
        assert!(!o.allowed, "{alg:?}: limit 0 blocks");
        assert_eq!(o.retry_after, Duration::MAX, "{alg:?}: never");
        let lp = p(2, 60, alg, 1);
        let (o, _) = decide(None, T0, lp, 3, Mode::Charge);
        assert!(!o.allowed, "{alg:?}: 3 hits never fit in 2");
        assert_eq!(o.retry_after, Duration::MAX, "{alg:?}");
        let (o, st) = decide(None, T0, lp, 0, Mode::Charge);
        assert!(o.allowed, "{alg:?}: a check on a fresh counter passes");
        assert_eq!(o.remaining, 2, "{alg:?}: a check charges nothing");
        let (o2, _) = decide(Some(&st), T0, lp, 2, Mode::Charge);
        assert!(o2.allowed, "{alg:?}: nothing was charged by the check");
    }
}

// ---- sliding_window -----------------------------------------------------------------------

fn sliding(previous: u64, current: u64, window_start: u64) -> Option<State> {
    Some(State::Sliding {
        window_start,
        previous,
        current,
    })
}

#[test]
fn sliding_window_weights_the_previous_window() {
    let lp = p(10, 60, Algorithm::SlidingWindow, 0);
    // 10 hits in the previous window, none in this one.
    // 0% into the window: the previous window counts fully -> full.
    let st = sliding(0, 10, T0 - 60 * S);
    let (o, _) = decide(st.as_ref(), T0, lp, 1, Mode::Charge);
    assert!(!o.allowed);
    assert_eq!(o.remaining, 0);
    // 50% in: 10 * 0.5 = 5 used, one more -> 6, 4 left.
    let (o, next) = decide(st.as_ref(), T0 + 30 * S, lp, 1, Mode::Charge);
    assert!(o.allowed);
    assert_eq!(o.remaining, 4);
    assert_eq!(secs(o.reset), 30.0);
    assert_eq!(
        next,
        State::Sliding {
            window_start: T0,
            previous: 10,
            current: 1
        }
    );
    // 100% (the next window starts): the old previous window is gone entirely; the window
    // that was current becomes the previous one.
    let st = sliding(10, 4, T0);
    let (o, _) = decide(st.as_ref(), T0 + 60 * S, lp, 1, Mode::Charge);
    assert!(o.allowed);
    assert_eq!(o.remaining, 5, "4 (weight 1) + 1");
    // Two windows later nothing is left.
    let (o, _) = decide(st.as_ref(), T0 + 120 * S, lp, 1, Mode::Charge);
    assert_eq!(o.remaining, 9);
}

#[test]
fn sliding_window_retry_after_is_when_enough_has_slid_out() {
    let lp = p(10, 60, Algorithm::SlidingWindow, 0);
    // 30 s in, previous 10 (weight 0.5 -> 5) + current 5 = 10: full.
    let st = sliding(10, 5, T0);
    let (o, _) = decide(st.as_ref(), T0 + 30 * S, lp, 1, Mode::Charge);
    assert!(!o.allowed);
    // Need 1 slot: previous must lose 1 hit's weight: 1/10 of 60 s = 6 s.
    assert_eq!(secs(o.retry_after), 6.0);
}

#[test]
fn sliding_window_retry_after_spans_into_the_next_window_when_this_one_is_full() {
    let lp = p(3, 60, Algorithm::SlidingWindow, 0);
    // 50 s in, 3 hits in this window: the next window starts at +10 s with these 3 at full
    // weight; 3 * (60 - x) / 60 + 1 <= 3 from x = 20 s, so retry at +30 s.
    let st = sliding(0, 3, T0);
    let (o, _) = decide(st.as_ref(), T0 + 50 * S, lp, 1, Mode::Charge);
    assert!(!o.allowed);
    assert_eq!(secs(o.retry_after), 30.0);
    // ... and it is admitted then, not a moment before.
    let mut st = st;
    let o = step(&mut st, T0 + 80 * S - 1, lp, 1);
    assert!(!o.allowed);
    let o = step(&mut st, T0 + 80 * S, lp, 1);
    assert!(o.allowed);
}

// ---- sliding_log --------------------------------------------------------------------------

#[test]
fn sliding_log_is_exact_at_the_window_edge() {
    let lp = p(2, 10, Algorithm::SlidingLog, 0);
    let mut st = None;
    assert!(step(&mut st, T0, lp, 1).allowed);
    assert!(step(&mut st, T0 + 4 * S, lp, 1).allowed);
    let o = step(&mut st, T0 + 9 * S, lp, 1);
    assert!(!o.allowed);
    assert_eq!(secs(o.retry_after), 1.0, "the T0 hit leaves at T0+10s");
    assert_eq!(secs(o.reset), 5.0, "the T0+4s hit leaves at T0+14s");
    // Exactly one period after the first hit, it no longer counts.
    let o = step(&mut st, T0 + 10 * S, lp, 1);
    assert!(o.allowed, "a hit at t counts while t > now - period");
    assert_eq!(o.remaining, 0);
    // One microsecond before that, it still did.
    let mut st2 = None;
    step(&mut st2, T0, lp, 1);
    step(&mut st2, T0 + 4 * S, lp, 1);
    assert!(!step(&mut st2, T0 + 10 * S - 1, lp, 1).allowed);
}

#[test]
fn sliding_log_multiple_hits_add_entries_and_refunds_remove_the_newest() {
    let lp = p(5, 10, Algorithm::SlidingLog, 0);
    let mut st = None;
    let o = step(&mut st, T0, lp, 3);
    assert_eq!(o.remaining, 2);
    let o = step(&mut st, T0 + S, lp, 3);
    assert!(!o.allowed);
    assert_eq!(
        secs(o.retry_after),
        9.0,
        "the oldest hit (T0) leaves at T0+10s, 9 s from now"
    );
    let (o, next) = decide(st.as_ref(), T0 + S, lp, 2, Mode::Refund);
    assert!(o.allowed);
    assert_eq!(o.remaining, 4);
    assert_eq!(next, State::Log(Box::new(Log::from_entries([(T0, 1)]))));
}

// ---- token_bucket (GCRA, redis-cell math) ---------------------------------------------------

#[test]
fn gcra_admit_deny_boundary_remaining_and_retry_after() {
    // 5 per 10 s, burst 4: T = 2 s, tau = 10 s.
    let lp = p(5, 10, Algorithm::TokenBucket, 4);
    let mut st = None;
    for (i, rem) in [4u32, 3, 2, 1, 0].into_iter().enumerate() {
        let o = step(&mut st, T0, lp, 1);
        assert!(o.allowed, "request {i}");
        assert_eq!(o.remaining, rem);
        assert_eq!(
            secs(o.reset),
            2.0 * (i as f64 + 1.0),
            "time until full again"
        );
    }
    let o = step(&mut st, T0, lp, 1);
    assert!(!o.allowed);
    assert_eq!(o.remaining, 0);
    assert_eq!(secs(o.retry_after), 2.0, "one emission interval");
    assert_eq!(secs(o.reset), 10.0);
    // Exactly at the retry time it conforms again (boundary inclusive).
    let o = step(&mut st, T0 + 2 * S, lp, 1);
    assert!(o.allowed);
    assert_eq!(o.remaining, 0);
    // One microsecond early it does not.
    let o = step(&mut st, T0 + 4 * S - 1, lp, 1);
    assert!(!o.allowed);
    assert_eq!(o.retry_after, Duration::from_micros(1));
}

#[test]
fn gcra_is_exact_at_rates_that_do_not_divide_the_period() {
    // 600 000 per second with a burst of one second: T = 1/600 000 s = 1.666... µs. Rounding T
    // down to 1 µs would refill at 1 000 000/s.
    let lp = p(600_000, 1, Algorithm::TokenBucket, 599_999);
    let mut st = None;
    assert!(step(&mut st, T0, lp, 600_000).allowed, "the full burst");
    assert!(!step(&mut st, T0, lp, 1).allowed, "nothing left");
    // Half a second refills exactly 300 000 tokens.
    let half = T0 + S / 2;
    let o = step(&mut st, half, lp, 400_000);
    assert!(!o.allowed, "400 000 more within half a second are refused");
    assert_eq!(o.remaining, 300_000);
    assert!(step(&mut st, half, lp, 300_000).allowed);
    assert!(!step(&mut st, half, lp, 1).allowed);
    // One request at a time: over the next 100 ms exactly 60 000 conform.
    let mut admitted = 0;
    for i in 0..120_000u64 {
        // two requests per emission interval, spread over 100 ms
        if step(&mut st, half + i * 100_000 / 120_000, lp, 1).allowed {
            admitted += 1;
        }
    }
    assert!((59_999..=60_000).contains(&admitted), "{admitted}");
}

#[test]
fn gcra_burst_zero_is_a_steady_rate() {
    // 1 per second, no burst: T = 1 s, tau = 1 s.
    let lp = p(1, 1, Algorithm::TokenBucket, 0);
    let mut st = None;
    assert!(step(&mut st, T0, lp, 1).allowed);
    let o = step(&mut st, T0 + S / 2, lp, 1);
    assert!(!o.allowed);
    assert_eq!(secs(o.retry_after), 0.5);
    assert!(step(&mut st, T0 + S, lp, 1).allowed);
}

#[test]
fn gcra_refills_continuously_and_refunds() {
    let lp = p(10, 10, Algorithm::TokenBucket, 9); // T = 1 s, tau = 10 s
    let mut st = None;
    assert_eq!(step(&mut st, T0, lp, 10).remaining, 0);
    // 3.5 s later 3 whole tokens are back (the half token does not count).
    let o = step(&mut st, T0 + 3 * S + S / 2, lp, 0);
    assert!(o.allowed);
    assert_eq!(o.remaining, 3);
    let (o, _) = decide(st.as_ref(), T0, lp, 4, Mode::Refund);
    assert_eq!(o.remaining, 4);
}

#[test]
fn expiry_follows_each_algorithm() {
    let fixed = p(1, 60, Algorithm::FixedWindow, 0);
    let (_, s) = decide(None, T0 + S, fixed, 1, Mode::Charge);
    assert_eq!(expires_at(&s, fixed), T0 + 60 * S);
    let sw = p(1, 60, Algorithm::SlidingWindow, 0);
    let (_, s) = decide(None, T0 + S, sw, 1, Mode::Charge);
    assert_eq!(expires_at(&s, sw), T0 + 120 * S);
    let log = p(1, 60, Algorithm::SlidingLog, 0);
    let (_, s) = decide(None, T0 + S, log, 1, Mode::Charge);
    assert_eq!(expires_at(&s, log), T0 + 61 * S);
    let tb = p(1, 60, Algorithm::TokenBucket, 0);
    let (_, s) = decide(None, T0 + S, tb, 1, Mode::Charge);
    assert_eq!(expires_at(&s, tb), T0 + 61 * S);
}

#[test]
fn a_recorded_sliding_log_never_holds_more_entries_than_its_limit() {
    let p = LimitParams {
        limit: 5,
        period_us: 3_600_000_000,
        algorithm: Algorithm::SlidingLog,
        burst: 0,
        window_start: None,
    };
    let mut log = Log::default();
    let mut total = 0u64;
    for i in 0..1000u64 {
        let hits = if i % 100 == 0 { MAX_HITS } else { 1 };
        let o = sliding_log_in(&mut log, 1_000_000 + i, p, hits, Mode::Record, true);
        total = (total + hits).min(MAX_COUNT);
        assert_eq!(o.allowed, total <= 5);
    }
    assert!(log.entries.len() <= 5, "{} entries", log.entries.len());
    // The count stayed exact (saturated at MAX_COUNT at most).
    let o = sliding_log_in(&mut log, 1_000_000 + 1000, p, 0, Mode::Record, false);
    assert!(!o.allowed);
    assert_eq!(o.remaining, 0);
}

#[test]
fn a_log_gives_back_on_the_entry_named_and_only_within_its_bound() {
    let mut log = Log::from_entries([(T0, 5), (T0 + 1, 2), (T0 + 2, 3)]);
    // Ids start at the first entry's time and rise by one.
    assert_eq!(log.newest_id(), T0 + 2);
    assert_eq!(log.give_back(T0, 4, 3), 4, "the oldest entry, found");
    assert_eq!(log, Log::from_entries([(T0, 1), (T0 + 1, 2), (T0 + 2, 3)]));
    assert_eq!(
        log.give_back(T0, 9, 3),
        1,
        "no more than it holds, then it goes"
    );
    assert_eq!(log.total, 5);
    assert_eq!(
        log.give_back(T0 + 1, 2, 1),
        0,
        "past the newest 1: not found"
    );
    assert_eq!(
        log.give_back(T0 + 7, 2, 9),
        0,
        "no such entry: nothing from the others"
    );
    assert_eq!(log.total, 5);
}
