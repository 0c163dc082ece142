//! Admin writes on global limits reaching this replica's slices (`store/global/admin.rs`): a
//! reset at home empties them (given nothing back: home forgot what they were charged); an
//! override set, changed or removed gives them back to the region's pool, so what is spent
//! next is granted on the limit in force.

use super::Slices;
use crate::store::admin::ResetRecord;
use std::sync::Arc;

impl Slices {
    /// A reset of global limits at home (`store/global/admin.rs`): this replica's slices of
    /// the counters it covers are emptied, given nothing back (home forgot what they were
    /// charged). A refill under way still lands: it was charged after the reset. Returns the
    /// units emptied.
    pub fn forget(&self, reset: &ResetRecord, keep_from: u64) -> u64 {
        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let mut emptied = 0;
        for (key, e) in map.iter() {
            if e.global && reset.covers(&key.domain, &key.entries) {
                let mut s = e.slice.lock().unwrap_or_else(|p| p.into_inner());
                let keep = if keep_from == 0 {
                    reset.seq
                } else {
                    keep_from.min(reset.seq)
                };
                if s.cleared >= keep {
                    continue; // its units were granted after this reset's clear of the pool
                }
                emptied += std::mem::take(&mut s.left);
                s.store_left = u64::MAX;
            }
        }
        emptied
    }

    /// An override of `domain`'s counters keyed by `entries` changed: what this replica's
    /// slices of them hold goes back to the region's pool (in the background). The slices
    /// stay: a refill under way lands in its own (removed, its units would be lost), and the
    /// next grant is judged on the limit in force. Returns how many slices gave units back.
    pub fn give_back_overridden(&self, domain: &str, entries: &[(String, String)]) -> usize {
        let held: Vec<_> = {
            let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
            map.iter()
                .filter(|(k, e)| e.global && &*k.domain == domain && &*k.entries == entries)
                .map(|(k, e)| (k.clone(), Arc::clone(e)))
                .collect()
        };
        let mut gave = 0;
        for (key, e) in &held {
            if e.slice.lock().unwrap_or_else(|p| p.into_inner()).left > 0 {
                gave += 1;
            }
            self.give_back_later(key, e);
        }
        gave
    }
}
