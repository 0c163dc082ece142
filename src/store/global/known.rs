//! What one replica remembers of each global counter it refills ([`Known`]): the pool's rate
//! at its last refills, what home had left, the demand it reported and the requests that
//! waited. Why its own file: every part of the refill (sizing, trimming, reporting) reads it,
//! and it is bounded ([`MAX_KNOWN`] counters and windows) so no caller's keys grow it.

use super::{regions, window_ms, GlobalGrants};
use crate::store::CounterKey;
use std::collections::HashMap;

/// Pools and demand records one replica keeps track of at most.
const MAX_KNOWN: usize = 10_000;

/// What this replica remembers of one global counter: for sizing refills and for answers.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Known {
    pub(super) window_ms: u64,
    /// The window (`LimitCheck::window`, µs), for giving the pool back at SIGTERM.
    pub(super) window: Option<(u64, u64)>,
    /// What home had left at the last refill this replica saw (u64::MAX: none yet).
    pub(super) home_left: u64,
    /// The last refill's size, and the pool's `taken` and clock then (the region's rate).
    pub(super) last_refill: u64,
    pub(super) taken_at: u64,
    pub(super) at_ms: u64,
    /// The pool's clock and `taken` when this replica's last refill (`last_refill`, more than
    /// nothing) asked home (0: none): a region taking its refills as fast as they land reads
    /// its rate from then (`ask.rs`).
    pub(super) asked_ms: u64,
    pub(super) taken_asked: u64,
    /// This replica watches the pool for idleness (to give it back home).
    pub(super) draining: bool,
    /// Units came into the pool while the watch ran (a give-back): once the watch ends, it
    /// looks again (it may have seen the pool empty just before they came).
    pub(super) poked: u64,
    /// A refill ahead runs from this replica (one at a time per counter).
    pub(super) ahead: bool,
    /// The next window's pool was filled ahead from this replica.
    pub(super) prefilled: bool,
    /// The region's demand at this replica's last refill (reported at home: `fair.rs`).
    pub(super) demand: regions::Demand,
    /// The least a refill asks ([`MIN_REFILL_SLICES`] of the limit's largest slices; 0 until
    /// this replica refilled): a pool trimmed because demand fell keeps at least this
    /// (`moved.rs`).
    pub(super) floor: u64,
    /// Units this replica's requests waited for while the pool was dry (a take from it failed
    /// and no refill has landed since), each request's at most a slice's, since its last
    /// refill asked home, and when the first of them did (this replica's clock, ms): demand
    /// the pool did not meet (`ask.rs`).
    pub(super) wanted: u64,
    pub(super) wanted_ms: u64,
    /// A take from the pool failed and no refill landed since.
    pub(super) starved: bool,
    /// The last reset record the pool was cleared for at this replica's last take from it
    /// (`PoolState::cleared`): its slice's units count after that reset.
    pub(super) cleared: u64,
}

impl GlobalGrants {
    pub(super) fn known(&self, key: &CounterKey, window: Option<(u64, u64)>) -> Known {
        let window_ms = window_ms(window);
        let mut map = self.known.lock().unwrap_or_else(|e| e.into_inner());
        let slot = (key.clone(), window_ms);
        // Bounded: sizing falls back to the first refill's for a while.
        make_room(&mut map, &slot, MAX_KNOWN);
        if let Some(k) = map.get(&slot) {
            return *k;
        }
        // The region's demand in the window before, until this one measures its own (`fair.rs`).
        let demand = window
            .and_then(|(start, end)| window_ms.checked_sub(end.checked_sub(start)? / 1000))
            .and_then(|before| map.get(&(key.clone(), before)))
            .map_or(regions::Demand::IDLE, |k| k.demand);
        *map.entry(slot).or_insert(Known {
            window_ms,
            window,
            home_left: u64::MAX,
            demand,
            ..Known::default()
        })
    }

    pub(super) fn update(&self, key: &CounterKey, window_ms: u64, f: impl FnOnce(&mut Known)) {
        let mut map = self.known.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = map.get_mut(&(key.clone(), window_ms)) {
            f(k);
        }
    }
}

/// Room for `slot` in a map bounded at `max` entries per counter and window: windows that
/// passed go first, then everything.
pub(super) fn make_room<V>(
    map: &mut HashMap<(CounterKey, u64), V>,
    slot: &(CounterKey, u64),
    max: usize,
) {
    if map.len() >= max && !map.contains_key(slot) {
        let newest = map.keys().map(|(_, w)| *w).max().unwrap_or(0);
        map.retain(|(_, w), _| *w >= newest);
        if map.len() >= max {
            map.clear();
        }
    }
}
