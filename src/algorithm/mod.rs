//! Pure decision math, one function per algorithm: `(state, now, limit, hits) -> (outcome,
//! state')`. No I/O and no clock of their own, so the memory store and the Redis Lua script
//! (`decide.lua`, in `src/store/redis/decide/`) mirror them exactly and the tests check them against
//! hand-computed cases. Time is integer microseconds since the Unix epoch; the only floating
//! point (the sliding-window weight) is computed in the same order in Rust and Lua, which are
//! both IEEE-754 doubles, so both stores agree to the bit.

use crate::config::Algorithm;
use std::time::Duration;

mod in_flight;
mod log;
mod reserve;
pub use in_flight::{in_flight, remember_denial, Lease, Slots};
pub use log::Log;
pub use reserve::{reserve, Reserved, Settle, Terms};

/// A limit as the math sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitParams {
    pub limit: u32,     // requests admitted per period; 0 blocks everything
    pub period_us: u64, // microseconds (> 0)
    pub algorithm: Algorithm,
    /// token_bucket only: requests allowed at once above the steady rate.
    pub burst: u32,
    /// fixed_window on a calendar: the window's start (µs; `period_us` is its length), instead
    /// of the multiple of the period since the epoch.
    pub window_start: Option<u64>,
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
    /// sliding_log: the admitted charges (boxed: the other states stay small, and so does
    /// every counter of the memory store).
    Log(Box<Log>),
    /// token_bucket: the theoretical arrival time (GCRA's TAT), `tat + frac / limit`
    /// microseconds, so `period / limit` is added exactly whatever the rate.
    Bucket { tat: u64, frac: u64 },
    /// in_flight: the slots held (boxed, as the log).
    Slots(Box<Slots>),
    /// A rate limit with `reservations`: its own state and the reservations held.
    Reserved(Box<Reserved>),
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

/// How a limit takes a request's hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Charge the hits only if they fit (a check, `hits == 0`, asks for room for one more).
    Charge,
    /// Give the hits back (Envoy's `is_negative_hits`).
    Refund,
    /// Record the hits whether or not they fit (envoyproxy's counting, and `record_usage`):
    /// the state always takes them, and the limit allows the request while the count after
    /// them is not above the limit (a check, `hits == 0`, passes at exactly the limit).
    Record,
}

/// Largest `hits` one check charges: a larger `hits_addend` (Envoy's is a u64) counts as this
/// many, which is more than any limit (a u32) admits. Keeps every sum exact in the Lua
/// script's doubles.
pub const MAX_HITS: u64 = 1 << 40;
/// A recorded count saturates here instead of wrapping (and stays exact in Lua's doubles).
pub const MAX_COUNT: u64 = 1 << 50;

/// `used + hits`, saturating at [`MAX_COUNT`].
fn add_count(used: u64, hits: u64) -> u64 {
    used.saturating_add(hits).min(MAX_COUNT.max(used))
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
    if let Some(State::Reserved(r)) = state {
        // A request without an id on a limit with reservations: the counter as usual, the
        // reservations kept.
        let (o, s) = decide(r.inner.as_ref(), now, p, hits, mode);
        let kept = Reserved {
            inner: Some(s),
            held: r.held.clone(),
        };
        return (o, State::Reserved(Box::new(kept)));
    }
    match p.algorithm {
        Algorithm::FixedWindow => fixed_window(state, now, p, hits, mode),
        Algorithm::SlidingWindow => sliding_window(state, now, p, hits, mode),
        Algorithm::SlidingLog => sliding_log(state, now, p, hits, mode),
        Algorithm::TokenBucket => token_bucket(state, now, p, hits, mode),
        // Without a request id: whether a slot is free (the store passes ids to `in_flight`).
        Algorithm::InFlight => {
            let slots = match state {
                Some(State::Slots(s)) => Some(&**s),
                _ => None,
            };
            let (o, s) = in_flight(slots, now, p, Lease::Check);
            (o, State::Slots(Box::new(s)))
        }
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

/// fixed_window: a counter per window aligned to multiples of the period since the epoch (or a
/// calendar window given as `window_start` and its length).
/// `reset` is the end of the window; a denial retries at the next window (never, if the hits
/// exceed the limit).
pub fn fixed_window(
    state: Option<&State>,
    now: u64,
    p: LimitParams,
    hits: u64,
    mode: Mode,
) -> (Outcome, State) {
    let mut start = p.window_start.unwrap_or(now - now % p.period_us);
    let current = match state {
        Some(State::Fixed {
            window_start,
            count,
        }) if *window_start >= start => {
            // A stored window newer than `now` (a request delayed across a window edge, a clock
            // stepped back) is the current one: an older window never overwrites it.
            start = *window_start;
            *count
        }
        _ => 0,
    };
    let limit = u64::from(p.limit);
    let reset = (start + p.period_us).saturating_sub(now);
    let (allowed, after) = match mode {
        // A refund pinned to an older window than the one counted gives the newer one nothing.
        Mode::Refund if p.window_start.is_some_and(|w| w < start) => (true, current),
        Mode::Refund => (true, current.saturating_sub(hits)),
        Mode::Record => {
            let after = add_count(current, hits);
            (after <= limit, after)
        }
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
    let mut start = now - now % period;
    let (previous, current) = match state {
        // A stored window newer than `now` is the current one (see `fixed_window`).
        Some(State::Sliding {
            window_start,
            previous,
            current,
        }) if *window_start >= start => {
            start = *window_start;
            (*previous, *current)
        }
        Some(State::Sliding {
            window_start,
            current,
            ..
        }) if window_start.checked_add(period) == Some(start) => (*current, 0),
        _ => (0, 0),
    };
    let elapsed = now.saturating_sub(start);
    let limit = p.limit as f64;
    let estimate = sliding_estimate(previous, current, elapsed, period);
    let (allowed, after) = match mode {
        Mode::Refund => (true, current.saturating_sub(hits)),
        Mode::Record => (estimate + hits as f64 <= limit, add_count(current, hits)),
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

/// Most entries a refund (`is_negative_hits`) removes or shrinks, newest first: the store's
/// work per call stays bounded whatever `hits` says.
pub const LOG_REFUND_ENTRIES: usize = 64;

/// Most entries a reservation's give-back on a sliding_log searches for its own entry, newest
/// first (decide.lua rewrites the running total of each entry after it): past them nothing is
/// given back, which can only under-admit.
pub const LOG_GIVE_BACK_ENTRIES: usize = 256;

/// sliding_log: the exact charges within the last period. `reset` is when the newest counted
/// charge leaves the period (the quota is full again); a denial retries when enough old hits
/// have left for this request to fit. A charge is stamped no earlier than the newest entry, so
/// the log stays ordered even if the clock steps back.
pub fn sliding_log(
    state: Option<&State>,
    now: u64,
    p: LimitParams,
    hits: u64,
    mode: Mode,
) -> (Outcome, State) {
    let mut log = match state {
        Some(State::Log(l)) => l.clone(),
        _ => Box::default(),
    };
    let outcome = sliding_log_in(&mut log, now, p, hits, mode, true);
    (outcome, State::Log(log))
}

/// [`sliding_log`] on a log in place, without copying it. With `commit` the charge (or refund)
/// is written; without, the outcome is the same but the log only loses expired charges (which
/// count for nothing), so a store can decide every limit of a request first and write only if
/// all admit it. O(expired + refunded) work, plus, for a denial, the walk to the retry time.
pub fn sliding_log_in(
    log: &mut Log,
    now: u64,
    p: LimitParams,
    hits: u64,
    mode: Mode,
    commit: bool,
) -> Outcome {
    if mode == Mode::Refund && !commit {
        // Rare (Envoy's is_negative_hits): decided on a copy.
        return sliding_log_in(&mut log.clone(), now, p, hits, mode, true);
    }
    // A charge at `t` counts while `t > now - period`.
    log.trim(now.saturating_sub(p.period_us));
    let limit = u64::from(p.limit);
    let count = log.total;
    let newest = log.newest();
    let (allowed, total, last) = match mode {
        Mode::Refund => {
            log.refund(hits, LOG_REFUND_ENTRIES);
            (true, log.total, log.newest())
        }
        Mode::Record => {
            // Written below, after the retry time is read off the log as it was.
            let t = if hits > 0 {
                Some(newest.map_or(now, |t| t.max(now)))
            } else {
                newest
            };
            (
                count.saturating_add(hits) <= limit,
                add_count(count, hits),
                t,
            )
        }
        Mode::Charge if fits(count, hits, limit) => {
            if hits == 0 {
                (true, count, newest)
            } else {
                let t = newest.map_or(now, |t| t.max(now));
                if commit {
                    log.push(t, hits);
                }
                (true, count + hits, Some(t))
            }
        }
        Mode::Charge => (false, count, newest),
    };
    let retry_after = if allowed {
        0
    } else if hits.max(1) > limit {
        u64::MAX
    } else {
        log.retry_after(count + hits.max(1) - limit, p.period_us, now)
    };
    if mode == Mode::Record && hits > 0 && commit {
        log.record(now, hits, limit);
    }
    let reset = last.map_or(0, |t| (t + p.period_us).saturating_sub(now));
    Outcome {
        allowed,
        remaining: clamp_u32(limit.saturating_sub(total)),
        reset: us(reset),
        retry_after: us(retry_after),
    }
}

/// A time `us + frac / limit` microseconds (`frac < limit`): token_bucket's clock, on which
/// the emission interval `period / limit` is exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Fine {
    us: u64,
    frac: u64,
}

impl Fine {
    fn add(self, us: u64, frac: u64, limit: u64) -> Fine {
        let f = self.frac + frac;
        Fine {
            us: self.us.saturating_add(us).saturating_add(f / limit),
            frac: f % limit,
        }
    }

    /// `self - us - frac / limit`, never below `floor`.
    fn sub(self, us: u64, frac: u64, limit: u64, floor: Fine) -> Fine {
        let (borrow, f) = if self.frac >= frac {
            (0, self.frac - frac)
        } else {
            (1, self.frac + limit - frac)
        };
        match self.us.checked_sub(us + borrow) {
            Some(u) => Fine { us: u, frac: f }.max(floor),
            None => floor,
        }
    }
}

/// `hits` emission intervals of `period / limit`: (whole µs, remainder in 1/limit µs).
fn intervals(hits: u64, period: u64, limit: u64) -> (u64, u64) {
    let (q, r) = (period / limit, period % limit);
    // Config validation keeps (burst + 1) * r below 2^53, and callers pass hits <= burst + 1.
    let rh = r.saturating_mul(hits);
    (
        q.saturating_mul(hits).saturating_add(rh / limit),
        rh % limit,
    )
}

/// token_bucket: GCRA as in redis-cell. Emission interval `T = period / limit`, tolerance
/// `tau = T * (burst + 1)`, state the theoretical arrival time (TAT). A request of `hits` is
/// admitted when `max(TAT, now) + hits * T <= now + tau`. `T` is kept exact (the TAT carries a
/// remainder in 1/limit µs), so at 600 000/s the bucket refills at 600 000/s, not 1 000 000/s.
/// `remaining` is the whole tokens left, `reset` the time until the bucket is full again, and a
/// denial's `retry_after` the time until the request would conform (both rounded up to µs).
pub fn token_bucket(
    state: Option<&State>,
    now: u64,
    p: LimitParams,
    hits: u64,
    mode: Mode,
) -> (Outcome, State) {
    let now_f = Fine { us: now, frac: 0 };
    let stored = match state {
        Some(State::Bucket { tat, frac }) => Fine {
            us: *tat,
            frac: *frac,
        },
        _ => now_f,
    };
    if p.limit == 0 {
        return empty_bucket(stored, mode);
    }
    let limit = u64::from(p.limit);
    let period = p.period_us;
    let slots = u64::from(p.burst) + 1;
    let (tau_us, tau_f) = intervals(slots, period, limit);
    let horizon = now_f.add(tau_us, tau_f, limit);
    let tat = stored.max(now_f);
    let h = hits.max(1);
    let (allowed, new_tat, candidate) = match mode {
        Mode::Refund => {
            let (c_us, c_f) = intervals(hits.min(slots), period, limit);
            (true, tat.sub(c_us, c_f, limit, now_f), None)
        }
        Mode::Record => {
            let bucket = Bucket {
                tat,
                horizon,
                tau: (tau_us, tau_f),
                slots,
                period,
                limit,
            };
            bucket.record(hits)
        }
        Mode::Charge if h > slots => (false, tat, None),
        Mode::Charge => {
            let (c_us, c_f) = intervals(h, period, limit);
            let candidate = tat.add(c_us, c_f, limit);
            let ok = candidate <= horizon;
            let charged = if hits == 0 { tat } else { candidate };
            (ok, if ok { charged } else { tat }, Some(candidate))
        }
    };
    let ceil_us = |f: Fine| f.us + u64::from(f.frac > 0);
    let ttl = ceil_us(new_tat).saturating_sub(now);
    let retry_after = match (allowed, candidate) {
        (true, _) => 0,
        (false, None) => u64::MAX,
        // The request conforms once `now' + tau >= candidate`.
        (false, Some(c)) => {
            let wait = c.sub(tau_us, tau_f, limit, now_f);
            ceil_us(wait) - now
        }
    };
    // Whole tokens left: (tau - (TAT - now)) / T, in 1/limit µs, as f64 in the script's order.
    let used = (new_tat.us - now) as f64 * limit as f64 + new_tat.frac as f64;
    let room = tau_us as f64 * limit as f64 + tau_f as f64 - used;
    let remaining = (room / period as f64).floor().max(0.0);
    (
        Outcome {
            allowed,
            remaining: clamp_u32(remaining as u64),
            reset: us(ttl),
            retry_after: us(retry_after),
        },
        State::Bucket {
            tat: new_tat.us,
            frac: new_tat.frac,
        },
    )
}

/// A token bucket as one decision sees it.
struct Bucket {
    /// max(stored TAT, now).
    tat: Fine,
    /// now + tau: the latest TAT that still conforms.
    horizon: Fine,
    tau: (u64, u64),
    slots: u64,
    period: u64,
    limit: u64,
}

impl Bucket {
    /// A recorded charge (`Mode::Record`): (allowed, the new TAT, the candidate TAT a retry is
    /// computed from). At most one bucket of debt: a recorded charge beyond that is dropped, so
    /// the key's lifetime stays bounded (two bucket times) whatever a report says.
    fn record(&self, hits: u64) -> (bool, Fine, Option<Fine>) {
        let (tau_us, tau_f) = self.tau;
        let h = hits.max(1);
        let (c_us, c_f) = intervals(h.min(self.slots), self.period, self.limit);
        let candidate = self.tat.add(c_us, c_f, self.limit);
        let (ok, charged) = if hits == 0 {
            (self.tat <= self.horizon, self.tat)
        } else {
            let cap = self.horizon.add(tau_us, tau_f, self.limit);
            let debt = if h > self.slots {
                candidate.add(tau_us, tau_f, self.limit)
            } else {
                candidate
            };
            (h <= self.slots && candidate <= self.horizon, debt.min(cap))
        };
        (ok, charged, (h <= self.slots).then_some(candidate))
    }
}

/// A bucket of zero tokens: every charge is denied for good, a refund changes nothing.
fn empty_bucket(stored: Fine, mode: Mode) -> (Outcome, State) {
    let refund = mode == Mode::Refund;
    let outcome = Outcome {
        allowed: refund,
        remaining: 0,
        reset: Duration::ZERO,
        retry_after: if refund {
            Duration::ZERO
        } else {
            Duration::MAX
        },
    };
    let state = State::Bucket {
        tat: stored.us,
        frac: stored.frac,
    };
    (outcome, state)
}

/// When a stored state stops mattering (microseconds since the epoch): after this the
/// algorithm treats the counter as fresh, so stores may drop it.
pub fn expires_at(state: &State, p: LimitParams) -> u64 {
    match state {
        State::Fixed { window_start, .. } => window_start + p.period_us,
        State::Sliding { window_start, .. } => window_start + 2 * p.period_us,
        State::Log(l) => log_expires_at(l, p),
        State::Bucket { tat, frac } => tat + u64::from(*frac > 0),
        State::Slots(s) => s.expires_at(),
        State::Reserved(r) => r.expires_at(p),
    }
}

/// When a sliding_log's newest charge leaves the period.
pub fn log_expires_at(log: &Log, p: LimitParams) -> u64 {
    log.newest().map_or(0, |t| t + p.period_us)
}

#[cfg(test)]
mod tests;
