//! What a store stack reports besides its decisions. The narrow [`CounterStore`] contract only
//! decides and probes; health, the breaker's state and the running totals for metrics travel
//! through the handles here instead, created once by the composition root and handed to each
//! part of the stack as it is built (`reporting_to`). The service reads readiness from them and
//! the metrics registry exports them; no layer forwards them through its inner store.
//!
//! [`CounterStore`]: super::CounterStore

use super::breaker::BreakerState;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::watch;

/// The side channels of one store stack. Cloning shares them.
#[derive(Debug, Clone)]
pub struct StoreSignals {
    /// Which backend decides (`memory`, `redis`, `redis-cluster`): the trace span's store name.
    pub backend: &'static str,
    /// Whether the backend answered its last contact (a decision or a probe).
    pub health: Arc<watch::Sender<bool>>,
    /// The circuit breaker's state; `None` while the stack has no breaker.
    pub breaker: Arc<watch::Sender<Option<BreakerState>>>,
    /// Cluster charges that could not be undone (`sluice_refund_failures_total`).
    pub undo_failures: Tally,
    /// Live memory-store counters evicted to make room (`sluice_memory_evictions_total`).
    pub evictions: Tally,
    /// Live memory-store candidate counters (`CANDIDATE_CONFIG`) evicted by other candidates'
    /// (`sluice_candidate_evictions_total`).
    pub candidate_evictions: Tally,
    /// `FAILURE_MODE=local`'s decisions and write-backs (zero without it).
    pub local: Arc<LocalTallies>,
    /// The slices of leased limits (zero without them).
    pub slices: Arc<super::slices::SliceTallies>,
    /// Global limits' refills and pools (zero without them).
    pub global: Arc<super::global::GlobalTallies>,
}

/// What `FAILURE_MODE=local` reports: decisions made locally by domain and outcome, whether the
/// replica is deciding locally now, write-backs done and failed, and its bounded state.
#[derive(Debug, Default)]
pub struct LocalTallies {
    /// (domain, admitted) -> requests decided locally. Domains come from the config, so the
    /// map is as bounded as the config.
    decisions: std::sync::Mutex<std::collections::BTreeMap<(Arc<str>, bool), u64>>,
    /// Deciding locally now: from the first local decision until nothing is owed to the store.
    pub deciding: std::sync::atomic::AtomicBool,
    /// Write-backs the store confirmed.
    pub write_backs: Tally,
    /// Write-back attempts that failed (each is retried under its token).
    pub write_back_failures: Tally,
    /// Local counters evicted to make room.
    pub evictions: Tally,
    /// Store calls dropped at their caller's deadline because `max_late_calls` were already
    /// awaited (their hits may be counted twice: over, never under).
    pub late_calls_dropped: Tally,
    /// Counters held locally (local store, learned, owed), as of the last background tick.
    pub held: AtomicU64,
    /// Counters not learned or hits not owed because the local state was full.
    pub skipped: AtomicU64,
    /// Replicas sharing the store, as of the last heartbeat (0: none answered yet).
    pub replicas: AtomicU64,
    /// Counters owing a write-back plus store calls still awaited, as of the last tick.
    pub owed: AtomicU64,
}

impl LocalTallies {
    /// Counts one request decided locally.
    pub fn decided(&self, checks: &[super::LimitCheck], admitted: bool) {
        let Some(c) = checks.first() else {
            return;
        };
        let mut m = self.decisions.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((Arc::clone(&c.key.domain), admitted)).or_insert(0) += 1;
    }

    /// Every (domain, admitted, count) so far.
    pub fn decisions(&self) -> Vec<(Arc<str>, bool, u64)> {
        let m = self.decisions.lock().unwrap_or_else(|e| e.into_inner());
        m.iter()
            .map(|((d, a), n)| (Arc::clone(d), *a, *n))
            .collect()
    }
}

impl StoreSignals {
    /// Fresh handles for a stack on `backend`: healthy, no breaker, totals at zero.
    pub fn new(backend: &'static str) -> Self {
        Self {
            backend,
            health: Arc::new(watch::Sender::new(true)),
            breaker: Arc::new(watch::Sender::new(None)),
            undo_failures: Tally::default(),
            evictions: Tally::default(),
            candidate_evictions: Tally::default(),
            local: Arc::default(),
            slices: Arc::default(),
            global: Arc::default(),
        }
    }

    /// Whether the stack can decide: the backend answered last and no breaker is open.
    pub fn healthy(&self) -> bool {
        *self.health.borrow() && matches!(*self.breaker.borrow(), None | Some(BreakerState::Closed))
    }

    /// The breaker's state now, if the stack has one.
    pub fn breaker_state(&self) -> Option<BreakerState> {
        *self.breaker.borrow()
    }

    /// Records whether the backend answered; returns whether that changed the health.
    pub fn set_health(&self, ok: bool) -> bool {
        self.health
            .send_if_modified(|h| std::mem::replace(h, ok) != ok)
    }
}

/// A running total a part of the stack adds to and the metrics read (a shared atomic).
#[derive(Debug, Clone, Default)]
pub struct Tally(Arc<AtomicU64>);

impl Tally {
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Whether a denial the backend returns is final, for the local deny cache (which caches only
/// final denials): on a Redis Cluster a request spanning slots charges each slot and undoes the
/// charges if one slot denies, so a counter may look full while another request's temporary
/// charge stands. The composition root picks the policy from the backend it builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenialFinality {
    /// Memory and standalone Redis decide each request in one atomic step: every denial is final.
    Always,
    /// Redis Cluster: only a counter of a domain kept in one slot (`hash_tag: domain`).
    DomainTaggedOnly,
}

impl DenialFinality {
    pub fn is_final(self, key: &super::CounterKey) -> bool {
        match self {
            Self::Always => true,
            Self::DomainTaggedOnly => key.domain_tag,
        }
    }
}
