//! One slice's own arithmetic: a fresh one, what taking from it answers, the next grant's
//! size, units given back to it, and (a global limit's) when the next window's pool is due to
//! be filled ahead (the [`Slices`](super::Slices) around it decide when).

use super::{Entry, Refill, Slice, Taken, UNPINNED};
use std::sync::Arc;

impl Slice {
    pub(super) fn fresh(window: (u64, u64), now: u64) -> Self {
        Slice {
            window,
            left: 0,
            store_left: u64::MAX,
            last_grant: 0,
            spent: 0,
            since_us: now,
            dry_until_us: 0,
            cut_off: false,
            full_at_us: now,
            refill: Refill::Idle,
            touched_us: now,
            next_ahead: false,
            cleared: 0,
        }
    }

    /// A global limit's slice within [`PREFILL_MS`](crate::store::global::PREFILL_MS) of its
    /// window's end (`now`, µs), the first time: the next window's pool is to be filled ahead
    /// (`take.rs`). Never a token bucket's (no window).
    pub(super) fn next_window_due(&mut self, entry: &Entry, now: u64) -> bool {
        let lead = crate::store::global::PREFILL_MS.saturating_mul(1000);
        let end = self.window.1;
        let due = entry.global
            && !self.next_ahead
            && self.window != UNPINNED
            && now < end
            && now.saturating_add(lead) >= end;
        self.next_ahead |= due;
        due
    }

    pub(super) fn taken(&self, entry: &Arc<Entry>, allowed: bool) -> Taken {
        let store_left = if self.store_left == u64::MAX {
            0
        } else {
            self.store_left
        };
        // A window's answers reset at its end, a bucket's when it would be full again (as of
        // the last grant); a dry bucket's slice asks the store again after `ahead`.
        let (reset_at, retry_at) = if self.window == UNPINNED {
            let retry = match (allowed, self.dry_until_us) {
                (true, _) => 0,
                (false, 0) => self.full_at_us,
                (false, dry) => dry,
            };
            (self.full_at_us, retry)
        } else {
            (self.window.1, self.window.1)
        };
        Taken {
            entry: Arc::clone(entry),
            allowed,
            remaining: self.left.saturating_add(store_left),
            window_end: self.window.1,
            reset_at,
            retry_at,
            outage: false,
        }
    }

    /// Denied while dry: a fallback's answer if the dry spell is its region cut off from home
    /// (the last grant refused for want of home), else the store's.
    pub(super) fn dry_taken(&self, entry: &Arc<Entry>) -> Taken {
        Taken {
            outage: self.cut_off,
            ..self.taken(entry, false)
        }
    }

    /// The next grant's size: the replica's demand over `ahead` (its rate since the last
    /// grant), at most `max_slice` and a quarter of what the store had left, at least `need`.
    pub(super) fn want(&self, need: u64, now: u64, terms: crate::config::Leasing) -> u64 {
        let max_slice = u64::from(terms.max_slice);
        let demand = if self.last_grant == 0 {
            max_slice / 8
        } else {
            let elapsed = u128::from(now.saturating_sub(self.since_us).max(1));
            let ahead_us = u128::from(terms.ahead.millis()) * 1000;
            u64::try_from(u128::from(self.spent) * ahead_us / elapsed).unwrap_or(u64::MAX)
        };
        let quarter = if self.store_left == u64::MAX {
            u64::MAX
        } else {
            self.store_left.div_ceil(4)
        };
        demand.min(max_slice).min(quarter).max(1).max(need)
    }
}

impl Entry {
    /// Whether the refill a waiter of `window` waits on is done: the slice moved to another
    /// window, or no refill runs for it.
    pub(super) fn settled_for(&self, window: (u64, u64)) -> bool {
        let s = self.slice.lock().unwrap_or_else(|p| p.into_inner());
        s.window != window || s.refill != Refill::Running
    }

    /// Gives units taken for a request that was not charged back to the slice.
    pub(super) fn untake(&self, hits: u64, window_end: u64) {
        let mut s = self.slice.lock().unwrap_or_else(|p| p.into_inner());
        if s.window.1 == window_end {
            s.left += hits;
            s.spent = s.spent.saturating_sub(hits);
        }
    }
}
