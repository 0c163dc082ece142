//! What a call did to the entries a lease limit keeps (`in_flight` slots, reservations), as the
//! store that holds them saw it. A verdict alone cannot say it: an admitted take may be a retry
//! of an id that already holds its slot, a free may find nothing to free, and ended leases are
//! dropped by whichever call comes next. The lease metrics (`telemetry::leases`) are built from
//! these, so they need no scan of the store and no per-key series.
//!
//! Times are what the lease had LEFT when the store decided, not instants: the store's clock
//! (Redis `TIME`) and the replica's need not agree, while a duration means the same on both.

use super::LimitCheck;
use crate::algorithm::State;
use crate::config::Algorithm;

/// One check's effect on its counter's lease entries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseEffect {
    /// What the charged call changed.
    pub change: LeaseChange,
    /// Entries whose lease had ended that the call dropped (each is counted once, by the call
    /// that drops it; a counter never used again drops its last ones with its key, uncounted).
    pub expired: u32,
}

/// The entry a charged lease call added or removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LeaseChange {
    /// Nothing (a retry, a denial, a check, a call not charged).
    #[default]
    None,
    /// A slot taken or a reservation made, with its lease (µs).
    Added { left_us: u64 },
    /// A slot freed or a reservation settled before its lease ended, with what it had left (µs).
    Released { left_us: u64 },
    /// A free that found no slot, a settle that found no reservation (never made, or its lease
    /// had ended).
    Unmatched,
}

impl LeaseEffect {
    /// From decide.lua's two values per limit of a lease request: `code + 4 * expired` (code 0
    /// none, 1 added, 2 released, 3 unmatched) and the lease µs left.
    pub(crate) fn from_script(effect: i64, left_us: i64) -> Self {
        let (effect, left_us) = (effect.max(0), u64::try_from(left_us).unwrap_or(0));
        let change = match effect % 4 {
            1 => LeaseChange::Added { left_us },
            2 => LeaseChange::Released { left_us },
            3 => LeaseChange::Unmatched,
            _ => LeaseChange::None,
        };
        let expired = u32::try_from(effect / 4).unwrap_or(u32::MAX);
        Self { change, expired }
    }

    /// Folds a later call's effect on the same check in (a Cluster slot decided dry, then
    /// committed): both calls' drops count, the later change stands.
    pub(crate) fn merge(&mut self, later: Self) {
        self.expired = self.expired.saturating_add(later.expired);
        if later.change != LeaseChange::None {
            self.change = later.change;
        }
    }

    /// The effect of writing `new` over `old` (the memory store) for a check that, if it is a
    /// stream-done call, releases the entry `release` (its id's fingerprint). One pass over
    /// each state and no allocation, however many entries a counter holds: a call adds or
    /// releases at most one entry, an added one is pushed last, and ended ones only ever go.
    pub(crate) fn between(
        old: Option<&State>,
        new: &State,
        now: u64,
        release: Option<u64>,
    ) -> Self {
        let (old_live, old_ended) = census(old, now);
        let (new_live, new_ended) = census(Some(new), now);
        let change = if new_live > old_live {
            let end = last_end(new).unwrap_or(now);
            LeaseChange::Added {
                left_us: end.saturating_sub(now),
            }
        } else if new_live < old_live {
            let end = release.and_then(|id| end_of(old, id, now)).unwrap_or(now);
            LeaseChange::Released {
                left_us: end.saturating_sub(now),
            }
        } else if release.is_some() && pending_denials(Some(new), now) < pending_denials(old, now) {
            // A stream-done call that consumed a remembered denial (of its own request, or one
            // past the cap): nothing was released, and nothing was missing.
            LeaseChange::None
        } else if release.is_some() {
            LeaseChange::Unmatched
        } else {
            LeaseChange::None
        };
        Self {
            change,
            expired: u32::try_from(old_ended.saturating_sub(new_ended)).unwrap_or(u32::MAX),
        }
    }

    /// One empty effect per check if the request has a lease limit, else none (no allocation).
    pub(crate) fn per_check(checks: &[LimitCheck]) -> Vec<Self> {
        let leased = checks
            .iter()
            .any(|c| c.lease.is_some() || c.key.limit.algorithm == Algorithm::InFlight);
        if leased {
            vec![Self::default(); checks.len()]
        } else {
            Vec::new()
        }
    }

    /// Whether there is anything to count.
    pub fn is_empty(&self) -> bool {
        self.change == LeaseChange::None && self.expired == 0
    }
}

/// The (id, lease end) of every entry a state keeps.
fn entries(state: Option<&State>) -> impl Iterator<Item = (u64, u64)> + '_ {
    let (slots, reservations) = match state {
        Some(State::Slots(s)) => (s.held.as_slice(), &[][..]),
        Some(State::Reserved(r)) => (&[][..], r.held.as_slice()),
        _ => (&[][..], &[][..]),
    };
    slots
        .iter()
        .copied()
        .chain(reservations.iter().map(|r| (r.id, r.ends)))
}

/// Denials an `in_flight` counter remembers, at `now`.
fn pending_denials(state: Option<&State>, now: u64) -> u64 {
    match state {
        Some(State::Slots(s)) => s.pending_denials(now),
        _ => 0,
    }
}

/// How many entries are live and how many ended, at `now`.
fn census(state: Option<&State>, now: u64) -> (usize, usize) {
    entries(state).fold((0, 0), |(live, ended), (_, end)| {
        if end > now {
            (live + 1, ended)
        } else {
            (live, ended + 1)
        }
    })
}

fn last_end(state: &State) -> Option<u64> {
    entries(Some(state)).last().map(|(_, end)| end)
}

/// When the live entry of `id` ends.
/// (A reservation: the one a settle releases, the id's smallest; an id's slots share one end.)
fn end_of(state: Option<&State>, id: u64, now: u64) -> Option<u64> {
    if let Some(State::Reserved(r)) = state {
        return r
            .held
            .iter()
            .filter(|r| r.id == id && r.ends > now)
            .min_by_key(|r| r.hits)
            .map(|r| r.ends);
    }
    entries(state)
        .find(|&(i, end)| i == id && end > now)
        .map(|(_, end)| end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Slots;

    fn slots(held: &[(u64, u64)]) -> State {
        State::Slots(Box::new(Slots {
            held: held.to_vec(),
            ..Slots::default()
        }))
    }

    #[test]
    fn the_memory_diff_tells_a_take_from_a_retry_and_counts_ended_leases() {
        let old = slots(&[(1, 50), (2, 500)]);
        // Id 1's lease ended at 50; id 3 takes a slot until 1100.
        let e = LeaseEffect::between(Some(&old), &slots(&[(2, 500), (3, 1100)]), 100, None);
        assert_eq!(e.change, LeaseChange::Added { left_us: 1000 });
        assert_eq!(e.expired, 1);
        // A retry of id 2: nothing added.
        let e = LeaseEffect::between(Some(&old), &slots(&[(2, 500)]), 100, None);
        assert_eq!(e.change, LeaseChange::None);
        // A free of id 2 with 400 µs left; a free of an id without a slot.
        let e = LeaseEffect::between(Some(&old), &slots(&[]), 100, Some(2));
        assert_eq!(e.change, LeaseChange::Released { left_us: 400 });
        let e = LeaseEffect::between(Some(&slots(&[])), &slots(&[]), 100, Some(7));
        assert_eq!(e.change, LeaseChange::Unmatched);
    }

    #[test]
    fn the_script_values_decode_and_a_commit_folds_into_its_dry_call() {
        let mut e = LeaseEffect::from_script(4 * 7, 0);
        assert_eq!((e.change, e.expired), (LeaseChange::None, 7));
        e.merge(LeaseEffect::from_script(1 + 4 * 2, 5_000_000));
        assert_eq!(e.change, LeaseChange::Added { left_us: 5_000_000 });
        assert_eq!(e.expired, 9);
        assert_eq!(
            LeaseEffect::from_script(3, 0).change,
            LeaseChange::Unmatched
        );
        assert_eq!(LeaseEffect::from_script(-1, -1), LeaseEffect::default());
    }
}
