//! Admin overrides as the request path applies them: the live overrides (loaded from the store
//! by the admin poller, see `admin::poll`) by domain and entries, swapped whole on each load.
//! With none live the request path pays one relaxed load; with some, one read lock and a map
//! lookup per limit of the request.
//!
//! Precedence: an override applies to every counter keyed by exactly its entries in its domain
//! (the descriptor's own limits, or the resource limit at that node), and only to the limit of
//! its `limit_name` when it names one. It wins over the config and over Envoy's per-request
//! `limit` override: it is the operator's word on that counter, for a while. The counter stays
//! the configured limit's, so the override applies mid-window to what it has counted.

use super::plan::Plan;
use crate::store::admin::StoredOverride;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

type ByEntries = HashMap<Vec<(String, String)>, Vec<StoredOverride>>;

/// The overrides in force on this replica.
#[derive(Debug, Default)]
pub struct Overrides {
    active: AtomicBool,
    /// The store generation the table was loaded at (`u64::MAX`: never loaded).
    generation: AtomicU64,
    table: RwLock<Arc<HashMap<String, ByEntries>>>,
}

impl Overrides {
    pub fn new() -> Self {
        Self {
            generation: AtomicU64::new(u64::MAX),
            ..Self::default()
        }
    }

    /// The store generation last loaded, if any.
    pub fn generation(&self) -> Option<u64> {
        Some(self.generation.load(Ordering::Acquire)).filter(|&g| g != u64::MAX)
    }

    /// Forgets which generation was loaded: the next poll loads again.
    pub fn unknown_generation(&self) {
        self.generation.store(u64::MAX, Ordering::Release);
    }

    /// Swaps in `all` (those live at `now_ms`), loaded at store generation `generation`.
    pub fn replace(&self, generation: u64, all: Vec<StoredOverride>, now_ms: u64) {
        let mut table: HashMap<String, ByEntries> = HashMap::new();
        for o in all.into_iter().filter(|o| o.live(now_ms)) {
            table
                .entry(o.id.domain.clone())
                .or_default()
                .entry(o.id.entries.clone())
                .or_default()
                .push(o);
        }
        let active = !table.is_empty();
        *self.table.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(table);
        self.active.store(active, Ordering::Release);
        self.generation.store(generation, Ordering::Release);
    }

    /// Drops the overrides expired at `now_ms`; returns how many are live.
    pub fn prune(&self, now_ms: u64) -> usize {
        let live = self.list(now_ms);
        let held: usize = {
            let table = self.table.read().unwrap_or_else(|e| e.into_inner());
            table
                .values()
                .map(|d| d.values().map(Vec::len).sum::<usize>())
                .sum()
        };
        if held != live.len() {
            let generation = self.generation.load(Ordering::Acquire);
            let n = live.len();
            self.replace(generation, live, now_ms);
            return n;
        }
        live.len()
    }

    /// Whether any override was live when last loaded (the request path's only cost otherwise).
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    /// The live overrides, sorted by domain then entries.
    pub fn list(&self, now_ms: u64) -> Vec<StoredOverride> {
        let table = Arc::clone(&self.table.read().unwrap_or_else(|e| e.into_inner()));
        let mut all: Vec<StoredOverride> = table
            .values()
            .flat_map(|d| d.values().flatten())
            .filter(|o| o.live(now_ms))
            .cloned()
            .collect();
        all.sort_by(|a, b| a.id.cmp(&b.id));
        all
    }

    /// The override of the counter `entries` of `domain` for the limit `name`, live at `now_ms`:
    /// one naming the limit wins over one for every limit of the entries.
    pub fn find(
        &self,
        domain: &str,
        entries: &[(String, String)],
        name: &str,
        now_ms: u64,
    ) -> Option<StoredOverride> {
        let table = self.table.read().unwrap_or_else(|e| e.into_inner());
        let found = table.get(domain)?.get(entries)?;
        let live = |o: &&StoredOverride| o.live(now_ms);
        found
            .iter()
            .filter(live)
            .find(|o| !o.id.limit_name.is_empty() && o.id.limit_name == name)
            .or_else(|| {
                found
                    .iter()
                    .filter(live)
                    .find(|o| o.id.limit_name.is_empty())
            })
            .cloned()
    }

    /// Applies the overrides live at `now_ms` to the plan's limits.
    pub(super) fn apply(&self, plan: &mut Plan, now_ms: u64) {
        for l in &mut plan.limits {
            let key = &l.check.key;
            if let Some(o) = self.find(&key.domain, &key.entries, &l.name, now_ms) {
                l.check.admin_limit = Some(o.limit.requests());
                let p = l.check.params();
                (l.shown.requests_per_unit, l.shown.burst) = (p.limit, p.burst);
            }
        }
    }
}
