//! The embedded store: a sharded map of fixed-window counters behind short mutex sections. A
//! decision locks the shards it touches in index order (so two requests never deadlock), decides
//! on tentative states and commits only if the request is admitted. Expired counters are swept
//! from a shard when it is touched after its sweep deadline, so memory follows live traffic.

use super::{BoxFuture, CounterKey, CounterStore, Decision, LimitCheck, StoreError};
use crate::algorithm::{self, State};
use crate::clock::Clock;
use std::collections::hash_map::{DefaultHasher, Entry};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

const DEFAULT_SHARDS: usize = 64;
/// How often a shard is swept of expired counters; bounded work per sweep, amortised over traffic.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Counter {
    state: State,
    /// Microseconds since the epoch after which the state no longer matters.
    expires_at: u64,
}

#[derive(Debug, Default)]
struct Shard {
    counters: HashMap<CounterKey, Counter>,
    next_sweep: u64,
}

impl Shard {
    fn sweep(&mut self, now: u64) {
        if now < self.next_sweep {
            return;
        }
        self.counters.retain(|_, c| c.expires_at > now);
        self.next_sweep = now.saturating_add(SWEEP_EVERY.as_micros() as u64);
    }
}

/// In-process counters; the default store when no Redis is configured.
#[derive(Debug)]
pub struct MemoryStore {
    shards: Vec<Mutex<Shard>>,
    clock: Arc<dyn Clock>,
}

impl MemoryStore {
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self::with_shards(clock, DEFAULT_SHARDS)
    }

    pub fn with_shards(clock: Arc<dyn Clock>, shards: usize) -> Self {
        Self {
            shards: (0..shards.max(1)).map(|_| Mutex::default()).collect(),
            clock,
        }
    }

    /// Number of live counters (expired ones not yet swept included).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).counters.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard_of(&self, key: &CounterKey) -> usize {
        let mut h = DefaultHasher::new();
        key.hash(&mut h);
        (h.finish() % self.shards.len() as u64) as usize
    }

    fn decide_now(&self, checks: &[LimitCheck]) -> Decision {
        // Microseconds, as the algorithms and the Redis script count time.
        let now = u64::try_from(self.clock.now().as_micros()).unwrap_or(u64::MAX);
        let shard_ids: Vec<usize> = checks.iter().map(|c| self.shard_of(&c.key)).collect();
        let mut order = shard_ids.clone();
        order.sort_unstable();
        order.dedup();
        // Lock in ascending index order: concurrent multi-shard decisions cannot deadlock.
        let mut guards: HashMap<usize, MutexGuard<'_, Shard>> =
            order.iter().map(|&i| (i, lock(&self.shards[i]))).collect();

        // Tentative states: checks on the same counter see each other's hits.
        let mut pending: HashMap<&CounterKey, State> = HashMap::new();
        let mut outcomes = Vec::with_capacity(checks.len());
        let mut admitted = true;
        for (check, shard) in checks.iter().zip(&shard_ids) {
            let stored = guards
                .get(shard)
                .and_then(|g| g.counters.get(&check.key))
                .map(|c| &c.state);
            let current = pending.get(&check.key).or(stored);
            let (outcome, next) =
                algorithm::decide(current, now, check.params(), check.hits, check.mode());
            if !outcome.allowed && !check.shadow {
                admitted = false;
            }
            // A shadow limit that would deny lets the request through but, like an enforced
            // denial, charges nothing (`next` is then the unchanged state): its would-be
            // denials are exactly those enforcing it would produce.
            pending.insert(&check.key, next);
            outcomes.push(outcome);
        }

        if !admitted {
            // Nothing is charged, so report what each counter really has left, not what it
            // would have had after this request.
            for ((check, shard), outcome) in checks.iter().zip(&shard_ids).zip(&mut outcomes) {
                let stored = guards
                    .get(shard)
                    .and_then(|g| g.counters.get(&check.key))
                    .map(|c| &c.state);
                outcome.remaining =
                    algorithm::decide(stored, now, check.params(), 0, algorithm::Mode::Charge)
                        .0
                        .remaining;
            }
        } else {
            for (check, shard) in checks.iter().zip(&shard_ids) {
                if check.hits == 0 {
                    continue;
                }
                if let (Some(state), Some(g)) = (pending.get(&check.key), guards.get_mut(shard)) {
                    let counter = Counter {
                        state: state.clone(),
                        expires_at: algorithm::expires_at(state, check.params()),
                    };
                    match g.counters.entry(check.key.clone()) {
                        Entry::Occupied(mut e) => *e.get_mut() = counter,
                        Entry::Vacant(e) => {
                            e.insert(counter);
                        }
                    }
                }
            }
        }
        for g in guards.values_mut() {
            g.sweep(now);
        }
        Decision {
            admitted,
            outcomes,
            local: false,
        }
    }
}

/// A poisoned shard only means another request panicked mid-decision; its counters are still
/// plain integers, so keep serving rather than fail every later request.
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::config::Unit;

    fn check(value: &str, limit: u32, unit: Unit) -> LimitCheck {
        LimitCheck {
            key: CounterKey {
                domain: Arc::from("d"),
                entries: vec![("k".into(), value.into())],
                limit: crate::config::Limit::fixed(limit, unit),
                overridden: false,
                domain_tag: false,
            },
            hits: 1,
            refund: false,
            shadow: false,
        }
    }

    #[test]
    fn expired_counters_are_reclaimed() {
        let clock = ManualClock::new(Duration::from_secs(1_000_000));
        let store = MemoryStore::with_shards(Arc::new(clock.clone()), 4);
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
        // Past every second-window and the sweep interval: touching each shard sweeps it.
        clock.advance(SWEEP_EVERY + Duration::from_secs(1));
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
        let store = MemoryStore::with_shards(Arc::new(clock), 8);
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
        let store = Arc::new(MemoryStore::with_shards(Arc::new(clock), 4));
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
}
