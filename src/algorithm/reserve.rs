//! `reservations` on a rate limit: a request's hits are charged when it starts (its estimate,
//! admitted only if it fits) and settled when it ends (the actual replaces the estimate), so
//! concurrent requests cannot overshoot a budget whose cost is known only at the end. The
//! Redis script's `reserve` branch mirrors this function.
//!
//! - reserve: `max` reservations held → denied (retry when a lease could have ended); else the
//!   estimate is charged like any request (denied if it does not fit) and kept with the id
//!   until `now + lease`. The id is the caller's and grants nothing: a reserve with an id that
//!   already holds a reservation reserves again (its own estimate, its own entry);
//! - settle: never denied. It settles the id's smallest live reservation (the oldest of equals):
//!   several requests may share an id and sluice cannot tell which ended, so it releases the one
//!   that can give back least, and the reservations counted never fall below the estimates of
//!   the admitted requests still running. With a reservation, the difference is applied: more than the estimate
//!   records the excess, less gives the rest back, but only while the window that took the
//!   estimate is still the counter's (a give-back into a later window would hand out quota it
//!   never took). On a sliding_log the give-back shrinks the reservation's own log entry (kept
//!   in [`Reservation::entry`]), not the newest ones. Without a reservation (never made, or its
//!   lease ended) the hits are recorded;
//! - a reservation whose settle never comes stays charged at its estimate: the request may have
//!   run, and usage is never lost. Its entry goes when its lease ends.
//!
//! The counter's own state is the algorithm's, unchanged; the reservations ride beside it
//! ([`Reserved`]), so a request on the same limit without an id shares the counter.

use super::{decide, LimitParams, Mode, Outcome, State, LOG_GIVE_BACK_ENTRIES};
use std::sync::Arc;
use std::time::Duration;

/// One outstanding reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    /// The request id's fingerprint.
    pub id: u64,
    /// The hits reserved (the estimate).
    pub hits: u64,
    /// Until when a settle may give hits back (µs): the end of the window that took them.
    pub until: u64,
    /// When the lease ends (µs).
    pub ends: u64,
    /// On a sliding_log, the id of the log entry the estimate made (0: none): a settle gives
    /// back on that entry, not on the newest ones, so hits other requests charged since keep
    /// counting for their whole period.
    pub entry: u64,
}

/// A counter with reservations: the algorithm's state and the reservations held.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reserved {
    pub inner: Option<State>,
    /// Shared: a request without an id on the counter keeps the list without copying it.
    pub held: Arc<Vec<Reservation>>,
}

/// What a request does on a counter with reservations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// The request-time call: reserve the hits for this id.
    Reserve(u64),
    /// The stream-done call: settle this id's reservation at the hits.
    Settle(u64),
}

/// The terms of a limit's reservations: the lease (µs) and how many one counter holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Terms {
    pub lease_us: u64,
    pub max: u32,
}

/// Until when a charge made now on `state` (the state after it) can be given back: the end of
/// its window (fixed and sliding window), a period after now (sliding_log), the lease's end
/// (token_bucket, whose refund is bounded by the clock itself).
fn give_back_until(state: &State, now: u64, p: LimitParams, ends: u64) -> u64 {
    match state {
        State::Fixed { window_start, .. } | State::Sliding { window_start, .. } => {
            window_start.saturating_add(p.period_us)
        }
        State::Log(_) => now.saturating_add(p.period_us),
        _ => ends,
    }
}

/// Decides one reserve or settle of `hits` on `state` (a [`State::Reserved`], the algorithm's
/// own state, or none); returns the outcome and the state to store if the request is charged.
pub fn reserve(
    state: Option<&State>,
    now: u64,
    p: LimitParams,
    hits: u64,
    op: Settle,
    terms: Terms,
) -> (Outcome, State) {
    let (inner, held) = match state {
        Some(State::Reserved(r)) => (r.inner.as_ref(), r.held.as_slice()),
        other => (other, &[][..]),
    };
    let mut live: Vec<Reservation> = held.iter().copied().filter(|r| r.ends > now).collect();
    match op {
        Settle::Reserve(id) => {
            if live.len() >= terms.max as usize {
                let (mut o, _) = as_is(inner, now, p);
                o.allowed = false;
                o.retry_after = Duration::from_micros(terms.lease_us);
                return (o, wrap_or_keep(inner, live));
            }
            let (o, s) = decide(inner, now, p, hits, Mode::Charge);
            if !o.allowed {
                return (o, wrap_or_keep(inner, live));
            }
            let ends = now.saturating_add(terms.lease_us);
            let entry = match &s {
                State::Log(log) if hits > 0 => log.newest_id(),
                _ => 0,
            };
            live.push(Reservation {
                id,
                hits,
                until: give_back_until(&s, now, p, ends),
                ends,
                entry,
            });
            (o, wrap(s, live))
        }
        Settle::Settle(id) => {
            let released = holding(&live, id).map(|i| live.remove(i));
            let (o, s) = settle(inner, now, p, hits, released);
            (o, wrap(s, live))
        }
    }
}

/// A settle of `hits` for the reservation it `released` (none: never made, or its lease
/// ended): the excess over the estimate recorded, or the rest given back while the window that
/// took the estimate is still the counter's.
fn settle(
    inner: Option<&State>,
    now: u64,
    p: LimitParams,
    hits: u64,
    released: Option<Reservation>,
) -> (Outcome, State) {
    let (reserved, until, entry) = released.map_or((0, 0, 0), |r| (r.hits, r.until, r.entry));
    if hits > reserved {
        let (mut o, s) = decide(inner, now, p, hits - reserved, Mode::Record);
        o.allowed = true;
        o.retry_after = Duration::ZERO;
        (o, s)
    } else if hits < reserved && now < until {
        match inner {
            Some(State::Log(log)) if entry != 0 => {
                // The reservation's own entry, as decide.lua's `log_give_back`.
                let mut log = log.clone();
                log.trim(now.saturating_sub(p.period_us));
                log.give_back(entry, reserved - hits, LOG_GIVE_BACK_ENTRIES);
                as_is(Some(&State::Log(log)), now, p)
            }
            _ => decide(inner, now, p, reserved - hits, Mode::Refund),
        }
    } else {
        as_is(inner, now, p)
    }
}

/// The reservation a settle of `id` releases: the id's smallest (the oldest of those). The id is
/// the caller's and several requests may share it; whichever of them ended, releasing the
/// smallest leaves at least the estimates of those still running reserved.
fn holding(live: &[Reservation], id: u64) -> Option<usize> {
    live.iter()
        .enumerate()
        .filter(|(_, r)| r.id == id)
        .min_by_key(|&(i, r)| (r.hits, i))
        .map(|(i, _)| i)
}

/// What the counter says as it stands: what a request that changes nothing reports.
fn as_is(inner: Option<&State>, now: u64, p: LimitParams) -> (Outcome, State) {
    let (mut o, s) = decide(inner, now, p, 0, Mode::Charge);
    o.allowed = true;
    o.retry_after = Duration::ZERO;
    (o, s)
}

fn wrap(inner: State, held: Vec<Reservation>) -> State {
    State::Reserved(Box::new(Reserved {
        inner: Some(inner),
        held: Arc::new(held),
    }))
}

/// The state with `live` reservations and the counter unchanged.
fn wrap_or_keep(inner: Option<&State>, live: Vec<Reservation>) -> State {
    State::Reserved(Box::new(Reserved {
        inner: inner.cloned(),
        held: Arc::new(live),
    }))
}

impl Reserved {
    /// When the state stops mattering: the counter's own expiry or the last lease's end.
    pub fn expires_at(&self, p: LimitParams) -> u64 {
        let inner = self.inner.as_ref().map_or(0, |s| super::expires_at(s, p));
        let last = self.held.iter().map(|r| r.ends).max().unwrap_or(0);
        inner.max(last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Algorithm;

    const HOUR: u64 = 3_600_000_000;
    const P: LimitParams = LimitParams {
        limit: 1000,
        period_us: HOUR,
        algorithm: Algorithm::FixedWindow,
        burst: 0,
        window_start: None,
    };
    const T: Terms = Terms {
        lease_us: 300_000_000,
        max: 3,
    };

    fn used(s: &State) -> u64 {
        match s {
            State::Reserved(r) => match r.inner {
                Some(State::Fixed { count, .. }) => count,
                _ => 0,
            },
            _ => unreachable!(),
        }
    }

    #[test]
    fn reserve_then_settle_charges_the_actual() {
        // Budget 1000, estimate 400: two fit, the third does not (the acceptance 3).
        let (o, s) = reserve(None, 1, P, 400, Settle::Reserve(1), T);
        assert!(o.allowed && o.remaining == 600);
        let (o, s) = reserve(Some(&s), 2, P, 400, Settle::Reserve(2), T);
        assert!(o.allowed && o.remaining == 200);
        let (o, s2) = reserve(Some(&s), 3, P, 400, Settle::Reserve(3), T);
        assert!(!o.allowed);
        assert_eq!(s2, s, "a denied reservation changes nothing");
        // The same id again reserves again: no id buys anything.
        let (o, _) = reserve(Some(&s), 3, P, 400, Settle::Reserve(2), T);
        assert!(!o.allowed, "a held id needs room of its own");
        assert!(
            reserve(Some(&s), 3, P, 200, Settle::Reserve(2), T)
                .0
                .allowed
        );
        // Settles at 250 give 150 back each.
        let (o, s) = reserve(Some(&s), 4, P, 250, Settle::Settle(1), T);
        assert!(o.allowed && used(&s) == 650);
        let (_, s) = reserve(Some(&s), 5, P, 250, Settle::Settle(2), T);
        assert_eq!(used(&s), 500);
        // 500 + 400 fits; 750 + 400 does not; 750 + 200 does.
        let (o, s) = reserve(Some(&s), 6, P, 400, Settle::Reserve(4), T);
        assert!(o.allowed);
        let (_, s) = reserve(Some(&s), 7, P, 250, Settle::Settle(4), T);
        assert!(
            !reserve(Some(&s), 8, P, 400, Settle::Reserve(5), T)
                .0
                .allowed
        );
        assert!(
            reserve(Some(&s), 8, P, 200, Settle::Reserve(5), T)
                .0
                .allowed
        );
    }

    #[test]
    fn settles_above_the_estimate_without_a_reservation_and_after_the_window() {
        let (_, s) = reserve(None, 1, P, 100, Settle::Reserve(1), T);
        // More than the estimate charges the difference, even past the limit (never denied).
        let (o, s) = reserve(Some(&s), 2, P, 1500, Settle::Settle(1), T);
        assert!(o.allowed && o.remaining == 0 && used(&s) == 1500);
        // A settle without a reservation records its hits.
        let (_, s) = reserve(Some(&s), 3, P, 7, Settle::Settle(9), T);
        assert_eq!(used(&s), 1507);
        // A reservation settled in the next window gives nothing back into it.
        let (_, s) = reserve(None, HOUR - 10, P, 400, Settle::Reserve(1), T);
        let (_, s) = reserve(Some(&s), HOUR + 5, P, 100, Settle::Settle(1), T);
        assert_eq!(
            used(&s),
            0,
            "the new window keeps its full quota, no give-back"
        );
        // ...but an excess over the estimate is charged to the window it ends in.
        let (_, s) = reserve(None, HOUR - 10, P, 400, Settle::Reserve(1), T);
        let (_, s) = reserve(Some(&s), HOUR + 5, P, 450, Settle::Settle(1), T);
        assert_eq!(used(&s), 50);
    }

    #[test]
    fn an_unsettled_reservation_stays_charged_and_the_cap_bounds_the_entries() {
        let (_, s) = reserve(None, 1, P, 10, Settle::Reserve(1), T);
        let (_, s) = reserve(Some(&s), 2, P, 10, Settle::Reserve(2), T);
        let (_, s) = reserve(Some(&s), 3, P, 10, Settle::Reserve(3), T);
        let (o, _) = reserve(Some(&s), 4, P, 10, Settle::Reserve(4), T);
        assert!(!o.allowed, "max 3 reservations held");
        assert_eq!(o.retry_after, Duration::from_micros(T.lease_us));
        // After the lease the entries are gone and their estimates stay charged.
        let later = 3 + T.lease_us;
        let (o, s) = reserve(Some(&s), later, P, 10, Settle::Reserve(4), T);
        assert!(o.allowed && used(&s) == 40);
        let State::Reserved(r) = &s else {
            unreachable!()
        };
        assert_eq!(r.held.len(), 1);
        // A settle after the lease finds no reservation: it records its hits.
        let (_, s) = reserve(Some(&s), later + 1, P, 5, Settle::Settle(1), T);
        assert_eq!(used(&s), 45);
    }
}
