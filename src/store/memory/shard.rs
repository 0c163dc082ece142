//! One shard of the memory store: its counters in a fixed-capacity table, an expiry index that
//! finds the counter closest to expiry without a scan, and the lease entries (slots,
//! reservations, remembered denials) its counters hold, kept within a budget.

use super::table::{Fingerprint, Table};
use crate::algorithm::{self, LimitParams, State};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Index entries a full shard examines to find the counter closest to expiry.
const EVICT_SEARCH: usize = 16;

#[derive(Debug)]
pub(super) struct Counter {
    pub(super) state: State,
    /// Microseconds since the epoch after which the state no longer matters.
    pub(super) expires_at: u64,
}

/// An expiry-index entry: (expiry, the fingerprint's halves swapped). Ties go by `fp[1]`, which
/// says nothing about a counter's place in its table (`fp[0]` does): evicting among equal
/// expiries in `fp[0]` order would empty one end of the table and crowd the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Indexed(u64, u64, u64);

impl Indexed {
    fn new(at: u64, fp: Fingerprint) -> Self {
        Indexed(at, fp[1], fp[0])
    }

    fn fp(self) -> Fingerprint {
        [self.2, self.1]
    }
}

#[derive(Debug)]
pub(super) struct Shard {
    pub(super) counters: Table<Counter>,
    /// Every counter exactly once, by the expiry it had when indexed. Expiries only move later
    /// (a refund aside), so the smallest entry whose counter still has that expiry is the
    /// counter closest to expiry; an entry whose counter moved on is re-indexed when it
    /// surfaces.
    expiry: BinaryHeap<Reverse<Indexed>>,
    cap: usize,
    /// Lease entries its counters hold ([`lease_entries`]), and at most how many.
    entries: usize,
    entry_cap: usize,
    /// Live counters evicted to make room since the store last drained it ([`Shard::evicted`]).
    evicted: u64,
}

/// Lease entries the memory store holds per counter it may hold, on average (each 16 to 32
/// bytes): a counter with many slots or reservations takes the room of counters without.
pub const LEASE_ENTRIES_PER_COUNTER: usize = 2;

/// The lease entries a state holds: `in_flight` slots and remembered denials, reservations.
pub(super) fn lease_entries(state: &State) -> usize {
    match state {
        State::Slots(s) => s.held.len() + s.denied.len(),
        State::Reserved(r) => r.held.len(),
        _ => 0,
    }
}

impl Shard {
    pub(super) fn new(cap: usize) -> Self {
        Self {
            counters: Table::new(cap),
            expiry: BinaryHeap::new(),
            cap,
            entries: 0,
            entry_cap: cap.saturating_mul(LEASE_ENTRIES_PER_COUNTER),
            evicted: 0,
        }
    }

    /// The live counters evicted to make room since the last call (the store counts them).
    pub(super) fn evicted(&mut self) -> u64 {
        std::mem::take(&mut self.evicted)
    }

    /// Whether `more` lease entries fit in the shard's budget.
    pub(super) fn has_room(&self, more: usize) -> bool {
        self.entries.saturating_add(more) <= self.entry_cap
    }

    /// Drops a counter, and its lease entries from the budget; whether there was one.
    fn remove(&mut self, fp: Fingerprint) -> bool {
        match self.counters.remove(fp) {
            Some(c) => {
                self.entries = self.entries.saturating_sub(lease_entries(&c.state));
                true
            }
            None => false,
        }
    }

    /// Drops up to `budget` index entries' worth of expired counters, soonest first.
    pub(super) fn sweep(&mut self, now: u64, budget: usize) {
        for _ in 0..budget {
            let Some(&Reverse(e)) = self.expiry.peek() else {
                return;
            };
            let (at, fp) = (e.0, e.fp());
            if at > now {
                return;
            }
            self.expiry.pop();
            match self.counters.get(fp) {
                Some(c) if c.expires_at > now => {
                    self.expiry.push(Reverse(Indexed::new(c.expires_at, fp)))
                }
                Some(_) => {
                    self.remove(fp);
                }
                None => {}
            }
        }
    }

    /// Makes room for one more counter; returns whether a live counter was evicted.
    fn make_room(&mut self, now: u64) -> bool {
        if self.counters.len() < self.cap {
            return false;
        }
        self.sweep(now, EVICT_SEARCH);
        if self.counters.len() < self.cap {
            return false;
        }
        for _ in 0..EVICT_SEARCH {
            let Some(Reverse(e)) = self.expiry.pop() else {
                return false;
            };
            let (at, fp) = (e.0, e.fp());
            match self.counters.get(fp) {
                Some(c) if c.expires_at > at => {
                    self.expiry.push(Reverse(Indexed::new(c.expires_at, fp)))
                }
                Some(_) => {
                    self.remove(fp);
                    return true;
                }
                None => {}
            }
        }
        // Every entry looked at had moved on: evict the soonest indexed one anyway.
        match self.expiry.pop() {
            Some(Reverse(e)) => self.remove(e.fp()),
            None => false,
        }
    }

    /// Stores `state` for `fp` (a live counter evicted to make room is counted:
    /// [`Shard::evicted`]).
    pub(super) fn write(&mut self, fp: Fingerprint, state: State, p: LimitParams, now: u64) {
        let expires_at = algorithm::expires_at(&state, p);
        let held = lease_entries(&state);
        if let Some(c) = self.counters.get_mut(fp) {
            let was = lease_entries(&c.state);
            c.state = state;
            c.expires_at = expires_at;
            self.entries = self.entries.saturating_sub(was).saturating_add(held);
            return;
        }
        self.evicted += u64::from(self.make_room(now));
        if self.counters.len() >= self.cap {
            return; // cap 0: nothing is kept
        }
        self.entries = self.entries.saturating_add(held);
        self.counters.insert(fp, Counter { state, expires_at });
        if self.expiry.len() == self.expiry.capacity() {
            // Grow exactly, never past the cap: one entry per counter.
            let more = self
                .expiry
                .capacity()
                .max(16)
                .min(self.cap - self.expiry.len());
            self.expiry.reserve_exact(more);
        }
        self.expiry.push(Reverse(Indexed::new(expires_at, fp)));
    }
}
