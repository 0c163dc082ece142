//! A region's pool of a global limit: the units of one of the limit's windows this region
//! holds from the home store, kept in the region's own store so every replica of the region
//! takes slices from the same pool and one of them at a time refills it. One pool per window:
//! the next window's, filled 2 s ahead, and a replica whose clock is ahead leave the current
//! window's pool whole (one pool per limit moved on at the prefill and denied the current
//! window's last seconds: `tests/cases/global_model.rs`). One atomic operation
//! per call ([`PoolOp`]), on Redis (`store/redis/pool.lua`) or, for a region of one process on
//! the embedded store, in memory ([`MemoryPool`]). Times are the pool's own clock (Redis
//! `TIME`), so replicas whose clocks differ agree on a lease and on idleness.

use crate::clock::Clock;
use crate::store::{BoxFuture, CounterKey, StoreError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One operation on a pool, for the window that starts at a given millisecond.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolOp {
    /// Takes units for a replica's slice, if the pool has them.
    Take(u64),
    /// Gives a slice's unspent `units` back, taken when the pool was cleared for `cleared`
    /// (`PoolState::cleared` at the slice's grants): refused if the pool was cleared for a
    /// later reset since (they are on the count home forgot). `ok`: given back.
    Give { units: u64, cleared: u64 },
    /// Takes the refill lease for `lease_ms` with `token` (refused while another holds it).
    Lock { token: u64, lease_ms: u64 },
    /// Adds units granted by home, and releases `token`'s lease; `dry_ms` > 0: the home store
    /// had nothing left, no refill for that long. `fence`: the reset home's counter was fenced
    /// past when they were charged (0: none); a pool not yet cleared for it is cleared first
    /// (they are on the fresh count; what it holds may not be), and units charged before a
    /// fence the pool has seen are dropped (on the count that reset forgot: `ok` 0).
    Fill {
        units: u64,
        token: u64,
        dry_ms: u64,
        fence: u64,
    },
    /// Drains every unit not taken (to return home) if no take came for `idle_ms` and nothing
    /// is owed home (a pool holding credit is settled first: `Settle`).
    Drain { idle_ms: u64 },
    /// Drains what the pool holds beyond `keep` units not taken (to return home), whether or
    /// not a replica took from it lately, if no refill runs, nothing is owed home and the pool
    /// was granted `have` units (as the caller last saw it: a refill that landed since is not
    /// trimmed): the region's demand fell while home is nearly dry (`moved.rs`). `ok`: the
    /// units drained.
    Trim { keep: u64, have: u64 },
    /// Home did not answer a refill and the region is cut off (`GLOBAL_UNREACHABLE=share`):
    /// adds what is left of the window's `share` on credit (each window's credit is `share` at
    /// most, however many replicas ask, and is owed home), marks the pool dry for `dry_ms`
    /// and releases `token`'s lease. `ok`: the units added.
    Credit { share: u64, token: u64, dry_ms: u64 },
    /// `units` of credit were charged at home: they are owed no more.
    Settle(u64),
    /// The reset of home record `seq` (`admin.rs`): the pool counts afresh, its units
    /// dropped (not given back: home forgot them), nothing taken or owed; a refill's lease
    /// stays. Only if the pool was not cleared for `keep_from` (at most `seq`; 0: `seq`) or
    /// later: every replica of the region applies it, and a second clear would drop what a
    /// refill brought from the fresh count; a reset's closing record keeps a pool cleared for
    /// its fence (a refill charged after home's reset cleared it as it landed). `ok`: the
    /// units dropped.
    Clear { seq: u64, keep_from: u64 },
}

impl PoolOp {
    /// A clear's `keep_from`, at most its record (0: the record itself, as on Redis).
    pub fn keep_from(&self) -> u64 {
        match *self {
            PoolOp::Clear { seq, keep_from: 0 } => seq,
            PoolOp::Clear { seq, keep_from } => keep_from.min(seq),
            _ => 0,
        }
    }
}

/// A pool as one operation left it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolState {
    /// Whether the operation was done (a take that fit, a lease taken); for a drain, the
    /// units drained.
    pub ok: u64,
    /// Units granted to the region this window, and taken by its replicas.
    pub have: u64,
    pub taken: u64,
    /// Until when (pool ms) the home store is known dry.
    pub dry_until: u64,
    /// The pool's clock (ms).
    pub now: u64,
    /// A refill's lease runs.
    pub locked: bool,
    /// The last refill's size (whichever replica made it).
    pub last_fill: u64,
    /// Units added on credit (`PoolOp::Credit`) not yet charged at home.
    pub owed: u64,
    /// When a replica last took from the pool (the pool's clock, ms).
    pub last_take: u64,
    /// The last home reset record the pool was cleared for (0: none): its units were all
    /// granted after that clear, which a refund of them shows home (`drain.rs`, `refund`).
    pub cleared: u64,
}

impl PoolState {
    /// Units in the pool not yet taken.
    pub fn left(&self) -> u64 {
        self.have.saturating_sub(self.taken)
    }
}

/// Where a region's pools live.
pub trait RegionPool: Send + Sync + std::fmt::Debug {
    /// Applies `op` to `key`'s pool for the window starting at `window_ms`; the pool lives
    /// `ttl_ms` past this call. A pool this call creates starts cleared for the last reset
    /// record this replica applied ([`RegionPool::stamp`]).
    fn run<'a>(
        &'a self,
        key: &'a CounterKey,
        window_ms: u64,
        op: PoolOp,
        ttl_ms: u64,
    ) -> BoxFuture<'a, Result<PoolState, StoreError>>;

    /// This replica has applied home's reset records up to `seq` (its pools cleared): a pool it
    /// creates from now on holds only units granted after those resets, and starts cleared
    /// for `seq`, so home takes back what it gives back ([`PoolState::cleared`]; without it, a
    /// pool first filled after a reset would have every give-back of that window refused).
    fn stamp(&self, seq: u64);
}

/// The last reset record a replica applied, for the pools it creates (never lowered).
#[derive(Debug, Default)]
pub struct Stamp(std::sync::atomic::AtomicU64);

impl Stamp {
    pub fn set(&self, seq: u64) {
        self.0.fetch_max(seq, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// A pool's fields (the Redis hash's, in memory).
#[derive(Debug, Clone, Default)]
struct Fields {
    have: u64,
    taken: u64,
    last: u64,
    lock: Option<(u64, u64)>,
    dry_until: u64,
    last_fill: u64,
    expires: u64,
    owed: u64,
    credited: u64,
    /// The last reset record this pool was cleared for.
    cleared: u64,
    /// The highest fence a fill carried (`PoolOp::Fill`).
    fenced: u64,
}

/// Pools in this process (a region of one replica on the embedded store), at most `max`.
#[derive(Debug)]
pub struct MemoryPool {
    clock: Arc<dyn Clock>,
    map: Mutex<HashMap<(CounterKey, u64), Fields>>,
    max: usize,
    stamp: Stamp,
}

impl MemoryPool {
    pub fn new(clock: Arc<dyn Clock>, max: usize) -> Self {
        Self {
            clock,
            map: Mutex::new(HashMap::new()),
            max: max.max(1),
            stamp: Stamp::default(),
        }
    }

    /// `None`: full of live pools that all hold credit (`GLOBAL_UNREACHABLE=share`), none of
    /// which may go: the new pool is refused (its grant fails and is denied).
    fn apply(&self, key: &CounterKey, w: u64, op: PoolOp, ttl_ms: u64) -> Option<PoolState> {
        let now = u64::try_from(self.clock.now().as_millis()).unwrap_or(u64::MAX);
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let slot = (key.clone(), w);
        if map.len() >= self.max && !map.contains_key(&slot) {
            map.retain(|_, f| f.expires > now);
            if map.len() >= self.max {
                // Full of live pools: the one expiring first goes (its units are stranded;
                // not the smallest window start, which is a token bucket's, live for an hour).
                // Never one that gave credit: a new pool of its key would give it again, and
                // what it owes home would never be charged (a caller flooding new values of a
                // wildcard could multiply a limit while cut off).
                let k = map
                    .iter()
                    .filter(|(_, f)| f.credited == 0)
                    .min_by_key(|(_, f)| f.expires)
                    .map(|(k, _)| k.clone())?;
                map.remove(&k);
            }
        }
        let f = map.entry(slot).or_default();
        if f.expires == 0 || f.expires <= now {
            *f = Fields {
                last: now,
                cleared: self.stamp.get(),
                ..Fields::default()
            };
        }
        let ok = f.apply(op, now);
        f.expires = now.saturating_add(ttl_ms.max(1));
        Some(PoolState {
            ok,
            have: f.have,
            taken: f.taken,
            dry_until: f.dry_until,
            now,
            locked: f.lock.is_some_and(|(_, until)| until > now),
            last_fill: f.last_fill,
            owed: f.owed,
            last_take: f.last,
            cleared: f.cleared,
        })
    }
}

impl Fields {
    /// [`PoolOp::Fill`]: `ok` 0 when units charged before a fence the pool has seen are dropped.
    fn fill(&mut self, units: u64, (token, dry_ms, fence): (u64, u64, u64), now: u64) -> u64 {
        let f = self;
        let mut ok = 1;
        let units = if fence < f.fenced {
            ok = u64::from(units == 0); // dropped: `ok` 0
            0
        } else {
            units
        };
        if fence > f.fenced && fence > f.cleared {
            (f.have, f.taken, f.owed, f.cleared) = (0, 0, 0, fence);
        }
        f.fenced = f.fenced.max(fence);
        f.have = f.have.saturating_add(units);
        if units > 0 {
            f.last_fill = units;
        }
        if dry_ms > 0 {
            f.dry_until = now.saturating_add(dry_ms);
        }
        if f.lock.is_some_and(|(t, _)| t == token) {
            f.lock = None;
        }
        ok
    }

    /// `op` on this pool at `now` (ms): [`PoolState::ok`].
    fn apply(&mut self, op: PoolOp, now: u64) -> u64 {
        let f = self;
        let mut ok = 1;
        match op {
            PoolOp::Take(0) => {} // a look at the pool: not a take
            PoolOp::Take(n) => {
                if f.have.saturating_sub(f.taken) >= n {
                    f.taken += n;
                    f.last = now;
                } else {
                    ok = 0;
                }
            }
            PoolOp::Give { units, cleared } if cleared >= f.cleared => {
                f.taken -= units.min(f.taken);
            }
            PoolOp::Give { .. } => ok = 0,
            PoolOp::Lock { token, lease_ms } => match f.lock {
                Some((t, until)) if t != token && until > now => ok = 0,
                _ => f.lock = Some((token, now.saturating_add(lease_ms))),
            },
            PoolOp::Fill {
                units,
                token,
                dry_ms,
                fence,
            } => ok = f.fill(units, (token, dry_ms, fence), now),
            PoolOp::Credit {
                share,
                token,
                dry_ms,
            } => {
                let units = share.saturating_sub(f.credited);
                f.have = f.have.saturating_add(units);
                f.owed = f.owed.saturating_add(units);
                f.credited = f.credited.saturating_add(units);
                f.dry_until = now.saturating_add(dry_ms);
                if f.lock.is_some_and(|(t, _)| t == token) {
                    f.lock = None;
                }
                ok = units;
            }
            PoolOp::Settle(n) => f.owed -= n.min(f.owed),
            PoolOp::Clear { seq, .. } if op.keep_from() > f.cleared => {
                ok = f.have.saturating_sub(f.taken);
                (f.have, f.taken, f.owed, f.cleared) = (0, 0, 0, seq);
            }
            PoolOp::Clear { .. } => ok = 0,
            PoolOp::Trim { keep, have } => {
                let locked = f.lock.is_some_and(|(_, until)| until > now);
                let left = f.have.saturating_sub(f.taken);
                ok = if !locked && f.owed == 0 && f.have == have && left > keep {
                    f.have -= left - keep;
                    left - keep
                } else {
                    0
                };
            }
            PoolOp::Drain { idle_ms } => {
                let locked = f.lock.is_some_and(|(_, until)| until > now);
                ok = if now.saturating_sub(f.last) >= idle_ms && !locked && f.owed == 0 {
                    let left = f.have.saturating_sub(f.taken);
                    f.have = f.taken;
                    left
                } else {
                    0
                };
            }
        }
        ok
    }
}

impl RegionPool for MemoryPool {
    fn run<'a>(
        &'a self,
        key: &'a CounterKey,
        window_ms: u64,
        op: PoolOp,
        ttl_ms: u64,
    ) -> BoxFuture<'a, Result<PoolState, StoreError>> {
        Box::pin(async move {
            self.apply(key, window_ms, op, ttl_ms).ok_or_else(|| {
                StoreError::Transient(
                    "the region's pools are full of pools that hold credit from a partition".into(),
                )
            })
        })
    }

    fn stamp(&self, seq: u64) {
        self.stamp.set(seq);
    }
}
