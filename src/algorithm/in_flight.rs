//! `in_flight`: a limit on requests holding a slot at once, not on a rate. A slot is taken by a
//! request's request-time call (named by its id), freed by its stream-done call, and ends on its
//! own when its lease does, so a proxy that dies mid-request leaks nothing for longer than the
//! lease. The Redis script's `in_flight` branch mirrors this function.
//!
//! - take: the id already holds a slot → allowed, nothing changes (a retry takes one slot);
//!   a slot is free → allowed, the id holds it until `now + lease`; else denied, and the denial
//!   retries when the first slot's lease ends;
//! - free: allowed; the id's slot, if it holds one, is freed (a free without one is a no-op);
//! - check (a descriptor without the id entry): allowed while a slot is free; takes none.
//!
//! `remaining` is the slots free after the request; `reset` is the lease (a slot taken now is
//! free by then at the latest).

use super::{LimitParams, Outcome};
use std::time::Duration;

/// The slots of one counter: (the request id's fingerprint, when its lease ends in µs). At most
/// the limit's `max` entries that are live, plus expired ones until the next call drops them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Slots {
    pub held: Vec<(u64, u64)>,
}

impl Slots {
    /// When the last lease ends (the counter can be dropped after it).
    pub fn expires_at(&self) -> u64 {
        self.held.iter().map(|&(_, e)| e).max().unwrap_or(0)
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
/// is charged (the live ones, with this request's change).
pub fn in_flight(
    slots: Option<&Slots>,
    now: u64,
    p: LimitParams,
    lease: Lease,
) -> (Outcome, Slots) {
    let mut live = Slots {
        held: slots
            .map(|s| s.held.iter().copied().filter(|&(_, e)| e > now).collect())
            .unwrap_or_default(),
    };
    let max = u64::from(p.limit);
    let n = live.held.len() as u64;
    let holds = |id: u64| live.held.iter().position(|&(h, _)| h == id);
    let reset = Duration::from_micros(p.period_us);
    let ok = |remaining: u64| Outcome {
        allowed: true,
        remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
        reset,
        retry_after: Duration::ZERO,
    };
    let outcome = match lease {
        Lease::Check if n < max => ok(max - n),
        Lease::Take(id) if holds(id).is_some() => ok(max.saturating_sub(n)),
        Lease::Take(id) if n < max => {
            live.held.push((id, now.saturating_add(p.period_us)));
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
            if let Some(i) = holds(id) {
                live.held.swap_remove(i);
            }
            ok(max.saturating_sub(live.held.len() as u64))
        }
    };
    (outcome, live)
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
    };

    #[test]
    fn slots_are_taken_once_per_id_freed_and_end_with_their_lease() {
        let (o, s) = in_flight(None, 0, P, Lease::Take(1));
        assert!(o.allowed && o.remaining == 1);
        // The same id again holds its one slot.
        let (o, s) = in_flight(Some(&s), 1, P, Lease::Take(1));
        assert!(o.allowed && o.remaining == 1 && s.held.len() == 1);
        let (o, s) = in_flight(Some(&s), 2, P, Lease::Take(2));
        assert!(o.allowed && o.remaining == 0);
        let (o, s2) = in_flight(Some(&s), 3, P, Lease::Take(3));
        assert!(!o.allowed);
        assert_eq!(o.retry_after, Duration::from_micros(5_000_000 - 3));
        assert_eq!(s2, s, "a denial changes nothing");
        assert!(!in_flight(Some(&s), 3, P, Lease::Check).0.allowed);
        // A free of an id without a slot is a no-op; of one with a slot frees it.
        let (o, s) = in_flight(Some(&s), 4, P, Lease::Free(9));
        assert!(o.allowed && o.remaining == 0 && s.held.len() == 2);
        let (o, s) = in_flight(Some(&s), 4, P, Lease::Free(1));
        assert!(o.allowed && o.remaining == 1);
        assert!(in_flight(Some(&s), 5, P, Lease::Take(3)).0.allowed);
        // Id 2's lease ends at 5 s + 2 µs: then its slot is free without a done.
        let (o, s) = in_flight(Some(&s), 5_000_002, P, Lease::Check);
        assert!(o.allowed && o.remaining == 2 && s.held.is_empty());
    }
}
