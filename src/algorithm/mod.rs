//! Pure decision math, one function per algorithm: `(state, now, limit, hits) -> (outcome,
//! state')`. No I/O and no clock of their own, so the memory store and the Redis Lua script
//! (`src/store/redis/decide.lua`) mirror them exactly and the tests check them against
//! hand-computed cases. Time is integer microseconds since the Unix epoch; the only floating
//! point (the sliding-window weight) is computed in the same order in Rust and Lua, which are
//! both IEEE-754 doubles, so both stores agree to the bit.

use crate::config::Algorithm;
use std::collections::VecDeque;
use std::time::Duration;

/// A limit as the math sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitParams {
    /// Requests admitted per period; 0 blocks everything.
    pub limit: u32,
    /// Period in microseconds (> 0).
    pub period_us: u64,
    pub algorithm: Algorithm,
    /// token_bucket only: requests allowed at once above the steady rate.
    pub burst: u32,
}

/// Stored state of one counter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// fixed_window: the window counted and its hits.
    Fixed { window_start: u64, count: u64 },
    /// sliding_window: the current window, the previous window's hits and the current ones.
    Sliding {
        window_start: u64,
        previous: u64,
        current: u64,
    },
    /// sliding_log: timestamps of the counted hits, oldest first.
    Log(VecDeque<u64>),
    /// token_bucket: the theoretical arrival time (GCRA's TAT).
    Bucket { tat: u64 },
}

/// What one limit says about one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// Whether this limit alone admits the request.
    pub allowed: bool,
    /// Hits left after this request (if admitted and charged) or as it stands (if not).
    pub remaining: u32,
    /// When the counter is back to its full quota (see each algorithm).
    pub reset: Duration,
    /// For a denial: how long until this request would be admitted (zero when allowed;
    /// `Duration::MAX` when it never can be, e.g. a limit of 0 or more hits than the quota).
    pub retry_after: Duration,
}

/// Whether to charge hits or give them back (Envoy's `is_negative_hits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Charge,
    Refund,
}

/// Microseconds as a duration; `u64::MAX` means "never" and becomes `Duration::MAX`.
fn us(v: u64) -> Duration {
    if v == u64::MAX {
        Duration::MAX
    } else {
        Duration::from_micros(v)
    }
}

fn clamp_u32(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

/// Decides one limit. `hits = 0` is a check: allowed while one more request would fit, and it
/// charges nothing. The returned state is what to store if the whole request is admitted; the
/// caller discards it on a denial, so a denied request charges nothing. A denied charge returns
/// the state unchanged.
pub fn decide(
    state: Option<&State>,
    now: u64,
    p: LimitParams,
    hits: u64,
    mode: Mode,
) -> (Outcome, State) {
    match p.algorithm {
        Algorithm::FixedWindow => fixed_window(state, now, p, hits, mode),
        Algorithm::SlidingWindow => sliding_window(state, now, p, hits, mode),
        Algorithm::SlidingLog => sliding_log(state, now, p, hits, mode),
        Algorithm::TokenBucket => token_bucket(state, now, p, hits, mode),
    }
}

/// Whether `hits` fit on top of `used` (a check, `hits == 0`, asks for room for one more).
fn fits(used: u64, hits: u64, limit: u64) -> bool {
    if hits == 0 {
        used < limit
    } else {
        used.saturating_add(hits) <= limit
    }
}

/// fixed_window: a counter per window aligned to multiples of the period since the epoch.
/// `reset` is the end of the window; a denial retries at the next window (never, if the hits
/// exceed the limit).
pub fn fixed_window(
    state: Option<&State>,
    now: u64,
    p: LimitParams,
    hits: u64,
    mode: Mode,
) -> (Outcome, State) {
    let start = now - now % p.period_us;
    let current = match state {
        Some(State::Fixed {
            window_start,
            count,
        }) if *window_start == start => *count,
        _ => 0,
    };
    let limit = u64::from(p.limit);
    let reset = start + p.period_us - now;
    let (allowed, after) = match mode {
        Mode::Refund => (true, current.saturating_sub(hits)),
        Mode::Charge if fits(current, hits, limit) => (true, current + hits),
        Mode::Charge => (false, current),
    };
    let retry_after = if allowed {
        0
    } else if hits.max(1) > limit {
        u64::MAX
    } else {
        reset
    };
    (
        Outcome {
            allowed,
            remaining: clamp_u32(limit.saturating_sub(after)),
            reset: us(reset),
            retry_after: us(retry_after),
        },
        State::Fixed {
            window_start: start,
            count: after,
        },
    )
}

/// The sliding-window estimate: the previous window's hits weighted by the share of it still
/// inside the sliding period, plus the current window's hits. Same operation order as Lua.
fn sliding_estimate(previous: u64, current: u64, elapsed: u64, period: u64) -> f64 {
    let weight = (period - elapsed) as f64 / period as f64;
    previous as f64 * weight + current as f64
}

/// sliding_window: two epoch-aligned windows, the previous one weighted by how much of it the
/// sliding period still covers (Cloudflare's approximation; O(1) state). `reset` is the end of
/// the current window; a denial retries when enough of the previous window has slid out.
pub fn sliding_window(
    state: Option<&State>,
    now: u64,
    p: LimitParams,
    hits: u64,
    mode: Mode,
) -> (Outcome, State) {
    let period = p.period_us;
    let start = now - now % period;
    let elapsed = now - start;
    let (previous, current) = match state {
        Some(State::Sliding {
            window_start,
            previous,
            current,
        }) if *window_start == start => (*previous, *current),
        Some(State::Sliding {
            window_start,
            current,
            ..
        }) if window_start.checked_add(period) == Some(start) => (*current, 0),
        _ => (0, 0),
    };
    let limit = p.limit as f64;
    let estimate = sliding_estimate(previous, current, elapsed, period);
    let (allowed, after) = match mode {
        Mode::Refund => (true, current.saturating_sub(hits)),
        Mode::Charge => {
            let ok = if hits == 0 {
                estimate < limit
            } else {
                estimate + hits as f64 <= limit
            };
            (ok, if ok { current + hits } else { current })
        }
    };
    let used = sliding_estimate(previous, after, elapsed, period);
    let remaining = (limit - used).floor().max(0.0) as u64;
    let retry_after = if allowed {
        0
    } else if hits.max(1) > u64::from(p.limit) {
        u64::MAX
    } else {
        // The estimate falls linearly as the previous window slides out; once it is gone the
        // next window starts from this window's hits, which then slide out in turn: at `x`
        // into the next window the estimate is `current * (period - x) / period`.
        let h = hits.max(1);
        let need = estimate + h as f64 - limit;
        if previous > 0 && (current + h) as f64 <= limit {
            let t = (need / previous as f64 * period as f64).ceil() as u64;
            t.min(period - elapsed)
        } else if (current + h) as f64 <= limit {
            period - elapsed
        } else {
            let x = ((current + h) as f64 - limit) / current as f64 * period as f64;
            (period - elapsed).saturating_add(x.ceil() as u64)
        }
    };
    (
        Outcome {
            allowed,
            remaining: clamp_u32(remaining),
            reset: us(period - elapsed),
            retry_after: us(retry_after),
        },
        State::Sliding {
            window_start: start,
            previous,
            current: after,
        },
    )
}

/// sliding_log: the exact timestamps of the counted hits within the last period. `reset` is
/// when the newest counted hit leaves the period (the quota is full again); a denial retries
/// when enough old hits have left for this request to fit.
pub fn sliding_log(
    state: Option<&State>,
    now: u64,
    p: LimitParams,
    hits: u64,
    mode: Mode,
) -> (Outcome, State) {
    let mut log = match state {
        Some(State::Log(l)) => l.clone(),
        _ => VecDeque::new(),
    };
    // A hit at `t` counts while `t > now - period`.
    let horizon = now.saturating_sub(p.period_us);
    while log.front().is_some_and(|&t| t <= horizon) {
        log.pop_front();
    }
    let limit = u64::from(p.limit);
    let count = log.len() as u64;
    let allowed = match mode {
        Mode::Refund => {
            for _ in 0..hits.min(count) {
                log.pop_back();
            }
            true
        }
        Mode::Charge if fits(count, hits, limit) => {
            log.extend(std::iter::repeat_n(now, hits as usize));
            true
        }
        Mode::Charge => false,
    };
    let retry_after = if allowed {
        0
    } else if hits.max(1) > limit {
        u64::MAX
    } else {
        // The hit that must leave for `hits` to fit is the (count + hits - limit)-th oldest.
        let idx = (count + hits.max(1) - limit - 1) as usize;
        log.get(idx).map_or(0, |&t| t + p.period_us - now)
    };
    let reset = log.back().map_or(0, |&t| t + p.period_us - now);
    (
        Outcome {
            allowed,
            remaining: clamp_u32(limit.saturating_sub(log.len() as u64)),
            reset: us(reset),
            retry_after: us(retry_after),
        },
        State::Log(log),
    )
}

/// token_bucket: GCRA as in redis-cell. Emission interval `T = period / limit`, tolerance
/// `tau = T * (burst + 1)`, state the theoretical arrival time (TAT). A request of `hits` is
/// admitted when `max(TAT, now) + hits * T <= now + tau`. `remaining` is the whole tokens left,
/// `reset` the time until the bucket is full again, and a denial's `retry_after` the time until
/// the request would conform.
pub fn token_bucket(
    state: Option<&State>,
    now: u64,
    p: LimitParams,
    hits: u64,
    mode: Mode,
) -> (Outcome, State) {
    let stored = match state {
        Some(State::Bucket { tat }) => *tat,
        _ => now,
    };
    if p.limit == 0 {
        return (
            Outcome {
                allowed: mode == Mode::Refund,
                remaining: 0,
                reset: Duration::ZERO,
                retry_after: if mode == Mode::Refund {
                    Duration::ZERO
                } else {
                    Duration::MAX
                },
            },
            State::Bucket { tat: stored },
        );
    }
    let t = (p.period_us / u64::from(p.limit)).max(1);
    let tau = t.saturating_mul(u64::from(p.burst) + 1);
    let tat = stored.max(now);
    let (allowed, new_tat) = match mode {
        Mode::Refund => (true, tat.saturating_sub(t.saturating_mul(hits)).max(now)),
        Mode::Charge => {
            let cost = t.saturating_mul(hits.max(1));
            let candidate = tat.saturating_add(cost);
            let ok = candidate <= now.saturating_add(tau);
            let charged = if hits == 0 { tat } else { candidate };
            (ok, if ok { charged } else { tat })
        }
    };
    let ttl = new_tat - now;
    let retry_after = if allowed {
        0
    } else if t.saturating_mul(hits.max(1)) > tau {
        u64::MAX
    } else {
        tat + t.saturating_mul(hits.max(1)) - tau - now
    };
    (
        Outcome {
            allowed,
            remaining: clamp_u32(tau.saturating_sub(ttl) / t),
            reset: us(ttl),
            retry_after: us(retry_after),
        },
        State::Bucket { tat: new_tat },
    )
}

/// When a stored state stops mattering (microseconds since the epoch): after this the
/// algorithm treats the counter as fresh, so stores may drop it.
pub fn expires_at(state: &State, p: LimitParams) -> u64 {
    match state {
        State::Fixed { window_start, .. } => window_start + p.period_us,
        State::Sliding { window_start, .. } => window_start + 2 * p.period_us,
        State::Log(l) => l.back().map_or(0, |t| t + p.period_us),
        State::Bucket { tat } => *tat,
    }
}

#[cfg(test)]
mod tests;
