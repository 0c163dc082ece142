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

    /// The effect of writing `new` over `old` (the memory store), for a check that `release`s
    /// or not: entries are told apart by id, so a retry changes nothing.
    pub(crate) fn between(old: Option<&State>, new: &State, now: u64, release: bool) -> Self {
        let before = entries(old);
        let after = entries(Some(new));
        // Ended entries the new state no longer keeps (one a plain charge carries over is
        // not dropped yet).
        let expired = before
            .iter()
            .filter(|&&(id, end)| end <= now && !after.contains(&(id, end)))
            .count();
        let live = || before.iter().filter(|&&(_, end)| end > now);
        let added = after
            .iter()
            .find(|&&(id, _)| !live().any(|&(i, _)| i == id));
        let removed = live().find(|&&(id, _)| !after.iter().any(|&(i, _)| i == id));
        let change = match (added, removed) {
            (Some(&(_, end)), _) => LeaseChange::Added {
                left_us: end.saturating_sub(now),
            },
            (None, Some(&(_, end))) => LeaseChange::Released {
                left_us: end.saturating_sub(now),
            },
            (None, None) if release => LeaseChange::Unmatched,
            (None, None) => LeaseChange::None,
        };
        Self {
            change,
            expired: u32::try_from(expired).unwrap_or(u32::MAX),
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

    /// Whether the check is a stream-done call (a free, a settle).
    pub(crate) fn releases(check: &LimitCheck) -> bool {
        check.lease.as_ref().is_some_and(|l| l.release)
    }

    /// Whether there is anything to count.
    pub fn is_empty(&self) -> bool {
        self.change == LeaseChange::None && self.expired == 0
    }
}

/// The (id, lease end) of every entry a state keeps.
fn entries(state: Option<&State>) -> Vec<(u64, u64)> {
    match state {
        Some(State::Slots(s)) => s.held.clone(),
        Some(State::Reserved(r)) => r.held.iter().map(|r| (r.id, r.ends)).collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Slots;

    fn slots(held: &[(u64, u64)]) -> State {
        State::Slots(Box::new(Slots {
            held: held.to_vec(),
        }))
    }

    #[test]
    fn the_memory_diff_tells_a_take_from_a_retry_and_counts_ended_leases() {
        let old = slots(&[(1, 50), (2, 500)]);
        // Id 1's lease ended at 50; id 3 takes a slot until 1100.
        let e = LeaseEffect::between(Some(&old), &slots(&[(2, 500), (3, 1100)]), 100, false);
        assert_eq!(e.change, LeaseChange::Added { left_us: 1000 });
        assert_eq!(e.expired, 1);
        // A retry of id 2: nothing added.
        let e = LeaseEffect::between(Some(&old), &slots(&[(2, 500)]), 100, false);
        assert_eq!(e.change, LeaseChange::None);
        // A free of id 2 with 400 µs left; a free of an id without a slot.
        let e = LeaseEffect::between(Some(&old), &slots(&[]), 100, true);
        assert_eq!(e.change, LeaseChange::Released { left_us: 400 });
        let e = LeaseEffect::between(Some(&slots(&[])), &slots(&[]), 100, true);
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
