//! Resets on the memory store. The store keeps no keys (a counter is a keyed fingerprint of its
//! identity), so it cannot find the counters below a descriptor prefix; instead a reset bumps an
//! *epoch* for that prefix, and every counter's fingerprint mixes in the epochs of its prefixes:
//! after a reset of `tenant=acme`, acme's counters and its consumers' have new identities and
//! start afresh, while the old ones are never read again and expire (or are evicted) as usual.
//! Exact under concurrency: a decision computes its fingerprints before it locks its shards, so
//! it counts wholly on the old counter or wholly on the new one.
//!
//! What it costs: nothing until the first reset (one relaxed load per counter); after it, one
//! read lock and a lookup per entry of each counter's key. Bounded: at most
//! [`MAX_RESET_PREFIXES`] prefixes are remembered (past it a reset is refused): an epoch cannot
//! be forgotten while a counter from before it could still be live.

use super::MemoryStore;
use crate::store::admin::{CounterAdmin, LocalOverrides, OverrideId, ResetCount, StoredOverride};
use crate::store::{BoxFuture, CounterKey, StoreError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;

/// Descriptor prefixes the memory store remembers resets of, at most (about 100 bytes each).
pub const MAX_RESET_PREFIXES: usize = 10_000;

/// A domain's reset prefixes and their epochs.
type Epochs = HashMap<Vec<(String, String)>, u64>;

/// The epoch of every prefix reset so far: domain -> entries -> epoch.
#[derive(Debug, Default)]
pub(super) struct Resets {
    any: AtomicBool,
    epochs: RwLock<HashMap<String, Epochs>>,
    len: std::sync::atomic::AtomicUsize,
}

impl Resets {
    /// What the counter's fingerprint mixes in: the sum of its prefixes' epochs, 0 before any
    /// reset. Epochs only grow, so a reset never brings an older sum (an older counter) back.
    pub(super) fn salt(&self, key: &CounterKey) -> u64 {
        if !self.any.load(Ordering::Relaxed) {
            return 0;
        }
        let epochs = self.epochs.read().unwrap_or_else(|e| e.into_inner());
        let Some(domain) = epochs.get(&*key.domain) else {
            return 0;
        };
        (1..=key.entries.len())
            .filter_map(|k| domain.get(&key.entries[..k]))
            .fold(0u64, |a, &e| a.wrapping_add(e))
    }

    fn bump(&self, domain: &str, prefix: &[(String, String)]) -> Result<(), StoreError> {
        let mut epochs = self.epochs.write().unwrap_or_else(|e| e.into_inner());
        let known = epochs.get(domain).is_some_and(|d| d.contains_key(prefix));
        if !known && self.len.load(Ordering::Relaxed) >= MAX_RESET_PREFIXES {
            return Err(StoreError::Permanent(format!(
                "the memory store remembers resets of {MAX_RESET_PREFIXES} descriptor prefixes \
                 at most, and has as many: restart the replica to clear every counter"
            )));
        }
        if !known {
            self.len.fetch_add(1, Ordering::Relaxed);
        }
        *epochs
            .entry(domain.to_string())
            .or_default()
            .entry(prefix.to_vec())
            .or_insert(0) += 1;
        self.any.store(true, Ordering::Release);
        Ok(())
    }
}

/// The memory store's admin side: resets by epoch, overrides in this process (the memory store
/// is one replica's: its overrides are that replica's).
#[derive(Debug)]
pub struct MemoryAdmin {
    pub(crate) store: std::sync::Arc<MemoryStore>,
    pub(crate) overrides: LocalOverrides,
}

impl MemoryAdmin {
    pub fn new(store: std::sync::Arc<MemoryStore>) -> Self {
        Self {
            store,
            overrides: LocalOverrides::default(),
        }
    }
}

impl CounterAdmin for MemoryAdmin {
    fn reset<'a>(
        &'a self,
        domain: &'a str,
        prefix: &'a [(String, String)],
        _domain_tag: bool,
    ) -> BoxFuture<'a, Result<ResetCount, StoreError>> {
        Box::pin(async move {
            self.store.resets.bump(domain, prefix)?;
            self.overrides.bump();
            Ok(ResetCount {
                counters: 0,
                counted: false,
            })
        })
    }

    fn overrides(&self) -> BoxFuture<'_, Result<(u64, Vec<StoredOverride>), StoreError>> {
        Box::pin(async { Ok(self.overrides.all()) })
    }

    fn generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(async { Ok(self.overrides.generation()) })
    }

    fn put_override<'a>(
        &'a self,
        o: &'a StoredOverride,
        now_ms: u64,
        max: usize,
    ) -> BoxFuture<'a, Result<Option<StoredOverride>, StoreError>> {
        Box::pin(async move { self.overrides.put(o, now_ms, max) })
    }

    fn delete_override<'a>(
        &'a self,
        id: &'a OverrideId,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<Option<StoredOverride>, StoreError>> {
        Box::pin(async move { Ok(self.overrides.delete(id, now_ms)) })
    }
}
