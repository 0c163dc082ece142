//! `in_flight`: a limit on requests holding a slot at once, not on a rate. A slot is taken by a
//! request's request-time call (named by its id), freed by its stream-done call, and ends on its
//! own when its lease does, so a proxy that dies mid-request leaks nothing for longer than the
//! lease. The Redis script's `in_flight` branch mirrors this function.
//!
//! The id is the caller's (Envoy copies a client's `x-request-id`): it names what a stream-done
//! call releases and never grants anything. So:
//!
//! - take: a slot is free → allowed, and the id holds one more slot (an id may hold several:
//!   each take needs a free slot of its own; all of one id's slots end together, at its latest
//!   take's lease end); else denied;
//! - a take not charged (denied here, or its request denied by another limit) is remembered as
//!   a denial of its id ([`remember_denial`]) until a lease from now: Envoy makes the
//!   stream-done call of a denied request too, and that call must free no one's slot;
//! - free: consumes the id's remembered denial first, else one past the per-counter cap of
//!   remembered denials (`overflow`), else frees one of the id's slots; a free that finds none
//!   is a no-op. So whatever ids a caller sends and in whatever order the calls arrive, the
//!   slots counted never fall below the admitted requests still in flight (docs/semantics.md
//!   has the argument): a denied request's done call can only ever free a slot after every
//!   denial it could stand for was consumed;
//! - check (a descriptor without the id entry): allowed while a slot is free; takes none.
//!
//! `remaining` is the slots free after the request; `reset` is the lease (a slot taken now is
//! free by then at the latest).

use super::{LimitParams, Outcome};
use std::time::Duration;

/// The slots of one counter and the takes it remembers denied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Slots {
    /// One entry per slot held: (the request id's fingerprint, when its lease ends in µs). An id
    /// may hold several; its entries share one end. At most `max` live ones, plus ended ones
    /// until the next call drops them.
    pub held: Vec<(u64, u64)>,
    /// Takes not charged and not yet matched by a stream-done call: (id, how many, until µs).
    /// At most [`denial_cap`] records; past them, the overflow.
    pub denied: Vec<(u64, u32, u64)>,
    /// Denials past the cap, of any id: (how many, until µs).
    pub overflow: (u32, u64),
}

/// Denial records one counter keeps before it counts denials in its `overflow`: as many as it
/// has slots, and at least 64. (A new record is made while the records, and the overflow if it
/// holds any, number fewer than this: the Redis script's `ZCARD` rule.)
pub fn denial_cap(limit: u32) -> usize {
    limit.max(64) as usize
}

impl Slots {
    /// When the last lease or remembered denial ends (the counter can be dropped after it).
    pub fn expires_at(&self) -> u64 {
        let held = self.held.iter().map(|&(_, e)| e).max().unwrap_or(0);
        let denied = self.denied.iter().map(|&(_, _, u)| u).max().unwrap_or(0);
        held.max(denied).max(self.overflow.1)
    }

    /// Denials remembered and not yet consumed, at `now` (the overflow's included).
    pub fn pending_denials(&self, now: u64) -> u64 {
        let records: u64 = self
            .denied
            .iter()
            .filter(|&&(_, _, u)| u > now)
            .map(|&(_, n, _)| u64::from(n))
            .sum();
        let overflow = if self.overflow.1 > now {
            u64::from(self.overflow.0)
        } else {
            0
        };
        records + overflow
    }

    /// The slots with what ended at `now` dropped.
    fn live(slots: Option<&Slots>, now: u64) -> Slots {
        let Some(s) = slots else {
            return Slots::default();
        };
        Slots {
            held: s.held.iter().copied().filter(|&(_, e)| e > now).collect(),
            denied: s
                .denied
                .iter()
                .copied()
                .filter(|&(_, _, u)| u > now)
                .collect(),
            overflow: if s.overflow.1 > now {
                s.overflow
            } else {
                (0, 0)
            },
        }
    }
}

/// What a request does on an `in_flight` counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lease {
    /// No id: whether a slot is free.
    Check,
    /// The request-time call: take a slot for this id.
    Take(u64),
    /// The stream-done call: free this id's slot.
    Free(u64),
}

/// Decides one request on `slots`; returns the outcome and the slots to store if the request
/// is charged (the live ones, with this request's change). A take that is denied changes
/// nothing here: the store remembers every take denied or not charged by [`remember_denial`]
/// once the request's other checks are written (as the script does), so a free of the same id
/// later in the same request decides on what the store held, on every store.
pub fn in_flight(
    slots: Option<&Slots>,
    now: u64,
    p: LimitParams,
    lease: Lease,
) -> (Outcome, Slots) {
    let mut live = Slots::live(slots, now);
    let max = u64::from(p.limit);
    let n = live.held.len() as u64;
    let reset = Duration::from_micros(p.period_us);
    let ok = |remaining: u64| Outcome {
        allowed: true,
        remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
        reset,
        retry_after: Duration::ZERO,
    };
    let outcome = match lease {
        Lease::Check if n < max => ok(max - n),
        Lease::Take(id) if n < max => {
            let ends = now.saturating_add(p.period_us);
            for e in live.held.iter_mut().filter(|(h, _)| *h == id) {
                e.1 = ends;
            }
            live.held.push((id, ends));
            ok(max - n - 1)
        }
        Lease::Check | Lease::Take(_) => {
            let first = live.held.iter().map(|&(_, e)| e).min();
            Outcome {
                allowed: false,
                remaining: 0,
                reset,
                retry_after: match first {
                    Some(e) => Duration::from_micros(e - now),
                    None => Duration::MAX, // max 0 is refused at load; never reached
                },
            }
        }
        Lease::Free(id) => {
            if let Some(i) = live.denied.iter().position(|&(d, _, _)| d == id) {
                live.denied[i].1 -= 1;
                if live.denied[i].1 == 0 {
                    live.denied.remove(i);
                }
            } else if live.overflow.0 > 0 {
                live.overflow.0 -= 1;
                if live.overflow.0 == 0 {
                    live.overflow = (0, 0);
                }
            } else if let Some(i) = live.held.iter().position(|&(h, _)| h == id) {
                live.held.remove(i);
            }
            ok(max.saturating_sub(live.held.len() as u64))
        }
    };
    (outcome, live)
}

/// The slots with a take of `id` that was not charged remembered as a denial (until a lease
/// from now): its stream-done call will consume it instead of freeing a slot.
///
/// `room`: whether the store has room for a new record; without, the denial goes to the
/// overflow (which any id's stream-done call consumes before a slot: never a bypass).
pub fn remember_denial(
    slots: Option<&Slots>,
    now: u64,
    p: LimitParams,
    id: u64,
    room: bool,
) -> Slots {
    let mut live = Slots::live(slots, now);
    remember(&mut live, now, p, id, room);
    live
}

fn remember(live: &mut Slots, now: u64, p: LimitParams, id: u64, room: bool) {
    let until = now.saturating_add(p.period_us);
    if let Some(r) = live.denied.iter_mut().find(|(d, _, _)| *d == id) {
        r.1 = r.1.saturating_add(1);
        r.2 = until;
    } else if room && live.denied.len() + usize::from(live.overflow.0 > 0) < denial_cap(p.limit) {
        live.denied.push((id, 1, until));
    } else {
        live.overflow = (live.overflow.0.saturating_add(1), until);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Algorithm;

    const P: LimitParams = LimitParams {
        limit: 2,
        period_us: 5_000_000,
        algorithm: Algorithm::InFlight,
        burst: 0,
        window_start: None,
    };

    #[test]
    fn every_take_needs_a_slot_of_its_own_and_slots_end_with_their_lease() {
        let (o, s) = in_flight(None, 0, P, Lease::Take(1));
        assert!(o.allowed && o.remaining == 1);
        // The same id again needs a free slot of its own.
        let (o, s) = in_flight(Some(&s), 1, P, Lease::Take(1));
        assert!(o.allowed && o.remaining == 0 && s.held.len() == 2);
        assert!(
            s.held.iter().all(|&(_, e)| e == 1 + 5_000_000),
            "one id, one end"
        );
        let (o, s2) = in_flight(Some(&s), 3, P, Lease::Take(1));
        assert!(!o.allowed, "a held id takes nothing without a free slot");
        assert_eq!(o.retry_after, Duration::from_micros(5_000_001 - 3));
        assert_eq!(s2.held, s.held, "a denial takes no slot");
        assert_eq!(
            s2.pending_denials(3),
            0,
            "...and is remembered by the store, not by the decision"
        );
        assert!(!in_flight(Some(&s), 3, P, Lease::Check).0.allowed);
        // A free of an id without a slot is a no-op; of one with a slot frees one.
        let (o, s) = in_flight(Some(&s), 4, P, Lease::Free(9));
        assert!(o.allowed && o.remaining == 0 && s.held.len() == 2);
        let (o, s) = in_flight(Some(&s), 4, P, Lease::Free(1));
        assert!(o.allowed && o.remaining == 1);
        assert!(in_flight(Some(&s), 5, P, Lease::Take(3)).0.allowed);
        // Id 1's lease ends at 5 s + 1 µs: then its slot is free without a done.
        let (o, s) = in_flight(Some(&s), 5_000_001, P, Lease::Check);
        assert!(o.allowed && o.remaining == 2 && s.held.is_empty());
    }

    #[test]
    fn a_denied_takes_done_call_frees_no_one() {
        // Two slots held by id 1; two more takes of id 1 denied (remembered).
        let (_, s) = in_flight(None, 0, P, Lease::Take(1));
        let (_, s) = in_flight(Some(&s), 0, P, Lease::Take(1));
        let (o, s) = in_flight(Some(&s), 1, P, Lease::Take(1));
        assert!(!o.allowed);
        let s = remember_denial(Some(&s), 1, P, 1, true); // the store remembers it
        let s = remember_denial(Some(&s), 1, P, 1, true); // a request denied by another limit
        assert_eq!(s.pending_denials(1), 2);
        // Their done calls (in any order with the others') free nothing.
        let (_, s) = in_flight(Some(&s), 2, P, Lease::Free(1));
        let (_, s) = in_flight(Some(&s), 2, P, Lease::Free(1));
        assert_eq!(
            s.held.len(),
            2,
            "both admitted requests still hold their slots"
        );
        let (_, s) = in_flight(Some(&s), 3, P, Lease::Free(1));
        assert_eq!(s.held.len(), 1);
    }

    #[test]
    fn denials_past_the_cap_overflow_and_are_consumed_first() {
        let p = LimitParams { limit: 1, ..P };
        let (_, mut s) = in_flight(None, 0, p, Lease::Take(7));
        for id in 100..100 + denial_cap(1) as u64 + 5 {
            s = remember_denial(Some(&s), 1, p, id, true);
        }
        assert_eq!(s.denied.len(), denial_cap(1), "records up to the cap...");
        assert_eq!(s.overflow.0, 5, "...then the overflow");
        // Id 7's own done call meets the overflow first: its slot stays held (conservative).
        let (_, s) = in_flight(Some(&s), 2, p, Lease::Free(7));
        assert_eq!(s.held.len(), 1);
        assert_eq!(s.overflow.0, 4);
        // Everything remembered ends with its lease.
        let (o, s) = in_flight(Some(&s), 5_000_002, p, Lease::Check);
        assert!(o.allowed && s.pending_denials(5_000_002) == 0 && s.held.is_empty());
    }
}
