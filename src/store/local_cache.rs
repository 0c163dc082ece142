//! The local deny cache (`LOCAL_CACHE_SIZE_IN_BYTES`, as in envoyproxy/ratelimit): a counter
//! that a decision showed to be full (denied with nothing remaining) stays full until its window
//! resets, so until then a request on it is denied here, without a Redis round trip. Under an
//! attack that hammers one over-limit key this takes the load off Redis entirely.
//!
//! - Only non-shadow, non-refund, non-quota checks that charge (`hits > 0`), on limits no
//!   stream-done call can give room to (not `in_flight`, no `reservations`), use or fill the
//!   cache: a shadow limit never denies, a quota-mode limit denies only together with the
//!   request's other quota limits, a refund must reach the counter, and a check-only request
//!   (`hits_addend` 0) asks for the counter's current state.
//! - The key is the whole [`CounterKey`], limit included (requests_per_unit, unit, override), so
//!   a changed limit or override is never answered from an entry kept for another one.
//! - A locally answered request is denied and the cached counters are not charged. In an
//!   all-or-nothing request nothing else is either (the store would have charged nothing); its
//!   other checks were not read and are reported `allowed: true, remaining: 0, reset: 0` (see
//!   [`LocalDenyCache`]). Recording checks (envoyproxy counting, `record_usage`) that are not
//!   cached still go to the store and are charged, as envoyproxy/ratelimit charges every key
//!   not in its cache; with `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT` nothing is.
//! - A refund seen here for a cached counter drops its entry (the counter has room again). A
//!   refund made through another replica is not seen: that replica's entry lives until the
//!   window resets, the same trade-off envoyproxy makes.
//! - Only final denials are cached: on a Redis Cluster a request spanning slots charges each
//!   slot and undoes the charges if one slot denies, so a counter may look full for the moment
//!   another request's charge stands; such a denial is answered but not cached (a domain with
//!   `hash_tag: domain` has no such requests, and standalone Redis and memory never do).
//! - Memory is bounded: each entry is accounted as the length of its key strings plus
//!   [`ENTRY_OVERHEAD`] bytes; an insert that would exceed the budget first drops up to
//!   [`PURGE_BUDGET`] expired entries, soonest first (an expiry index, so no denial walks the
//!   cache under its lock), then is skipped. The cache never grows past its budget.

use super::{
    BoxFuture, CounterKey, CounterStore, Decision, DenialFinality, LimitCheck, Outcome, StoreError,
    WriteBack,
};
use crate::clock::Clock;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
#[cfg(any(test, feature = "test-util"))]
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Bytes accounted per entry on top of its key strings (map slot, deadline, string headers,
/// and the expiry index, which holds at most two entries per cached counter).
pub const ENTRY_OVERHEAD: usize = 64 + 2 * std::mem::size_of::<Expiring>();
/// Expired entries one insert into a full cache drops at most: no denial walks the cache.
pub const PURGE_BUDGET: usize = 16;

#[derive(Debug)]
struct Entry {
    deny_until: Duration,
    bytes: usize,
}

/// An expiry-index entry: when a counter's denial ends, as it was when indexed. Ordered by
/// time alone (soonest first in the reversed heap).
#[derive(Debug)]
struct Expiring {
    at: Duration,
    key: CounterKey,
}

impl PartialEq for Expiring {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}
impl Eq for Expiring {}
impl PartialOrd for Expiring {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Expiring {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.at.cmp(&other.at)
    }
}

#[derive(Debug, Default)]
struct Entries {
    map: HashMap<CounterKey, Entry>,
    /// Every entry by the deny time it had when indexed, soonest first (like the memory
    /// store's expiry index): an entry extended since is re-indexed when it surfaces; one
    /// removed leaves a stale index entry, and the index is rebuilt from the map once stale
    /// ones make up half of it, so it stays within twice the map.
    expiry: BinaryHeap<Reverse<Expiring>>,
    bytes: usize,
    /// Index entries purges looked at, all told (tests: no purge walks the cache).
    #[cfg(any(test, feature = "test-util"))]
    purge_visits: u64,
    #[cfg(any(test, feature = "test-util"))]
    max_purge_visits: u64,
}

impl Entries {
    fn remove(&mut self, key: &CounterKey) {
        if let Some(e) = self.map.remove(key) {
            self.bytes -= e.bytes;
        }
    }

    fn insert(&mut self, key: CounterKey, entry: Entry) {
        if self.expiry.len() >= 2 * self.map.len() + 64 {
            self.expiry = self
                .map
                .iter()
                .map(|(k, e)| {
                    Reverse(Expiring {
                        at: e.deny_until,
                        key: k.clone(),
                    })
                })
                .collect();
        }
        self.bytes += entry.bytes;
        self.expiry.push(Reverse(Expiring {
            at: entry.deny_until,
            key: key.clone(),
        }));
        self.map.insert(key, entry);
    }

    /// Drops expired entries, soonest first, looking at no more than [`PURGE_BUDGET`] index
    /// entries.
    fn purge_expired(&mut self, now: Duration) {
        let mut visits = 0;
        while visits < PURGE_BUDGET {
            match self.expiry.peek() {
                Some(Reverse(top)) if top.at <= now => {}
                _ => break,
            }
            let Some(Reverse(top)) = self.expiry.pop() else {
                break;
            };
            visits += 1;
            match self.map.get(&top.key) {
                Some(e) if e.deny_until <= now => self.remove(&top.key),
                Some(e) if e.deny_until > top.at => {
                    // Extended since it was indexed: index it again at its new time.
                    let at = e.deny_until;
                    self.expiry.push(Reverse(Expiring { at, key: top.key }));
                }
                _ => {}
            }
        }
        #[cfg(any(test, feature = "test-util"))]
        {
            self.purge_visits += visits as u64;
            self.max_purge_visits = self.max_purge_visits.max(visits as u64);
        }
    }
}

/// Accounted size of one entry.
pub fn entry_bytes(key: &CounterKey) -> usize {
    key.domain.len()
        + key
            .entries
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum::<usize>()
        + ENTRY_OVERHEAD
}

/// Whether a check may be answered from, and may fill, the cache. A quota-mode limit's denial
/// alone does not deny its request, so it never answers one. Nor does a lease limit's (an
/// `in_flight` limit, a rate limit with `reservations`), even on a request that names no
/// request id: another request's stream-done call can free a slot or give a reservation back
/// at any moment (and must reach the store itself).
///
/// Nor does a check under an admin override: its limit is not the one its key names. Nor a
/// candidate limit's (`CANDIDATE_CONFIG`): it never answers a request, and is decided by the
/// store whenever the request it rides with is.
fn eligible(c: &LimitCheck) -> bool {
    !c.candidate
        && !c.shadow
        && !c.refund
        && !c.quota
        && c.hits > 0
        && c.lease.is_none()
        && !c.leased
        && c.admin_limit.is_none()
}

impl<S: CounterStore> super::admin::Forget for LocalDenyCache<S> {
    fn forget_all(&self) {
        self.clear();
    }
}

/// A deny cache in front of a [`CounterStore`] `S`.
///
/// A request answered locally gets `Decision { admitted: false, outcomes }` where every check
/// with a live entry is `allowed: false, remaining: 0, reset: <time until the entry expires>`
/// and every other check is `allowed: true, remaining: 0, reset: 0`: the request is denied,
/// nothing is charged, and the other counters were not read.
#[derive(Debug)]
pub struct LocalDenyCache<S> {
    inner: S,
    /// Which of the inner store's denials may be cached.
    finality: DenialFinality,
    clock: Arc<dyn Clock>,
    max_bytes: usize,
    entries: Mutex<Entries>,
    #[cfg(any(test, feature = "test-util"))]
    local_denials: AtomicU64,
}

impl<S: CounterStore> LocalDenyCache<S> {
    /// A cache of at most `max_bytes` (accounted as in [`entry_bytes`]) in front of `inner`,
    /// caching the denials `finality` says are final.
    pub fn new(
        inner: S,
        max_bytes: usize,
        clock: Arc<dyn Clock>,
        finality: DenialFinality,
    ) -> Self {
        Self {
            inner,
            finality,
            clock,
            max_bytes,
            entries: Mutex::new(Entries::default()),
            #[cfg(any(test, feature = "test-util"))]
            local_denials: AtomicU64::new(0),
        }
    }

    #[cfg(any(test, feature = "test-util"))]
    /// Entries held (live or expired but not yet dropped).
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    #[cfg(any(test, feature = "test-util"))]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[cfg(any(test, feature = "test-util"))]
    /// Accounted bytes held; never more than the budget.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    #[cfg(any(test, feature = "test-util"))]
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    #[cfg(any(test, feature = "test-util"))]
    /// The most expiry-index entries one purge looked at.
    pub fn max_purge_visits(&self) -> u64 {
        self.lock().max_purge_visits
    }

    #[cfg(any(test, feature = "test-util"))]
    /// Decisions answered from the cache without calling the store.
    pub fn local_denials(&self) -> u64 {
        self.local_denials.load(Ordering::Relaxed)
    }

    /// Drops every entry (an admin reset or override may have given the counters room).
    pub fn clear(&self) {
        *self.lock() = Entries::default();
    }

    fn lock(&self) -> MutexGuard<'_, Entries> {
        // Entries are left consistent between statements; a poisoned lock is still usable.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The local answer, if a live entry covers one of `checks`. Also drops what refunds and
    /// expiry made stale.
    fn lookup(&self, checks: &[LimitCheck], now: Duration) -> Option<Decision> {
        // A request naming a lease (an `in_flight` take or free, a reservation or its settle)
        // always reaches the store: a free or settle releases what it holds, and a take the
        // cache denied would not be remembered as a denial of its id, so its stream-done call
        // could free another request's slot (src/algorithm/in_flight.rs).
        if checks.iter().any(|c| c.lease.is_some()) {
            return None;
        }
        let mut entries = self.lock();
        if entries.map.is_empty() {
            return None;
        }
        let mut denied: Vec<(usize, Duration)> = Vec::new();
        for (i, c) in checks.iter().enumerate() {
            if c.refund && c.hits > 0 {
                entries.remove(&c.key);
                continue;
            }
            if !eligible(c) {
                continue;
            }
            match entries.map.get(&c.key) {
                Some(e) if e.deny_until > now => denied.push((i, e.deny_until - now)),
                Some(_) => entries.remove(&c.key),
                None => {}
            }
        }
        drop(entries);
        if denied.is_empty() {
            return None;
        }
        let mut outcomes = vec![
            Outcome {
                allowed: true,
                remaining: 0,
                reset: Duration::ZERO,
                retry_after: Duration::ZERO,
            };
            checks.len()
        ];
        for (i, reset) in denied {
            outcomes[i] = Outcome {
                allowed: false,
                remaining: 0,
                reset,
                retry_after: reset,
            };
        }
        Some(Decision {
            at: crate::store::DecidedAt::Unknown,
            admitted: false,
            outcomes,
            local: true,
            steps: 0,
            beside_lost: false,
            beside_apart: false,
            leases: Vec::new(),
        })
    }

    /// Remembers every counter `decision` showed to be full. `now` is the time the request
    /// started: the store read its own clock later, so `now + reset` never outlives the window.
    fn remember(&self, checks: &[LimitCheck], decision: &Decision, now: Duration) {
        if self.max_bytes == 0 {
            return;
        }
        // Only a single-hit denial says when the counter admits again for ANY request: a
        // larger request's retry time is later than a single hit's, and a request larger than
        // the quota is never admitted although single hits still are.
        // A single hit that can never be admitted means a limit of 0: cache it for the
        // counter's period (it stays denied after that too; the entry just gets refreshed).
        let full = checks
            .iter()
            .zip(&decision.outcomes)
            .filter(|(c, o)| eligible(c) && c.hits == 1 && !o.allowed && o.remaining == 0)
            // A counter another request holds a temporary charge on (a Cluster request spanning
            // slots, undone when another slot denies) may be free again a moment later.
            .filter(|(c, _)| self.finality.is_final(&c.key))
            .map(|(c, o)| {
                let until = if o.retry_after == Duration::MAX {
                    o.reset
                } else {
                    o.retry_after
                };
                (c, until)
            })
            .filter(|(_, until)| *until > Duration::ZERO);
        let mut entries: Option<MutexGuard<'_, Entries>> = None;
        for (c, until) in full {
            let entries = entries.get_or_insert_with(|| self.lock());
            let deny_until = now.saturating_add(until);
            if let Some(e) = entries.map.get_mut(&c.key) {
                e.deny_until = e.deny_until.max(deny_until);
                continue;
            }
            let bytes = entry_bytes(&c.key);
            if entries.bytes + bytes > self.max_bytes {
                entries.purge_expired(now);
                if entries.bytes + bytes > self.max_bytes {
                    continue;
                }
            }
            entries.insert(c.key.clone(), Entry { deny_until, bytes });
        }
    }
}

impl<S: CounterStore> CounterStore for LocalDenyCache<S> {
    fn decide<'a>(
        &'a self,
        checks: &'a [LimitCheck],
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        Box::pin(async move {
            let now = self.clock.now();
            let Some(mut local) = self.lookup(checks, now) else {
                let decision = self.inner.decide(checks).await?;
                self.remember(checks, &decision, now);
                return Ok(decision);
            };
            // Recording checks not answered here are still charged (envoyproxy charges every
            // key not in its over-limit cache), unless the request stops charging when a key
            // is over (STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT): then nothing is. Candidate
            // checks ride in that call if there is one; never does a call happen for them
            // alone (the service decides them apart, off the answer path).
            let stop = checks.iter().any(|c| c.stop_over && !c.candidate);
            let mut rest: Vec<usize> = (0..checks.len())
                .filter(|&i| {
                    let c = &checks[i];
                    !c.candidate && !stop && c.record && local.outcomes[i].allowed
                })
                .collect();
            if rest.is_empty() {
                #[cfg(any(test, feature = "test-util"))]
                self.local_denials.fetch_add(1, Ordering::Relaxed);
                local.outcomes.truncate(super::enforced_len(checks));
                local.beside_apart = checks.iter().any(|c| c.candidate);
                return Ok(local);
            }
            rest.extend((0..checks.len()).filter(|&i| checks[i].candidate));
            let sub: Vec<LimitCheck> = rest.iter().map(|&i| checks[i].clone()).collect();
            let decision = self
                .inner
                .decide(&sub)
                .await
                .map_err(|e| e.widened(&rest, checks.len()))?;
            self.remember(&sub, &decision, now);
            for (&i, o) in rest.iter().zip(&decision.outcomes) {
                local.outcomes[i] = *o;
            }
            local.beside_lost = decision.beside_lost;
            // Candidates the store left apart have no outcome: none is left in their place.
            if decision.beside_apart {
                local.outcomes.truncate(super::enforced_len(checks));
                local.beside_apart = true;
            }
            local.local = false;
            local.steps = decision.steps;
            Ok(local)
        })
    }

    fn probe(&self) -> BoxFuture<'_, bool> {
        self.inner.probe()
    }
}

impl<S: WriteBack> WriteBack for LocalDenyCache<S> {
    fn write_back<'a>(
        &'a self,
        checks: &'a [LimitCheck],
        token: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.inner.write_back(checks, token, ttl)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::config::Unit;
    use crate::store::fake::FakeStore;

    // A minute window starts at every multiple of 60 s; start 10 s into one.
    const T0: Duration = Duration::from_secs(60 * 1_000_000 + 10);

    type Cache = LocalDenyCache<Arc<FakeStore>>;

    fn setup_with(
        max_bytes: usize,
        finality: DenialFinality,
    ) -> (Arc<FakeStore>, Cache, ManualClock) {
        let clock = ManualClock::new(T0);
        let store = Arc::new(FakeStore::new(Arc::new(clock.clone())));
        let cache =
            LocalDenyCache::new(store.clone(), max_bytes, Arc::new(clock.clone()), finality);
        (store, cache, clock)
    }

    fn setup(max_bytes: usize) -> (Arc<FakeStore>, Cache, ManualClock) {
        setup_with(max_bytes, DenialFinality::Always)
    }

    fn check(value: &str, limit: u32) -> LimitCheck {
        LimitCheck::for_tests(
            "d",
            value,
            crate::config::Limit::fixed(limit, Unit::Minute),
            1,
        )
    }

    fn key(value: &str, limit: u32) -> CounterKey {
        check(value, limit).key
    }

    fn calls(s: &FakeStore) -> usize {
        s.calls()
    }

    #[tokio::test]
    async fn a_full_counter_is_denied_locally_until_its_window_resets() {
        let (store, cache, clock) = setup(1 << 20);
        let c = [check("a", 2)];
        assert!(cache.decide(&c).await.unwrap().admitted);
        assert!(cache.decide(&c).await.unwrap().admitted);
        assert!(cache.is_empty(), "an admitted request is never cached");
        let denied = cache.decide(&c).await.unwrap();
        assert!(!denied.admitted);
        assert_eq!(cache.len(), 1);
        assert_eq!(cache.bytes(), entry_bytes(&c[0].key));
        assert_eq!(calls(&store), 3);

        clock.advance(Duration::from_secs(20));
        let local = cache.decide(&c).await.unwrap();
        assert_eq!(calls(&store), 3, "answered without the store");
        assert_eq!(cache.local_denials(), 1);
        assert_eq!(
            local,
            Decision {
                at: crate::store::DecidedAt::Unknown,
                admitted: false,
                outcomes: vec![Outcome {
                    allowed: false,
                    remaining: 0,
                    reset: Duration::from_secs(30),
                    retry_after: Duration::from_secs(30),
                }],
                local: true,
                steps: 0,
                beside_lost: false,
                beside_apart: false,
                leases: Vec::new(),
            }
        );

        // At the reset the entry is dead: the store decides again (new window, admitted).
        clock.advance(Duration::from_secs(30));
        assert!(cache.decide(&c).await.unwrap().admitted);
        assert_eq!(calls(&store), 4);
        assert_eq!(cache.local_denials(), 1);
        assert!(cache.is_empty(), "the expired entry was dropped on lookup");
    }

    #[tokio::test]
    async fn a_denial_a_temporary_charge_could_cause_is_never_cached() {
        let (store, cache, _clock) = setup_with(1 << 20, DenialFinality::DomainTaggedOnly);
        let c = [check("a", 1)];
        assert!(cache.decide(&c).await.unwrap().admitted);
        for n in 2..5 {
            assert!(!cache.decide(&c).await.unwrap().admitted);
            assert!(cache.is_empty(), "not final: not cached");
            assert_eq!(calls(&store), n, "every denial asks the store");
        }
        // A domain in one slot has no request spanning slots: its denials are final.
        let mut d = check("b", 1);
        d.key.domain_tag = true;
        let d = [d];
        assert!(cache.decide(&d).await.unwrap().admitted);
        assert!(!cache.decide(&d).await.unwrap().admitted);
        assert_eq!(cache.len(), 1);
        let before = calls(&store);
        assert!(!cache.decide(&d).await.unwrap().admitted);
        assert_eq!(calls(&store), before, "answered locally");
    }

    #[tokio::test]
    async fn other_checks_of_a_locally_denied_request_are_not_read_or_charged() {
        let (store, cache, _clock) = setup(1 << 20);
        let full = check("full", 1);
        assert!(
            cache
                .decide(std::slice::from_ref(&full))
                .await
                .unwrap()
                .admitted
        );
        assert!(
            !cache
                .decide(std::slice::from_ref(&full))
                .await
                .unwrap()
                .admitted
        );
        let before = calls(&store);

        let other = check("other", 10);
        let d = cache.decide(&[other.clone(), full.clone()]).await.unwrap();
        assert_eq!(calls(&store), before);
        assert!(!d.admitted);
        assert_eq!(
            d.outcomes[0],
            Outcome {
                allowed: true,
                remaining: 0,
                reset: Duration::ZERO,
                retry_after: Duration::ZERO,
            }
        );
        assert!(!d.outcomes[1].allowed);
        assert_eq!(d.outcomes[1].remaining, 0);
        assert_eq!(d.outcomes[1].reset, Duration::from_secs(50));
        // `other` was charged nothing: it still has all 10.
        let d = cache.decide(&[other]).await.unwrap();
        assert_eq!(d.outcomes[0].remaining, 9);
    }

    #[tokio::test]
    async fn a_changed_limit_is_never_served_stale() {
        let (store, cache, _clock) = setup(1 << 20);
        let small = check("a", 1);
        assert!(
            cache
                .decide(std::slice::from_ref(&small))
                .await
                .unwrap()
                .admitted
        );
        assert!(
            !cache
                .decide(std::slice::from_ref(&small))
                .await
                .unwrap()
                .admitted
        );
        assert_eq!(cache.len(), 1);
        let before = calls(&store);
        // Same descriptor, higher limit (a config change): goes to the store, is admitted.
        assert!(cache.decide(&[check("a", 5)]).await.unwrap().admitted);
        // An override with the same numbers is another counter too.
        let mut over = check("a", 1);
        over.key.overridden = true;
        assert!(cache.decide(&[over]).await.unwrap().admitted);
        assert_eq!(calls(&store), before + 2);
        assert_eq!(cache.local_denials(), 0);
    }

    #[tokio::test]
    async fn shadow_refund_and_check_only_never_use_or_fill_it() {
        let (store, cache, _clock) = setup(1 << 20);
        // A shadow limit that is full: denied by the math, never cached.
        let mut shadow = check("s", 0);
        shadow.shadow = true;
        let d = cache.decide(std::slice::from_ref(&shadow)).await.unwrap();
        assert!(!d.outcomes[0].allowed);
        assert!(cache.is_empty());

        // A check-only (hits 0) on a full counter neither fills nor uses the cache.
        let full = check("f", 0);
        let mut peek = full.clone();
        peek.hits = 0;
        assert!(
            !cache
                .decide(std::slice::from_ref(&peek))
                .await
                .unwrap()
                .admitted
        );
        assert!(cache.is_empty());
        assert!(
            !cache
                .decide(std::slice::from_ref(&full))
                .await
                .unwrap()
                .admitted
        );
        assert_eq!(cache.len(), 1);
        let before = calls(&store);
        assert!(!cache.decide(&[peek]).await.unwrap().admitted);
        assert_eq!(calls(&store), before + 1, "hits 0 asks the store");
        assert_eq!(cache.local_denials(), 0);
    }

    #[tokio::test]
    async fn a_refund_drops_the_entry() {
        let (store, cache, _clock) = setup(1 << 20);
        let c = check("r", 1);
        assert!(
            cache
                .decide(std::slice::from_ref(&c))
                .await
                .unwrap()
                .admitted
        );
        assert!(
            !cache
                .decide(std::slice::from_ref(&c))
                .await
                .unwrap()
                .admitted
        );
        assert_eq!(cache.len(), 1);
        let mut refund = c.clone();
        refund.refund = true;
        let before = calls(&store);
        cache.decide(&[refund]).await.unwrap();
        assert_eq!(
            calls(&store),
            before + 1,
            "a refund always reaches the store"
        );
        assert!(cache.is_empty());
        assert_eq!(cache.bytes(), 0);
        assert!(cache.decide(&[c]).await.unwrap().admitted);
    }

    #[tokio::test]
    async fn no_denial_walks_a_full_cache() {
        // An attack spread over many keys against a full cache: every insert that does not fit
        // purges, and a purge looks at a bounded number of entries whatever the cache holds
        // (a purge over the whole map looked at every entry: 1 000 here, each time).
        let one = entry_bytes(&key("k000000", 0));
        let (_store, cache, clock) = setup(one * 1000);
        for i in 0..1000 {
            cache
                .decide(&[check(&format!("k{i:06}"), 0)])
                .await
                .unwrap();
        }
        assert_eq!(cache.len(), 1000);
        // A full cache of live entries, then of expired ones, under 100 000 new denied keys.
        for i in 1000..50_000 {
            cache
                .decide(&[check(&format!("k{i:06}"), 0)])
                .await
                .unwrap();
        }
        assert_eq!(cache.len(), 1000, "live entries stay; new ones are skipped");
        clock.advance(Duration::from_secs(60));
        for i in 50_000..101_000 {
            cache
                .decide(&[check(&format!("k{i:06}"), 0)])
                .await
                .unwrap();
            assert!(cache.bytes() <= cache.max_bytes());
        }
        assert!(
            cache.max_purge_visits() <= PURGE_BUDGET as u64,
            "a purge looked at {} entries",
            cache.max_purge_visits()
        );
        assert_eq!(cache.len(), 1000, "expired entries gave way to new ones");
    }

    #[tokio::test]
    async fn memory_stays_within_the_budget() {
        let one = entry_bytes(&key("v00", 0));
        let (store, cache, clock) = setup(one * 3 + one / 2);
        // Limit 0: every request is denied with remaining 0 and fills an entry.
        for i in 0..5 {
            let c = check(&format!("v{i:02}"), 0);
            assert!(!cache.decide(&[c]).await.unwrap().admitted);
            assert!(cache.bytes() <= cache.max_bytes());
        }
        assert_eq!(cache.len(), 3, "inserts beyond the budget are skipped");
        assert_eq!(cache.bytes(), one * 3);
        // The first three are answered locally; the skipped ones go to the store.
        let before = calls(&store);
        for i in 0..3 {
            cache
                .decide(&[check(&format!("v{i:02}"), 0)])
                .await
                .unwrap();
        }
        assert_eq!(calls(&store), before);
        cache.decide(&[check("v03", 0)]).await.unwrap();
        assert_eq!(calls(&store), before + 1);

        // Once the entries expired, a new insert first drops them, then fits.
        clock.advance(Duration::from_secs(60));
        assert!(!cache.decide(&[check("v04", 0)]).await.unwrap().admitted);
        assert_eq!(cache.len(), 1);
        assert_eq!(cache.bytes(), one);
    }

    #[tokio::test]
    async fn a_zero_budget_caches_nothing() {
        let (_store, cache, _clock) = setup(0);
        let c = check("z", 0);
        for _ in 0..3 {
            assert!(
                !cache
                    .decide(std::slice::from_ref(&c))
                    .await
                    .unwrap()
                    .admitted
            );
        }
        assert!(cache.is_empty());
        assert_eq!(cache.local_denials(), 0);
    }

    #[tokio::test]
    async fn errors_and_probes_pass_through() {
        let down = FakeStore::failing(StoreError::Transient("down".into()));
        let cache = LocalDenyCache::new(
            down,
            1024,
            Arc::new(ManualClock::new(T0)),
            DenialFinality::Always,
        );
        assert!(matches!(
            cache.decide(&[check("x", 1)]).await,
            Err(StoreError::Transient(_))
        ));
        assert!(!cache.probe().await);
    }

    #[test]
    fn entry_size_counts_the_key_strings() {
        let k = CounterKey {
            domain: Arc::from("dom"),
            entries: Arc::from(vec![
                ("ab".to_string(), "cde".to_string()),
                ("f".to_string(), String::new()),
            ]),
            limit: crate::config::Limit::fixed(1, Unit::Second),
            overridden: false,
            domain_tag: false,
            own_tag: false,
            candidate: false,
        };
        assert_eq!(entry_bytes(&k), 3 + 2 + 3 + 1 + ENTRY_OVERHEAD);
    }
}
