//! `FAILURE_MODE=local`: a layer that answers every request in time even when the store cannot.
//! A request the store does not decide by the caller's deadline (less a margin), or that the
//! store fails (the breaker is open, Redis errs, a Cluster slot has no master), is decided by
//! this replica alone, on an in-process store, against its *share* of each limit (`shares`): an
//! equal split among the replicas that heartbeat into the store, of what the store last said
//! was left in the window, or of the whole limit for a counter it has not seen this window. What
//! it admits is owed to the store (`ledger`) and written back, at most once per token, before
//! that counter is decided on the store again; a store call that answers late is reconciled
//! (what it charged is taken off the debt), so the store's counter ends equal to what was
//! admitted. docs/operations.md states the bound.

mod alarm;
mod deadline;
mod ledger;
mod local;
mod shares;
mod write_back;

pub use ledger::Ledger;
pub use shares::{Learned, Roster, Shares};

use super::memory::MemoryStore;
use super::signals::LocalTallies;
use super::{
    BoxFuture, CounterStore, Decider, Decision, LimitCheck, StoreError, StoreSignals, WriteBack,
};
use crate::clock::Clock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::time::Instant;

/// Where a replica learns how many replicas share the store (heartbeats in the store).
pub trait Membership: Send + Sync + std::fmt::Debug {
    /// Records this replica (`id`) alive for `lease`; returns the replicas alive and its rank.
    fn beat<'a>(
        &'a self,
        id: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Roster, StoreError>>;
}

/// Default `LOCAL_MAX_COUNTERS`.
pub const DEFAULT_MAX_COUNTERS: usize = 100_000;
/// Default `LOCAL_DEADLINE_MARGIN`.
/// Half of Envoy's default 20 ms: what sluice, the network and Envoy need after the local
/// decision (measured through Envoy with four pairs of replicas on two cores, 8 ms was not
/// always enough), while a healthy Redis answers in well under the 10 ms left.
pub const DEFAULT_MARGIN: Duration = Duration::from_millis(10);
/// Default `LOCAL_STORE_PATIENCE`.
pub const DEFAULT_PATIENCE: Duration = Duration::from_secs(60);
/// Default [`LocalSettings::max_late_calls`].
pub const DEFAULT_MAX_LATE_CALLS: usize = 4096;
/// How often the replica beats, and its lease (three beats).
const BEAT_EVERY: Duration = Duration::from_secs(1);
/// How often a store that is down is probed.
const PROBE_EVERY: Duration = Duration::from_millis(250);

/// The layer's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalSettings {
    /// `LOCAL_MAX_COUNTERS`: counters kept locally (the local store, what was learned, what is
    /// owed: each bounded by it).
    pub max_counters: usize,
    /// `LOCAL_DEADLINE_MARGIN`: answered locally this long before the caller's deadline.
    pub margin: Duration,
    /// How long the store may take for a caller without a deadline (`REDIS_TIMEOUT`).
    pub budget: Duration,
    /// `LOCAL_REPLICAS`: replicas assumed until the first heartbeat answers.
    pub replicas: u32,
    /// After the store failed or hung, requests go straight to the local store at least this
    /// long (`REDIS_BREAKER_OPEN`); then until a probe answers (standalone, Sentinel), or one
    /// request tries the slot again (Cluster).
    pub retry_every: Duration,
    /// Standalone and Sentinel: one store, so a call that hangs means every call would; on
    /// Cluster a hang may be one slot's, and each request tries the store.
    pub whole_store: bool,
    /// Store calls kept running after their caller was answered locally (to learn what they
    /// charged). Past this many, a call that misses its caller's deadline is dropped instead
    /// (bounded memory while a master hangs); requests still ask the store, so a Cluster's
    /// healthy masters keep deciding theirs (review B1).
    pub max_late_calls: usize,
}

impl Default for LocalSettings {
    fn default() -> Self {
        Self {
            max_counters: DEFAULT_MAX_COUNTERS,
            margin: DEFAULT_MARGIN,
            budget: crate::store::redis::DEFAULT_TIMEOUT,
            replicas: 1,
            retry_every: crate::store::breaker::DEFAULT_OPEN_FOR,
            whole_store: true,
            max_late_calls: DEFAULT_MAX_LATE_CALLS,
        }
    }
}

/// The layer: the store it protects, and what it decides with when that store cannot.
#[derive(Debug, Clone)]
pub struct LocalFallback {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    inner: Arc<dyn WriteBack>,
    local: MemoryStore,
    shares: Shares,
    ledger: Ledger,
    clock: Arc<dyn Clock>,
    settings: LocalSettings,
    /// Standalone and Sentinel: the store failed or hung, and requests skip it until a probe
    /// answers (no request waits on a store that is known to be down).
    down: AtomicBool,
    /// Not probed before (µs on the monotonic clock, [`Shared::mono_us`]): a store that fails
    /// again at once is left alone this long. Never the wall clock: an NTP step back must not
    /// keep a replica local.
    suspect_until_us: AtomicU64,
    /// Cluster: the same per hash tag (a slot's master may be down while the others answer).
    suspect_tags: Mutex<std::collections::HashMap<u64, u64>>,
    /// The monotonic clock's origin for the cool-downs above.
    born: Instant,
    /// Whether a caller's deadline too short to ever decide locally was logged (once).
    told_short_deadline: AtomicBool,
    outstanding: AtomicUsize,
    tallies: Arc<LocalTallies>,
    episode: Mutex<Option<Episode>>,
    /// When to stop waiting for the store, for every request at once.
    alarms: alarm::Alarms,
    /// This replica's id in the heartbeats and write-back tokens.
    id: String,
}

/// One stretch of local deciding, for its log lines.
#[derive(Debug, Clone, Copy, Default)]
struct Episode {
    admitted: u64,
    denied: u64,
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl LocalFallback {
    /// The layer over `inner`, reporting to `signals`; heartbeats go to `members` when given
    /// (a background task, which ends when the layer is dropped). Must run inside a Tokio
    /// runtime.
    pub fn new(
        inner: Arc<dyn WriteBack>,
        members: Option<Arc<dyn Membership>>,
        settings: LocalSettings,
        clock: Arc<dyn Clock>,
        signals: &StoreSignals,
    ) -> Self {
        let tallies = Arc::clone(&signals.local);
        let mut local_signals = StoreSignals::new("local");
        local_signals.evictions = tallies.evictions.clone();
        let local = MemoryStore::with_max_counters(Arc::clone(&clock), settings.max_counters)
            .size_blind()
            .reporting_to(&local_signals);
        let id = replica_id();
        let shared = Arc::new(Shared {
            inner,
            local,
            shares: Shares::new(settings.max_counters, Roster::assumed(settings.replicas)),
            ledger: Ledger::new(settings.max_counters),
            clock,
            settings,
            down: AtomicBool::new(false),
            suspect_until_us: AtomicU64::new(0),
            suspect_tags: Mutex::new(std::collections::HashMap::new()),
            born: Instant::now(),
            told_short_deadline: AtomicBool::new(false),
            outstanding: AtomicUsize::new(0),
            tallies,
            episode: Mutex::new(None),
            alarms: alarm::Alarms::start(),
            id,
        });
        if let Some(m) = members {
            tokio::spawn(heartbeat(Arc::downgrade(&shared), m));
        }
        tokio::spawn(background(Arc::downgrade(&shared)));
        if settings.whole_store {
            tokio::spawn(watch_store(Arc::downgrade(&shared)));
        }
        Self { shared }
    }

    /// How many replicas this one counts and its rank (for tests and `/debug`).
    pub fn roster(&self) -> Roster {
        self.shared.shares.roster()
    }

    /// Counters owing a write-back.
    pub fn owed(&self) -> usize {
        self.shared.ledger.len()
    }
}

impl Shared {
    fn now_us(&self) -> u64 {
        micros(self.clock.now())
    }

    /// Microseconds on the monotonic clock (tokio's, so paused in tests) since the layer began:
    /// what the suspicion cool-downs are timed on.
    fn mono_us(&self) -> u64 {
        micros(Instant::now().saturating_duration_since(self.born))
    }

    /// The whole store is down: requests skip it until [`Shared::probe`] sees it answer.
    fn suspect(&self) -> bool {
        self.down.load(Ordering::Relaxed)
    }

    /// Whether the request goes straight to the local decision: the store is down (until a
    /// probe answers), or on Cluster the slot of one of its counters failed or hung less than
    /// `retry_every` ago (there a request tries the slot again: one slot cannot be probed).
    fn skip_store(&self, checks: &[LimitCheck]) -> bool {
        if self.suspect() {
            return true;
        }
        if self.settings.whole_store {
            return false;
        }
        let tags = self.suspect_tags.lock().unwrap_or_else(|e| e.into_inner());
        if tags.is_empty() {
            return false;
        }
        let now_us = self.mono_us();
        checks.iter().any(|c| {
            tags.get(&self.tag(&c.key))
                .is_some_and(|&until| now_us < until)
        })
    }

    /// A counter's Cluster slot (of its hash tag): what is suspected when a call fails. Per
    /// slot, not per tag (review B1): a frozen master's slots are learned once each, so new
    /// tenants on it go local at once instead of each waiting for its own deadline first, and
    /// the map holds at most 16 384 entries.
    fn tag(&self, key: &super::CounterKey) -> u64 {
        let tag = crate::store::redis::keys::hash_tag(key);
        u64::from(crate::store::redis::keys::tag_slot(&tag))
    }

    /// The store failed or hung for `checks`: the whole store (standalone, Sentinel), or their
    /// slots (Cluster), skipped for `retry_every`. Only the store's own failure leads here (an
    /// error, or no answer within its budget), never a caller's deadline.
    fn suspect_now(&self, checks: &[LimitCheck]) {
        let now_us = self.mono_us();
        let until = now_us.saturating_add(micros(self.settings.retry_every));
        if self.settings.whole_store {
            self.suspect_until_us.fetch_max(until, Ordering::Relaxed);
            self.down.store(true, Ordering::Relaxed);
            return;
        }
        let mut tags = self.suspect_tags.lock().unwrap_or_else(|e| e.into_inner());
        if tags.len() >= self.settings.max_counters {
            tags.retain(|_, &mut u| u > now_us);
        }
        for c in checks {
            if tags.len() < self.settings.max_counters {
                tags.insert(self.tag(&c.key), until);
            }
        }
    }

    /// The store's answer, or its failure, for a request it was asked in time.
    async fn answered(
        &self,
        checks: &[LimitCheck],
        r: Result<Decision, StoreError>,
    ) -> Result<Decision, StoreError> {
        match r {
            Ok(d) => {
                self.store_answered(checks, &d, self.now_us());
                Ok(d)
            }
            Err(e) => {
                let partial = e.partial();
                if e.is_transient() {
                    match partial {
                        // Only the slots that failed (review A3, B1).
                        Some(p) => self.suspect_now(&only(checks, &p.failed)),
                        None => self.suspect_now(checks),
                    }
                }
                let stays = partial.map(|p| p.charged.as_slice());
                Ok(self
                    .decide_locally_after(checks, self.now_us(), stays)
                    .await)
            }
        }
    }

    fn started_local(&self, admitted: bool) {
        let mut e = self.episode.lock().unwrap_or_else(|e| e.into_inner());
        let episode = e.get_or_insert_with(|| {
            self.tallies.deciding.store(true, Ordering::Relaxed);
            tracing::warn!(
                replicas = self.shares.roster().replicas,
                "deciding locally: the counter store did not answer in time; each limit is held \
                 to this replica's share until the store is back"
            );
            Episode::default()
        });
        if admitted {
            episode.admitted += 1;
        } else {
            episode.denied += 1;
        }
    }

    /// The store decided a request: an episode ends once nothing is owed.
    fn store_answered(&self, checks: &[LimitCheck], d: &Decision, now_us: u64) {
        self.shares.learn(checks, d, now_us);
        if self.tallies.deciding.load(Ordering::Relaxed) && self.settled() {
            self.end_episode();
        }
    }

    /// Nothing owed and no store call still awaited.
    fn settled(&self) -> bool {
        self.ledger.is_empty() && self.outstanding.load(Ordering::Relaxed) == 0
    }

    fn end_episode(&self) {
        let mut e = self.episode.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(ep) = e.take() {
            self.tallies.deciding.store(false, Ordering::Relaxed);
            tracing::info!(
                admitted = ep.admitted,
                denied = ep.denied,
                written_back = self.tallies.write_backs.get(),
                "deciding on the store again: every local decision is written back"
            );
        }
    }
}

/// The checks of `checks` that `mask` marks.
fn only(checks: &[LimitCheck], mask: &[bool]) -> Vec<LimitCheck> {
    checks
        .iter()
        .zip(mask)
        .filter(|(_, &m)| m)
        .map(|(c, _)| c.clone())
        .collect()
}

/// A random id for this process (heartbeats, write-back tokens): 16 hex digits.
fn replica_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    format!("{:016x}", h.finish())
}

/// Probes a store that is down, every `PROBE_EVERY`, while the layer lives.
async fn watch_store(shared: Weak<Shared>) {
    let mut tick = tokio::time::interval(PROBE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(s) = shared.upgrade() else {
            return;
        };
        s.probe().await;
    }
}

/// Heartbeats, every second, while the layer lives: a task of their own, so a long write-back
/// pass never delays one past the lease (review B2: the other replicas would drop this one
/// from their roster and take larger shares, just when the store is flaky).
async fn heartbeat(shared: Weak<Shared>, members: Arc<dyn Membership>) {
    let mut tick = tokio::time::interval(BEAT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(s) = shared.upgrade() else {
            return;
        };
        let beat = tokio::time::timeout(s.settings.budget, members.beat(&s.id, 3 * BEAT_EVERY));
        if let Ok(Ok(roster)) = beat.await {
            s.shares.set_roster(roster);
            s.tallies
                .replicas
                .store(u64::from(roster.replicas), Ordering::Relaxed);
        }
    }
}

/// Background write-backs and sweeps, every second, while the layer lives.
async fn background(shared: Weak<Shared>) {
    let mut tick = tokio::time::interval(BEAT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(s) = shared.upgrade() else {
            return;
        };
        s.write_back_all().await;
        s.shares.sweep_one(s.now_us());
        let owed = s.ledger.len() + s.outstanding.load(Ordering::Relaxed);
        s.tallies
            .owed
            .store(u64::try_from(owed).unwrap_or(u64::MAX), Ordering::Relaxed);
        let held = s.local.len() + s.shares.len() + s.ledger.len();
        s.tallies
            .held
            .store(u64::try_from(held).unwrap_or(u64::MAX), Ordering::Relaxed);
        s.tallies.skipped.store(
            s.shares.skipped.load(Ordering::Relaxed) + s.ledger.dropped.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
    }
}

impl CounterStore for LocalFallback {
    fn decide<'a>(
        &'a self,
        checks: &'a [LimitCheck],
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        self.decide_by(checks.to_vec(), None)
    }

    fn probe(&self) -> BoxFuture<'_, bool> {
        self.shared.inner.probe()
    }
}

impl Decider for LocalFallback {
    fn decide_by(
        &self,
        checks: Vec<LimitCheck>,
        deadline: Option<Instant>,
    ) -> BoxFuture<'_, Result<Decision, StoreError>> {
        // Candidate checks (`CANDIDATE_CONFIG`) never enter what follows: no candidate is
        // decided locally, written back, or suspects a slot. Alone (the service's call apart),
        // they go to the store within the budget; beside enforced ones, they are left out for
        // the service to decide apart.
        let enforced = crate::store::enforced_len(&checks);
        if enforced == 0 {
            let (inner, budget) = (Arc::clone(&self.shared.inner), self.shared.settings.budget);
            return Box::pin(async move {
                match tokio::time::timeout(budget, inner.decide(&checks)).await {
                    Ok(r) => r,
                    Err(_) => Err(StoreError::Transient("candidate checks: no answer".into())),
                }
            });
        }
        let apart = enforced < checks.len();
        let mut checks = checks;
        checks.truncate(enforced);
        let decided = self.decide_enforced(checks, deadline);
        Box::pin(async move {
            let mut d = decided.await?;
            d.beside_apart = apart;
            Ok(d)
        })
    }
}

impl LocalFallback {
    /// [`Decider::decide_by`] for a request's enforced checks.
    fn decide_enforced(
        &self,
        checks: Vec<LimitCheck>,
        deadline: Option<Instant>,
    ) -> BoxFuture<'_, Result<Decision, StoreError>> {
        Box::pin(async move {
            let s = &self.shared;
            if s.skip_store(&checks) {
                return Ok(s.decide_locally(&checks, s.now_us()).await);
            }
            let started = Instant::now();
            let give_up = s.give_up_at(deadline, started);
            if !s.ledger.is_empty() && !s.settle(&checks, give_up).await {
                return Ok(s.decide_locally(&checks, s.now_us()).await);
            }
            // Shared with the call, which outlives this request if the store answers late
            // (the list moves behind the `Arc`; its checks are not copied).
            let checks = Arc::new(checks);
            let owned = Arc::clone(&checks);
            let inner = Arc::clone(&s.inner);
            let mut call = Box::pin(async move { inner.decide(&owned).await });
            // The store's budget runs from its call, not from the write-backs before it
            // (review B3: those must not make a store that answered look hung).
            let called = Instant::now();
            // The window a late answer is taken off: the one it was asked in (review B7).
            let asked_us = s.now_us();
            let ring = s.alarms.at(give_up).ring();
            let answer = tokio::select! {
                biased;
                r = &mut call => Ok(r),
                () = ring => Err(()),
            };
            match answer {
                Ok(r) => s.answered(&checks, r).await,
                Err(()) => {
                    // The caller's time is up, not necessarily the store's: the store is
                    // suspected only once the call has run for its whole budget.
                    let store_due = called + s.settings.budget;
                    let hung = Instant::now() >= store_due;
                    if hung {
                        s.suspect_now(&checks);
                    }
                    let d = s.decide_locally(&checks, s.now_us()).await;
                    if s.outstanding.fetch_add(1, Ordering::Relaxed) >= s.settings.max_late_calls {
                        // Too many calls already wait on a store that does not answer: this
                        // one is dropped (if the store ran it anyway, the write-back counts
                        // its hits a second time: over-counted, never under).
                        s.outstanding.fetch_sub(1, Ordering::Relaxed);
                        s.tallies.late_calls_dropped.add(1);
                        return Ok(d);
                    }
                    let late = Arc::clone(s);
                    tokio::spawn(async move {
                        let r = match tokio::time::timeout_at(store_due, &mut call).await {
                            Ok(r) => r,
                            Err(_) => {
                                if !hung {
                                    late.suspect_now(&checks);
                                }
                                call.await
                            }
                        };
                        match r {
                            Ok(d) => late.reconcile(&checks, &d, asked_us),
                            Err(e) => {
                                if let Some(p) = e.partial() {
                                    late.reconcile_charged(&checks, &p.charged, asked_us);
                                }
                                if e.is_transient() && !hung {
                                    late.suspect_now(&checks);
                                }
                            }
                        }
                        late.outstanding.fetch_sub(1, Ordering::Relaxed);
                    });
                    Ok(d)
                }
            }
        })
    }
}

#[cfg(any(test, feature = "test-util"))]
impl LocalFallback {
    /// Tests only (`test-util`): the roster as if a heartbeat had answered it.
    pub fn set_roster(&self, roster: Roster) {
        self.shared.shares.set_roster(roster);
    }

    /// Tests only (`test-util`): one probe of a store that is down, now.
    pub async fn probe_now(&self) {
        self.shared.probe().await;
    }

    /// Tests only (`test-util`): store calls that outlived their request's time and have not
    /// answered yet (each reconciles the ledger when it does).
    pub fn late_calls(&self) -> usize {
        self.shared.outstanding.load(Ordering::Relaxed)
    }

    /// Tests only (`test-util`): one background write-back pass now.
    pub async fn write_back_now(&self) {
        self.shared.write_back_all().await;
    }
}

#[cfg(test)]
mod deadline_tests;
#[cfg(test)]
mod tests;
