//! What a replica learns while the store answers, for the day it must decide alone: how many
//! replicas share the store (their heartbeats) and, per counter it decided, what the store said
//! was left and until when. Its share of a limit is then an equal split of that: the `replicas`
//! shares of `x` are `x / replicas`, and the first `x % replicas` replicas by rank take one
//! more, so the shares add up to exactly `x`.

use crate::store::memory::with_key_bytes;
use crate::store::{CounterKey, Decision, LimitCheck};
use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// How many replicas share the store and this one's place among them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Roster {
    /// Replicas alive at the last heartbeat (this one included); at least 1.
    pub replicas: u32,
    /// This replica's rank among them; `None` while unknown (it takes the larger share).
    pub rank: Option<u32>,
}

impl Roster {
    /// Before any heartbeat: `replicas` as configured (`LOCAL_REPLICAS`), rank unknown.
    pub fn assumed(replicas: u32) -> Self {
        Self {
            replicas: replicas.max(1),
            rank: None,
        }
    }

    /// This replica's share of `x`. Without a rank it takes the larger share (the split may
    /// then admit up to `replicas - 1` more than `x` in all).
    pub fn share(self, x: u32) -> u32 {
        let n = self.replicas.max(1);
        let (base, rest) = (x / n, x % n);
        let extra = match self.rank {
            Some(r) => r < rest,
            None => rest > 0,
        };
        base + u32::from(extra)
    }
}

/// What the store said about one counter at its last answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Learned {
    /// Hits left after that answer.
    pub remaining: u32,
    /// When that stops being true (the answer's time plus its reset), microseconds since the
    /// epoch.
    pub until_us: u64,
}

const SHARDS: usize = 16;

/// A map keyed by a keyed 64-bit fingerprint of the counter (random per process, so a client
/// cannot aim for a collision; two counters share one with probability 2^-64 per pair, which
/// would only mix up what they learned): no key is cloned or compared on the healthy path.
type ByFingerprint = HashMap<u64, Learned, BuildHasherDefault<Identity>>;

/// The fingerprint is already a keyed hash: used as it is.
#[derive(Debug, Default)]
struct Identity(u64);

impl Hasher for Identity {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The learned counters (bounded: a full shard learns nothing new until its expired entries are
/// swept) and the roster.
#[derive(Debug)]
pub struct Shares {
    shards: Vec<Mutex<ByFingerprint>>,
    hasher: RandomState,
    per_shard: usize,
    roster: Mutex<Roster>,
    /// Counters not learned because their shard was full.
    pub skipped: AtomicU64,
    sweep_next: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Plain data always left consistent: a panic elsewhere does not make it unusable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shares {
    pub fn new(max_counters: usize, roster: Roster) -> Self {
        Self {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(ByFingerprint::default()))
                .collect(),
            hasher: RandomState::new(),
            per_shard: max_counters.div_ceil(SHARDS),
            roster: Mutex::new(roster),
            skipped: AtomicU64::new(0),
            sweep_next: AtomicU64::new(0),
        }
    }

    fn fingerprint(&self, key: &CounterKey) -> u64 {
        with_key_bytes(key, |bytes| self.hasher.hash_one(bytes))
    }

    fn shard(&self, fp: u64) -> &Mutex<ByFingerprint> {
        &self.shards[(fp >> 60) as usize % SHARDS]
    }

    pub fn roster(&self) -> Roster {
        *lock(&self.roster)
    }

    pub fn set_roster(&self, roster: Roster) {
        *lock(&self.roster) = roster;
    }

    /// Remembers what the store answered for each charged or checked counter of a request.
    pub fn learn(&self, checks: &[LimitCheck], decision: &Decision, now_us: u64) {
        for (c, o) in checks.iter().zip(&decision.outcomes) {
            if c.refund {
                continue;
            }
            let reset = u64::try_from(o.reset.as_micros()).unwrap_or(u64::MAX);
            let learned = Learned {
                remaining: o.remaining,
                until_us: now_us.saturating_add(reset),
            };
            let fp = self.fingerprint(&c.key);
            let mut shard = lock(self.shard(fp));
            if let Some(e) = shard.get_mut(&fp) {
                *e = learned;
            } else if shard.len() < self.per_shard {
                shard.insert(fp, learned);
            } else {
                self.skipped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// What the store said about `key`, if it still holds at `now_us`.
    pub fn learned(&self, key: &CounterKey, now_us: u64) -> Option<Learned> {
        let fp = self.fingerprint(key);
        lock(self.shard(fp))
            .get(&fp)
            .copied()
            .filter(|l| l.until_us > now_us)
    }

    /// Drops one shard's expired entries (the background task calls it, one shard per tick, so
    /// no request ever waits for a sweep).
    pub fn sweep_one(&self, now_us: u64) {
        let i = self.sweep_next.fetch_add(1, Ordering::Relaxed) as usize % SHARDS;
        lock(&self.shards[i]).retain(|_, l| l.until_us > now_us);
    }

    /// Counters learned (expired ones not yet swept included).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_add_up_to_the_whole() {
        for replicas in 1..=7 {
            for x in [0, 1, 2, 5, 99, 100, 600] {
                let total: u32 = (0..replicas)
                    .map(|r| {
                        Roster {
                            replicas,
                            rank: Some(r),
                        }
                        .share(x)
                    })
                    .sum();
                assert_eq!(total, x, "{x} among {replicas}");
            }
        }
        // Without a rank every replica takes the larger share.
        assert_eq!(Roster::assumed(3).share(10), 4);
        assert_eq!(Roster::assumed(3).share(9), 3);
    }
}
