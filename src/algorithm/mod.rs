//! Pure decision math, one function per algorithm: `(state, now, limit, hits) -> (state', outcome)`.
//! No I/O and no clock of their own, so the memory store and the Redis Lua script can mirror them
//! exactly and tests can check them against hand-computed cases.

use std::time::Duration;

/// A limit as the math sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitParams {
    /// Requests admitted per period; 0 blocks everything.
    pub limit: u32,
    pub period: Duration,
}

/// State of one fixed-window counter: the window it counts and how many hits it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FixedWindowState {
    /// Start of the counted window, since the Unix epoch.
    pub window_start: Duration,
    pub count: u64,
}

/// What one limit says about one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// Whether this limit alone admits the request.
    pub allowed: bool,
    /// Hits left in the window after this request (if admitted and charged) or as it stands (if not).
    pub remaining: u32,
    /// Time until the window resets.
    pub reset: Duration,
}

/// Start of the epoch-aligned window containing `now`.
pub fn window_start(now: Duration, period: Duration) -> Duration {
    let p = period.as_nanos().max(1);
    let n = now.as_nanos();
    Duration::from_nanos((n - n % p) as u64)
}

/// Fixed window, epoch-aligned. `hits = 0` is a check: it is allowed only while the window still
/// has room for one more request, and it charges nothing. Returns the outcome and the state to
/// store if the whole request is admitted; the caller discards that state on a denial, so a
/// denied request charges nothing.
pub fn fixed_window(
    state: Option<FixedWindowState>,
    now: Duration,
    params: LimitParams,
    hits: u64,
) -> (Outcome, FixedWindowState) {
    let start = window_start(now, params.period);
    let current = match state {
        Some(s) if s.window_start == start => s.count,
        _ => 0,
    };
    let limit = u64::from(params.limit);
    let reset = (start + params.period).saturating_sub(now);
    let allowed = if hits == 0 {
        current < limit
    } else {
        current.saturating_add(hits) <= limit
    };
    let after = if allowed {
        current.saturating_add(hits)
    } else {
        current
    };
    let remaining = u32::try_from(limit.saturating_sub(after)).unwrap_or(u32::MAX);
    (
        Outcome {
            allowed,
            remaining,
            reset,
        },
        FixedWindowState {
            window_start: start,
            count: after,
        },
    )
}

/// Gives back `hits` to a counter (Envoy's `is_negative_hits`): never below zero, never into a
/// window that has already ended.
pub fn fixed_window_refund(
    state: Option<FixedWindowState>,
    now: Duration,
    params: LimitParams,
    hits: u64,
) -> (Outcome, FixedWindowState) {
    let start = window_start(now, params.period);
    let current = match state {
        Some(s) if s.window_start == start => s.count,
        _ => 0,
    };
    let after = current.saturating_sub(hits);
    let limit = u64::from(params.limit);
    (
        Outcome {
            allowed: true,
            remaining: u32::try_from(limit.saturating_sub(after)).unwrap_or(u32::MAX),
            reset: (start + params.period).saturating_sub(now),
        },
        FixedWindowState {
            window_start: start,
            count: after,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: LimitParams = LimitParams {
        limit: 3,
        period: Duration::from_secs(60),
    };

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    #[test]
    fn windows_align_to_the_epoch() {
        assert_eq!(window_start(s(125), s(60)), s(120));
        assert_eq!(window_start(s(120), s(60)), s(120));
        assert_eq!(window_start(Duration::from_millis(119_999), s(60)), s(60));
    }

    #[test]
    fn admits_up_to_the_limit_then_denies_without_charging() {
        let mut st = None;
        for expected_remaining in [2, 1, 0] {
            let (o, next) = fixed_window(st, s(130), MIN, 1);
            assert!(o.allowed);
            assert_eq!(o.remaining, expected_remaining);
            assert_eq!(o.reset, s(50));
            st = Some(next);
        }
        let (o, next) = fixed_window(st, s(130), MIN, 1);
        assert!(!o.allowed);
        assert_eq!(o.remaining, 0);
        assert_eq!(next.count, 3, "a denial leaves the count as it was");
    }

    #[test]
    fn a_new_window_starts_from_zero() {
        let full = Some(FixedWindowState {
            window_start: s(120),
            count: 3,
        });
        let (o, next) = fixed_window(full, s(180), MIN, 1);
        assert!(o.allowed);
        assert_eq!(o.remaining, 2);
        assert_eq!(next.window_start, s(180));
        assert_eq!(o.reset, s(60));
    }

    #[test]
    fn hits_larger_than_room_are_denied_whole() {
        let st = Some(FixedWindowState {
            window_start: s(120),
            count: 2,
        });
        let (o, _) = fixed_window(st, s(121), MIN, 2);
        assert!(!o.allowed);
        assert_eq!(o.remaining, 1);
    }

    #[test]
    fn zero_hits_is_a_check_that_charges_nothing() {
        let st = Some(FixedWindowState {
            window_start: s(120),
            count: 2,
        });
        let (o, next) = fixed_window(st, s(121), MIN, 0);
        assert!(o.allowed);
        assert_eq!(next.count, 2);
        let st = Some(FixedWindowState {
            window_start: s(120),
            count: 3,
        });
        let (o, _) = fixed_window(st, s(121), MIN, 0);
        assert!(!o.allowed, "an exhausted window fails the check");
    }

    #[test]
    fn limit_zero_blocks_everything() {
        let p = LimitParams { limit: 0, ..MIN };
        assert!(!fixed_window(None, s(1), p, 1).0.allowed);
        assert!(!fixed_window(None, s(1), p, 0).0.allowed);
    }

    #[test]
    fn refund_never_goes_below_zero() {
        let st = Some(FixedWindowState {
            window_start: s(120),
            count: 2,
        });
        let (o, next) = fixed_window_refund(st, s(125), MIN, 5);
        assert_eq!(next.count, 0);
        assert_eq!(o.remaining, 3);
    }
}
