//! One check on a stored state: the algorithm's math, with the request a slot or a
//! reservation is kept for (its id as a keyed fingerprint).

use crate::algorithm::{self, Lease, Outcome, Settle, State};
use crate::config::Algorithm;
use crate::store::LimitCheck;
use std::hash::BuildHasher;

/// One check on a stored state: its algorithm's math, with the request id for an `in_flight`
/// slot or a reservation.
pub(super) fn decide_check(
    state: Option<&State>,
    now: u64,
    check: &LimitCheck,
) -> (Outcome, State) {
    let p = check.params();
    match &check.lease {
        Some(l) if p.algorithm != Algorithm::InFlight => match l.terms() {
            Some(terms) => {
                let id = fingerprint(&l.id);
                let op = if l.release {
                    Settle::Settle(id)
                } else {
                    Settle::Reserve(id)
                };
                algorithm::reserve(state, now, p, check.hits, op, terms)
            }
            None => algorithm::decide(state, now, p, check.hits, check.mode()),
        },
        Some(l) => {
            let slots = match state {
                Some(State::Slots(s)) => Some(&**s),
                _ => None,
            };
            let id = fingerprint(&l.id);
            let op = if l.release {
                Lease::Free(id)
            } else {
                Lease::Take(id)
            };
            let (o, s) = algorithm::in_flight(slots, now, p, op);
            (o, State::Slots(Box::new(s)))
        }
        _ => algorithm::decide(state, now, p, check.hits, check.mode()),
    }
}

/// Ids kept as keyed fingerprints (random per process): a few bytes an entry whatever the id's
/// length, and no id a client picks collides with another on purpose.
fn fingerprint(id: &str) -> u64 {
    static IDS: std::sync::OnceLock<std::hash::RandomState> = std::sync::OnceLock::new();
    IDS.get_or_init(Default::default).hash_one(id)
}

/// The fingerprint of the entry a stream-done call releases.
pub(super) fn released(check: &LimitCheck) -> Option<u64> {
    check
        .lease
        .as_ref()
        .filter(|l| l.release)
        .map(|l| fingerprint(&l.id))
}

/// The fingerprint of the id an `in_flight` take names (its request-time call), if `check` is
/// one: a take that is not charged is remembered as a denial of that id.
pub(super) fn take_of(check: &LimitCheck) -> Option<u64> {
    check
        .lease
        .as_ref()
        .filter(|l| !l.release && check.key.limit.algorithm == Algorithm::InFlight)
        .map(|l| fingerprint(&l.id))
}

/// `state` with a take of `id` that was not charged remembered as a denial.
pub(super) fn remember_denial(
    state: Option<&State>,
    now: u64,
    check: &LimitCheck,
    id: u64,
    room: bool,
) -> State {
    let slots = match state {
        Some(State::Slots(s)) => Some(&**s),
        _ => None,
    };
    State::Slots(Box::new(algorithm::remember_denial(
        slots,
        now,
        check.params(),
        id,
        room,
    )))
}

/// Review A9: whether a check's new lease entries fit the shard's budget. A take or a
/// reservation that would add entries past it is denied instead (`outcome` says so, retry after
/// a lease): the store's memory stays bounded whatever ids and counters callers choose. `was`:
/// the entries of the state the check decided on.
pub(super) fn within_budget(
    shard: &super::shard::Shard,
    was: usize,
    next: &State,
    check: &LimitCheck,
    outcome: &mut Outcome,
) -> bool {
    let Some(lease) = check.lease.as_ref().filter(|l| !l.release) else {
        return true;
    };
    let more = super::shard::lease_entries(next).saturating_sub(was);
    if !outcome.allowed || more == 0 || shard.has_room(more) {
        return true;
    }
    let lease_us = lease
        .terms()
        .map_or(check.params().period_us, |t| t.lease_us);
    outcome.allowed = false;
    outcome.remaining = 0;
    outcome.retry_after = std::time::Duration::from_micros(lease_us);
    false
}
