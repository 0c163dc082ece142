//! The embedded store: counters of every algorithm in sharded, fixed-capacity tables behind
//! short mutex sections. A decision locks the shards it touches in index order (so two requests
//! never deadlock), reads the clock only then (so a request that waited for a lock never decides
//! on an older time than the one before it), decides every limit without writing, and writes
//! only if the request is admitted.
//!
//! Memory is bounded: at most `max_counters` counters (`MEMORY_MAX_COUNTERS`), each a 16-byte
//! fingerprint of its key (no key is stored) and its state in one 56-byte slot, in tables that
//! grow up to a fixed size and never grow beyond it (at most [`BYTES_PER_COUNTER`] bytes each),
//! and as many candidate counters (below). When a shard is full, a new counter first
//! takes the place of an expired one, else of the one closest to expiry (evicted: it starts
//! afresh, which can only ever admit more, and only for the oldest counters; counted in
//! `sluice_memory_evictions_total`). Expired counters are also dropped a few per decision, so
//! no call walks a whole shard. Lease entries (slots, reservations, remembered denials) come
//! within a budget of their own ([`shard::LEASE_ENTRIES_PER_COUNTER`] per counter, per shard).
//! Candidate limits' counters (`CANDIDATE_CONFIG`) have shards of their own, as many and as
//! large: a candidate never evicts an enforced counter.

mod check;
mod resets;
mod shard;
mod table;

pub use resets::{MemoryAdmin, MAX_RESET_PREFIXES};

use super::{
    charged, Admission, BoxFuture, CounterKey, CounterStore, Decision, LeaseEffect, LimitCheck,
    StoreError, StoreSignals, Tally,
};
use crate::algorithm::{self, Log, Mode, Outcome, State};
use crate::clock::Clock;
use crate::config::Algorithm;
use check::{decide_check, released, remember_denial, take_of, within_budget};
use shard::{lease_entries, Counter, Shard};
use std::hash::{BuildHasher, Hash};
use std::sync::{Arc, Mutex, MutexGuard};
use table::Fingerprint;

/// Counters the memory store holds at most by default (`MEMORY_MAX_COUNTERS`): at most 64 MB
/// ([`BYTES_PER_COUNTER`] each), sized for a small pod; candidate limits' counters
/// (`CANDIDATE_CONFIG`) may take as many again, in shards of their own.
pub const DEFAULT_MAX_COUNTERS: usize = 500_000;
/// Most heap bytes one counter costs, key included, even while a table grows: a 56-byte table
/// slot at a load of at most 3/4 (75 bytes), a 24-byte expiry-index entry, and the quarter-size
/// table a growth frees just after (19 bytes); a full store holds about 100 bytes per counter.
/// sliding_log's charges come on top, 16 bytes each, bounded by the limit.
/// `tests/memory_bound.rs` measures it.
pub const BYTES_PER_COUNTER: usize = 128;
/// Expired counters a touched shard drops per decision at most: bounded work on the request path.
const SWEEP_PER_CALL: usize = 4;
/// Counters per shard when the store is large: shards of this size keep lock sections short.
const SHARD_TARGET: usize = 8_192;
const MAX_SHARDS: usize = 64;

/// In-process counters; the default store when no Redis is configured.
#[derive(Debug)]
pub struct MemoryStore {
    /// The enforced counters' shards, then as many for candidate limits' (`CANDIDATE_CONFIG`):
    /// a candidate counter lives in a table of its own, so a candidate config can never evict
    /// an enforced counter (which would change answers); candidates evict only candidates, up
    /// to `MEMORY_MAX_COUNTERS` of their own. Their tables start small and grow with use (and,
    /// as the enforced ones, never shrink): without candidates they cost about 2.3 KB each at
    /// the default size (64 shards: under 150 KB). One index space: a decision locks its
    /// shards of both kinds in ascending order, as ever.
    shards: Vec<Mutex<Shard>>,
    clock: Arc<dyn Clock>,
    /// Two independent keyed hashes make a counter's 128-bit fingerprint.
    hashers: (std::hash::RandomState, std::hash::RandomState),
    evictions: Tally,
    /// Candidate counters evicted by candidate counters (`sluice_candidate_evictions_total`):
    /// the candidate that starts afresh mid-window may then admit more than it would have.
    candidate_evictions: Tally,
    /// A counter's identity leaves out its limit's size (`requests_per_unit`, `burst`): the
    /// local layer's store (`FAILURE_MODE=local`), whose limits are this replica's share of the
    /// configured ones, so a share that changes mid-outage (a replica joins or leaves) decides
    /// on the counter it had, not on an empty one. (That layer names the configured size in
    /// the key's entries, so two limits differing only in size stay two counters.)
    size_blind: bool,
    /// Prefixes reset through the admin API (see `resets.rs`).
    resets: resets::Resets,
    /// Decisions made, counted under the counters' locks (`DecidedAt::Store`).
    decided: std::sync::atomic::AtomicU64,
}

impl MemoryStore {
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self::with_max_counters(clock, DEFAULT_MAX_COUNTERS)
    }

    /// A store holding at most `max` counters (0 keeps none: every decision starts afresh).
    pub fn with_max_counters(clock: Arc<dyn Clock>, max: usize) -> Self {
        let shards = max.div_ceil(SHARD_TARGET).clamp(1, MAX_SHARDS);
        Self::with_shards(clock, shards, max)
    }

    /// `shards` shards sharing `max` counters (each holds its share, the first ones one more),
    /// and as many for candidate limits' counters (up to `max` more).
    pub fn with_shards(clock: Arc<dyn Clock>, shards: usize, max: usize) -> Self {
        let shards = shards.max(1);
        let cap = |i: usize| max / shards + usize::from(i < max % shards);
        Self {
            shards: (0..2 * shards)
                .map(|i| Mutex::new(Shard::new(cap(i % shards))))
                .collect(),
            clock,
            hashers: Default::default(),
            evictions: Tally::default(),
            candidate_evictions: Tally::default(),
            size_blind: false,
            resets: resets::Resets::default(),
            decided: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The same store with counters identified without their limit's size (see `size_blind`).
    pub fn size_blind(mut self) -> Self {
        self.size_blind = true;
        self
    }

    /// Enforced counters held (expired ones not yet dropped included).
    pub fn len(&self) -> usize {
        let enforced = &self.shards[..self.shards.len() / 2];
        enforced.iter().map(|s| lock(s).counters.len()).sum()
    }

    /// Candidate limits' counters held (`CANDIDATE_CONFIG`), apart from [`MemoryStore::len`].
    pub fn candidate_len(&self) -> usize {
        let candidates = &self.shards[self.shards.len() / 2..];
        candidates.iter().map(|s| lock(s).counters.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Live enforced counters evicted to make room (`sluice_memory_evictions_total`).
    pub fn evictions(&self) -> u64 {
        self.evictions.get()
    }

    /// Live candidate counters evicted to make room for other candidates'.
    pub fn candidate_evictions(&self) -> u64 {
        self.candidate_evictions.get()
    }

    /// Counts evictions on `signals` (for `/metrics`) instead of private totals.
    pub fn reporting_to(mut self, signals: &StoreSignals) -> Self {
        self.evictions = signals.evictions.clone();
        self.candidate_evictions = signals.candidate_evictions.clone();
        self
    }

    /// The tally of shard `i`'s evictions.
    fn evictions_in(&self, i: usize) -> &Tally {
        if i < self.shards.len() / 2 {
            &self.evictions
        } else {
            &self.candidate_evictions
        }
    }

    /// A 128-bit keyed fingerprint of the counter's identity: two different keys share one with
    /// probability 2^-128 per pair, and a client cannot aim for a collision without the
    /// process's random keys.
    fn fingerprint(&self, key: &CounterKey) -> Fingerprint {
        if self.size_blind {
            let mut k = key.clone();
            (k.limit.requests_per_unit, k.limit.burst) = (0, 0);
            return self.fingerprint_of(&k);
        }
        self.fingerprint_of(key)
    }

    fn fingerprint_of(&self, key: &CounterKey) -> Fingerprint {
        // The key's `Hash` output (length-prefixed, so unambiguous) collected into one buffer,
        // then hashed in bulk: two SipHash passes over ~60 bytes instead of two over dozens of
        // small writes. After a reset of one of its prefixes, the epochs' salt too.
        let salt = self.resets.salt(key);
        with_key_bytes(key, |bytes| {
            if salt == 0 {
                [
                    self.hashers.0.hash_one(bytes),
                    self.hashers.1.hash_one(bytes),
                ]
            } else {
                [
                    self.hashers.0.hash_one((bytes, salt)),
                    self.hashers.1.hash_one((bytes, salt)),
                ]
            }
        })
    }

    /// The shard of a counter: among the enforced ones, or the candidates' for a candidate's.
    fn shard_of(&self, fp: Fingerprint, candidate: bool) -> usize {
        let n = self.shards.len() / 2;
        ((u128::from(fp[1]) * n as u128) >> 64) as usize + if candidate { n } else { 0 }
    }

    fn decide_now(&self, checks: &[LimitCheck]) -> Decision {
        let fps: Vec<Fingerprint> = checks.iter().map(|c| self.fingerprint(&c.key)).collect();
        // Each check's shard, then (below) its index among the locked guards.
        // A candidate check is on a candidate counter (`LimitCheck::candidate` and its key's
        // flag are set together, service/beside.rs): its shard is the candidates'.
        debug_assert!(checks.iter().all(|c| c.candidate == c.key.candidate));
        let mut slot: Vec<usize> = fps
            .iter()
            .zip(checks)
            .map(|(&fp, c)| self.shard_of(fp, c.key.candidate))
            .collect();
        let mut order = slot.clone();
        match order.as_mut_slice() {
            [] | [_] => {}
            [a, b] if *a > *b => std::mem::swap(a, b),
            [_, _] => {}
            more => more.sort_unstable(),
        }
        order.dedup();
        // Lock in ascending index order: concurrent multi-shard decisions cannot deadlock.
        let mut guards: Vec<MutexGuard<'_, Shard>> =
            order.iter().map(|&i| lock(&self.shards[i])).collect();
        for s in &mut slot {
            *s = order.binary_search(s).unwrap_or(0);
        }
        // Microseconds, as the algorithms and the Redis script count time; read under the locks.
        let now = u64::try_from(self.clock.now().as_micros()).unwrap_or(u64::MAX);

        let mut decision = if has_duplicates(&fps) {
            decide_on_copies(checks, &fps, &slot, &mut guards, now)
        } else {
            decide_in_place(checks, &fps, &slot, &mut guards, now)
        };
        let seq = 1 + self
            .decided
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        decision.at = super::DecidedAt::Store { us: now, seq };
        for (g, &i) in guards.iter_mut().zip(&order) {
            let evicted = g.evicted();
            if evicted > 0 {
                self.evictions_in(i).add(evicted);
            }
            g.sweep(now, SWEEP_PER_CALL);
        }
        decision
    }
}

thread_local! {
    /// Scratch space for [`MemoryStore::fingerprint`] (a key's bytes; reused, so no allocation).
    static KEY_BYTES: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on the key's `Hash` output (length-prefixed, so unambiguous) collected into one
/// per-thread buffer: hashing that in bulk costs one SipHash pass over ~60 bytes instead of one
/// over dozens of small writes.
pub(crate) fn with_key_bytes<R>(key: &CounterKey, f: impl FnOnce(&[u8]) -> R) -> R {
    KEY_BYTES.with_borrow_mut(|buf| {
        buf.clear();
        key.hash(&mut Collect(buf));
        let r = f(buf);
        if buf.capacity() > 4096 {
            // An unusually long key (values of up to MAX_DESCRIPTOR_VALUE_BYTES): give the
            // memory back rather than keep it per thread.
            *buf = Vec::new();
        }
        r
    })
}

/// A `Hasher` that only collects the bytes it is fed.
struct Collect<'a>(&'a mut Vec<u8>);

impl std::hash::Hasher for Collect<'_> {
    fn write(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }

    fn finish(&self) -> u64 {
        0
    }
}

/// Whether one request names a counter twice (two descriptors selecting the same counter).
fn has_duplicates(fps: &[Fingerprint]) -> bool {
    match fps {
        [] | [_] => false,
        [a, b] => a == b,
        _ => {
            let mut sorted = fps.to_vec();
            sorted.sort_unstable();
            sorted.windows(2).any(|w| w[0] == w[1])
        }
    }
}

/// The common case: every limit is decided against its stored state without writing (a
/// sliding_log in place, no copy of it), then, if the request is admitted, each is written.
fn decide_in_place(
    checks: &[LimitCheck],
    fps: &[Fingerprint],
    slot: &[usize],
    guards: &mut [MutexGuard<'_, Shard>],
    now: u64,
) -> Decision {
    let mut outcomes = Vec::with_capacity(checks.len());
    let mut next: Vec<Option<State>> = Vec::with_capacity(checks.len());
    let mut admission = Admission::default();
    let mut leases = LeaseEffect::per_check(checks);
    for (i, check) in checks.iter().enumerate() {
        let p = check.params();
        let counter = guards[slot[i]].counters.get_mut(fps[i]);
        let reserved = counter
            .as_ref()
            .is_some_and(|c| matches!(c.state, State::Reserved(_)));
        let (outcome, state) =
            if p.algorithm == Algorithm::SlidingLog && check.lease.is_none() && !reserved {
                (peek_log(counter, now, check), None)
            } else {
                let stored = counter.map(|c| &c.state);
                let was = stored.map_or(0, lease_entries);
                let (mut o, s) = decide_check(stored, now, check);
                let fits = within_budget(&guards[slot[i]], was, &s, check, &mut o);
                (o, Some(s).filter(|_| fits))
            };
        admission.add(check, outcome.allowed);
        outcomes.push(outcome);
        next.push(state);
    }
    let admitted = admission.admitted();
    let allowed: Vec<bool> = outcomes.iter().map(|o| o.allowed).collect();
    let charge = charged(checks, &allowed, admitted);
    for (i, (check, state)) in checks.iter().zip(next).enumerate() {
        if !charge[i] {
            // Not charged: report what the counter really has left, not what it would have
            // had after this request; an `in_flight` take is remembered as a denial.
            outcomes[i].remaining =
                remaining_now(guards[slot[i]].counters.get_mut(fps[i]), check, now);
            remember_take(&mut guards[slot[i]], fps[i], check, now);
            continue;
        }
        // A check charges nothing (a reservation or its settle of 0 hits still changes what
        // is held).
        if check.hits == 0 && check.lease.is_none() {
            continue;
        }
        let p = check.params();
        let shard = &mut guards[slot[i]];
        let Some(state) = state.or_else(|| log_in_place(shard, fps[i], check, now)) else {
            continue;
        };
        if !leases.is_empty() {
            let old = shard.counters.get(fps[i]).map(|c| &c.state);
            leases[i] = LeaseEffect::between(old, &state, now, released(check));
        }
        shard.write(fps[i], state, p, now);
        if !outcomes[i].allowed {
            // A take charged though denied (a shadow limit's) is remembered as well.
            remember_take(shard, fps[i], check, now);
        }
    }
    decided(admitted, outcomes, leases)
}

/// A take not charged is remembered as a denial of its id, on what the request left written
/// (in the overflow when the shard's lease entries are at their budget).
fn remember_take(shard: &mut Shard, fp: Fingerprint, check: &LimitCheck, now: u64) {
    let Some(id) = take_of(check) else {
        return;
    };
    let room = shard.has_room(1);
    let stored = shard.counters.get(fp).map(|c| &c.state);
    let state = remember_denial(stored, now, check, id, room);
    shard.write(fp, state, check.params(), now)
}

/// A sliding_log charge: recorded in the stored log in place (`None`: nothing left to write),
/// or a new log to write.
fn log_in_place(shard: &mut Shard, fp: Fingerprint, check: &LimitCheck, now: u64) -> Option<State> {
    let p = check.params();
    if p.algorithm != Algorithm::SlidingLog {
        return None; // (only a sliding_log is decided without a state to write)
    }
    if let Some(Counter {
        state: State::Log(log),
        expires_at,
    }) = shard.counters.get_mut(fp)
    {
        algorithm::sliding_log_in(log, now, p, check.hits, check.mode(), true);
        *expires_at = algorithm::log_expires_at(log, p);
        return None;
    }
    let mut log = Box::<Log>::default();
    algorithm::sliding_log_in(&mut log, now, p, check.hits, check.mode(), true);
    Some(State::Log(log))
}

/// A sliding_log decision on the stored log, in place and without recording the request.
#[inline]
fn peek_log(counter: Option<&mut Counter>, now: u64, check: &LimitCheck) -> Outcome {
    let (p, hits, mode) = (check.params(), check.hits, check.mode());
    match counter {
        Some(Counter {
            state: State::Log(log),
            ..
        }) => algorithm::sliding_log_in(log, now, p, hits, mode, false),
        _ => algorithm::sliding_log_in(&mut Log::default(), now, p, hits, mode, false),
    }
}

/// What a counter has left as it stands (a denied request reports this).
fn remaining_now(counter: Option<&mut Counter>, check: &LimitCheck, now: u64) -> u32 {
    let p = check.params();
    match counter {
        Some(Counter {
            state: State::Log(log),
            ..
        }) => algorithm::sliding_log_in(log, now, p, 0, Mode::Charge, false).remaining,
        Some(c) => {
            algorithm::decide(Some(&c.state), now, p, 0, Mode::Charge)
                .0
                .remaining
        }
        None => algorithm::decide(None, now, p, 0, Mode::Charge).0.remaining,
    }
}

/// The state this request's earlier checks left for `fp`, if any.
fn latest(pending: &[(Fingerprint, State)], fp: Fingerprint) -> Option<&State> {
    pending.iter().rev().find(|(f, _)| *f == fp).map(|(_, s)| s)
}

/// A request naming one counter twice: its checks see each other's hits, so each decides on a
/// tentative copy of the state (rare; the copies are dropped on a denial).
fn decide_on_copies(
    checks: &[LimitCheck],
    fps: &[Fingerprint],
    slot: &[usize],
    guards: &mut [MutexGuard<'_, Shard>],
    now: u64,
) -> Decision {
    let mut pending: Vec<(Fingerprint, State)> = Vec::with_capacity(checks.len());
    let mut outcomes: Vec<Outcome> = Vec::with_capacity(checks.len());
    let mut admission = Admission::default();
    let mut leases = LeaseEffect::per_check(checks);
    for (i, check) in checks.iter().enumerate() {
        let stored = guards[slot[i]].counters.get(fps[i]).map(|c| &c.state);
        let current = latest(&pending, fps[i]).or(stored);
        let (mut outcome, next) = decide_check(current, now, check);
        let was = current.map_or(0, lease_entries);
        if within_budget(&guards[slot[i]], was, &next, check, &mut outcome) {
            if !leases.is_empty() {
                leases[i] = LeaseEffect::between(current, &next, now, released(check));
            }
            pending.push((fps[i], next));
        }
        admission.add(check, outcome.allowed);
        outcomes.push(outcome);
    }
    let admitted = admission.admitted();
    let allowed: Vec<bool> = outcomes.iter().map(|o| o.allowed).collect();
    let charge = charged(checks, &allowed, admitted);
    // Exact: every check that changed its copy is charged, so the copies are what to write
    // (and each check reports what it saw, as the script does).
    let exact = checks
        .iter()
        .zip(&allowed)
        .zip(&charge)
        .all(|((c, &ok), &w)| w || (c.hits == 0 && c.lease.is_none()) || !(ok || c.record));
    if !exact {
        // Only some checks are written: replay just those on fresh copies, and report what the
        // others' counters really have left.
        pending.clear();
        for (i, check) in checks.iter().enumerate() {
            let stored = guards[slot[i]].counters.get(fps[i]).map(|c| &c.state);
            if !charge[i] {
                outcomes[i].remaining =
                    algorithm::decide(stored, now, check.params(), 0, Mode::Charge)
                        .0
                        .remaining;
                continue;
            }
            let current = latest(&pending, fps[i]).or(stored);
            let (_, next) = decide_check(current, now, check);
            if !leases.is_empty() {
                leases[i] = LeaseEffect::between(current, &next, now, released(check));
            }
            pending.push((fps[i], next));
        }
    }
    // Only what is written counts.
    for ((e, &w), c) in leases.iter_mut().zip(&charge).zip(checks) {
        if !w || (c.hits == 0 && c.lease.is_none()) {
            *e = LeaseEffect::default();
        }
    }
    write_last(&pending, checks, fps, slot, guards, &charge, now);
    // Takes denied or not charged are remembered as denials, on what the request left written.
    for (i, check) in checks
        .iter()
        .enumerate()
        .filter(|&(i, _)| !charge[i] || !outcomes[i].allowed)
    {
        remember_take(&mut guards[slot[i]], fps[i], check, now);
    }
    decided(admitted, outcomes, leases)
}

/// Each counter of a request decided on copies ends in the state its last written check left.
fn write_last(
    pending: &[(Fingerprint, State)],
    checks: &[LimitCheck],
    fps: &[Fingerprint],
    slot: &[usize],
    guards: &mut [MutexGuard<'_, Shard>],
    charge: &[bool],
    now: u64,
) {
    for (n, (fp, state)) in pending.iter().enumerate() {
        if pending[n + 1..].iter().any(|(f, _)| f == fp) {
            continue;
        }
        let i = fps.iter().position(|f| f == fp).unwrap_or(0);
        let written = checks
            .iter()
            .zip(fps)
            .zip(charge)
            .any(|((c, f), &w)| f == fp && w && (c.hits > 0 || c.lease.is_some()));
        if written {
            let p = checks[i].params();
            guards[slot[i]].write(*fp, state.clone(), p, now);
        }
    }
}

/// The store's answer: one atomic step.
fn decided(admitted: bool, outcomes: Vec<Outcome>, leases: Vec<LeaseEffect>) -> Decision {
    Decision {
        at: crate::store::DecidedAt::Unknown,
        admitted,
        outcomes,
        local: false,
        steps: 1,
        beside_lost: false,
        beside_apart: false,
        leases,
    }
}

/// A poisoned shard only means another request panicked mid-decision; its counters are still
/// plain numbers, so keep serving rather than fail every later request.
fn lock(m: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl CounterStore for MemoryStore {
    fn decide<'a>(
        &'a self,
        checks: &'a [LimitCheck],
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        Box::pin(async move { Ok(self.decide_now(checks)) })
    }

    /// Nothing to contact: in-process counters are always there.
    fn probe(&self) -> BoxFuture<'_, bool> {
        Box::pin(async { true })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::config::Unit;
    use std::time::Duration;

    fn check(value: &str, limit: u32, unit: Unit) -> LimitCheck {
        LimitCheck::for_tests("d", value, crate::config::Limit::fixed(limit, unit), 1)
    }

    #[test]
    fn expired_counters_are_reclaimed() {
        let clock = ManualClock::new(Duration::from_secs(1_000_000));
        let store = MemoryStore::with_shards(Arc::new(clock.clone()), 4, 1000);
        for i in 0..100 {
            assert!(
                store
                    .decide_now(&[check(&i.to_string(), 5, Unit::Second)])
                    .admitted
            );
        }
        let hour = check("long-lived", 5, Unit::Hour);
        assert!(store.decide_now(std::slice::from_ref(&hour)).admitted);
        assert_eq!(store.len(), 101);
        // Past every second-window: each decision drops a few expired counters of its shard.
        clock.advance(Duration::from_secs(2));
        for i in 0..4 * 50 {
            store.decide_now(&[LimitCheck {
                hits: 0,
                ..check(&format!("probe{i}"), 5, Unit::Second)
            }]);
        }
        assert_eq!(store.len(), 1, "only the hour counter is still live");
        // ...and it still holds its count.
        let o = store.decide_now(&[hour]).outcomes[0];
        assert_eq!(o.remaining, 3);
    }

    #[test]
    fn checks_spanning_shards_are_all_or_nothing() {
        let clock = ManualClock::new(Duration::from_secs(1_000_000));
        let store = MemoryStore::with_shards(Arc::new(clock), 8, 1000);
        let checks: Vec<_> = (0..16)
            .map(|i| check(&i.to_string(), 2, Unit::Minute))
            .collect();
        let mut last = check("15", 2, Unit::Minute);
        last.hits = 2;
        assert!(store.decide_now(&[last]).admitted);
        // The last counter is full, so the whole batch is denied and nothing else is charged.
        let d = store.decide_now(&checks);
        assert!(!d.admitted);
        assert_eq!(d.outcomes.iter().filter(|o| o.allowed).count(), 15);
        assert_eq!(store.len(), 1);
    }

    #[test]
    fn concurrent_decisions_admit_exactly_the_limit() {
        let clock = ManualClock::new(Duration::from_secs(1_000_000));
        let store = Arc::new(MemoryStore::with_shards(Arc::new(clock), 4, 1000));
        let admitted = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for t in 0..8 {
                let store = &store;
                let admitted = &admitted;
                s.spawn(move || {
                    for i in 0..100 {
                        // Every batch touches the shared counter plus a private one.
                        let batch = [
                            check("shared", 50, Unit::Hour),
                            check(&format!("{t}-{i}"), 1000, Unit::Hour),
                        ];
                        if store.decide_now(&batch).admitted {
                            admitted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                    }
                });
            }
        });
        assert_eq!(admitted.load(std::sync::atomic::Ordering::SeqCst), 50);
    }

    #[test]
    fn a_full_store_evicts_the_counter_closest_to_expiry_and_counts_it() {
        let clock = ManualClock::new(Duration::from_secs(1_000_000));
        let store = MemoryStore::with_shards(Arc::new(clock.clone()), 1, 3);
        let day = check("day", 5, Unit::Day);
        let hour = check("hour", 5, Unit::Hour);
        let minute = check("minute", 5, Unit::Minute);
        for c in [&day, &hour, &minute] {
            assert!(store.decide_now(std::slice::from_ref(c)).admitted);
        }
        assert_eq!((store.len(), store.evictions()), (3, 0));
        // A fourth counter: the minute one, closest to expiry, gives way.
        assert!(store.decide_now(&[check("new", 5, Unit::Day)]).admitted);
        assert_eq!((store.len(), store.evictions()), (3, 1));
        // The minute counter starts afresh; coming back, it evicts the hour one in turn.
        let d = store.decide_now(std::slice::from_ref(&minute));
        assert_eq!(d.outcomes[0].remaining, 4, "starts afresh");
        assert_eq!((store.len(), store.evictions()), (3, 2));
        assert_eq!(store.decide_now(&[hour]).outcomes[0].remaining, 4);
        assert_eq!(store.evictions(), 3, "the minute counter gave way again");
        assert_eq!(store.decide_now(&[day]).outcomes[0].remaining, 3, "kept");
        // Expired counters make room first, without an eviction.
        clock.advance(Duration::from_secs(2 * 3600));
        assert!(store.decide_now(&[check("later", 5, Unit::Day)]).admitted);
        assert_eq!((store.len(), store.evictions()), (3, 3));
    }

    #[test]
    fn candidate_counters_never_evict_an_enforced_one() {
        // A full store of enforced counters, then a caller sending a candidate limit a new
        // consumer each time: the candidates evict only each other, the enforced counts stand.
        let clock = ManualClock::new(Duration::from_secs(1_000_000));
        let store = MemoryStore::with_shards(Arc::new(clock.clone()), 1, 4);
        let enforced: Vec<_> = (0..4)
            .map(|i| check(&format!("e{i}"), 5, Unit::Hour))
            .collect();
        for c in &enforced {
            assert!(store.decide_now(std::slice::from_ref(c)).admitted);
        }
        let candidate = |i: usize| {
            let mut c = check(&format!("c{i}"), 5, Unit::Minute);
            (c.candidate, c.key.candidate) = (true, true);
            c
        };
        for i in 0..50 {
            let d = store.decide_now(&[check("e1", 5, Unit::Hour), candidate(i)]);
            assert!(d.outcomes[1].allowed, "candidate {i}");
        }
        assert_eq!(
            (store.len(), store.evictions()),
            (4, 0),
            "no enforced counter gave way"
        );
        assert_eq!(
            store.candidate_len(),
            4,
            "the candidates keep a cap of their own"
        );
        assert_eq!(store.candidate_evictions(), 46);
        for (i, c) in enforced.iter().enumerate() {
            // e1 was charged with the first four candidate requests (then full: denied).
            let want = if i == 1 { 0 } else { 3 };
            let d = store.decide_now(std::slice::from_ref(c));
            assert_eq!(d.outcomes[0].remaining, want, "e{i} kept its count");
        }
        // Several shards of each kind: the same, every candidate shard at its cap.
        let store = MemoryStore::with_shards(Arc::new(clock.clone()), 4, 400);
        for i in 0..100 {
            assert!(
                store
                    .decide_now(&[check(&format!("e{i}"), 5, Unit::Hour)])
                    .admitted
            );
        }
        for i in 0..2000 {
            store.decide_now(&[check("e0", 5000, Unit::Hour), candidate(i)]);
        }
        assert_eq!((store.len(), store.evictions()), (101, 0));
        assert_eq!(store.candidate_len(), 400);
        assert_eq!(store.candidate_evictions(), 1600);
    }

    #[test]
    fn a_decision_older_than_the_stored_window_keeps_the_newer_count() {
        // Fixed and sliding windows: a request whose `now` is before the stored window (it
        // waited across a window edge) decides on the newer window and never overwrites it.
        for unit in [Unit::Minute] {
            for alg in [
                crate::config::Algorithm::FixedWindow,
                crate::config::Algorithm::SlidingWindow,
            ] {
                let t1 = Duration::from_secs(1_000_020); // 20 s into a minute window
                let clock = ManualClock::new(t1);
                let store = MemoryStore::with_shards(Arc::new(clock.clone()), 2, 100);
                let mut c = check("edge", 5, unit);
                c.key.limit.algorithm = alg;
                for _ in 0..3 {
                    assert!(store.decide_now(std::slice::from_ref(&c)).admitted);
                }
                clock.set(t1 - Duration::from_secs(30)); // the previous window
                let d = store.decide_now(std::slice::from_ref(&c));
                assert!(d.admitted, "{alg:?}");
                assert_eq!(
                    d.outcomes[0].remaining, 1,
                    "{alg:?}: counted on the newer window"
                );
                clock.set(t1);
                let d = store.decide_now(std::slice::from_ref(&c));
                assert_eq!(
                    d.outcomes[0].remaining, 0,
                    "{alg:?}: the newer window holds 5"
                );
            }
        }
    }

    #[test]
    fn a_denied_sliding_log_request_writes_nothing() {
        let clock = ManualClock::new(Duration::from_secs(1_000_000));
        let store = MemoryStore::with_shards(Arc::new(clock.clone()), 1, 10);
        let mut log = check("log", 2, Unit::Minute);
        log.key.limit.algorithm = crate::config::Algorithm::SlidingLog;
        let other = check("other", 1, Unit::Minute);
        assert!(store.decide_now(std::slice::from_ref(&other)).admitted);
        clock.advance(Duration::from_secs(1));
        // Denied by `other`: the log's charge is not written.
        let d = store.decide_now(&[log.clone(), other]);
        assert!(!d.admitted);
        assert_eq!(d.outcomes[0].remaining, 2);
        let d = store.decide_now(std::slice::from_ref(&log));
        assert_eq!(d.outcomes[0].remaining, 1, "only this charge is in the log");
    }

    /// Review A9: lease entries count against the store's budget (two per counter it may hold):
    /// a client choosing ids cannot grow a counter's reservations or slots, or the denials it
    /// remembers, past it; what does not fit is denied, and a denial past it is remembered in
    /// the overflow, which no done call can turn into a free slot.
    #[test]
    fn lease_entries_stay_within_the_stores_budget() {
        use crate::config::{Algorithm, Limit, Period, Reservations};
        use crate::store::LeaseCall;
        let clock = ManualClock::new(Duration::from_secs(1_000_000));
        // 4 counters, so 8 lease entries.
        let store = MemoryStore::with_shards(Arc::new(clock.clone()), 1, 4);
        let terms = Reservations {
            lease: Period::from_millis(300_000).expect("5 min"),
            max: 256,
            min_estimate: 1,
        };
        let reserve = |id: u32| {
            let mut c = check("budget", 1_000_000, Unit::Hour);
            c.lease = Some(LeaseCall {
                id: Arc::from(format!("r{id}")),
                release: false,
                reservations: Some(terms),
            });
            c
        };
        let admitted = (0..20)
            .filter(|&i| store.decide_now(&[reserve(i)]).admitted)
            .count();
        assert_eq!(admitted, 8, "reservations past the store's 8 lease entries");
        let slots = Limit {
            requests_per_unit: 100,
            period: Period::from_millis(60_000).expect("1 min"),
            algorithm: Algorithm::InFlight,
            burst: 0,
        };
        let take = |id: u32| {
            let mut c = LimitCheck::for_tests("d", "slots", slots, 1);
            c.lease = Some(LeaseCall {
                id: Arc::from(format!("t{id}")),
                release: false,
                reservations: None,
            });
            c
        };
        assert!(
            !store.decide_now(&[take(0)]).admitted,
            "no room for a slot while the reservations hold the budget"
        );
        let shard = lock(&store.shards[0]);
        assert!(shard.has_room(0) && !shard.has_room(1), "8 entries held");
    }
}
