//! Global limits across regions (`global: {}`): one budget that several regions share, with
//! the request path inside the region. Doorman's tree, two levels deep, on Redis:
//!
//! - the limit's counter lives in the **home store** (`GLOBAL_REDIS_URL`), which every region
//!   reaches (far away: 50-150 ms);
//! - each region keeps a **pool** of the current window in its own store ([`RegionPool`]),
//!   refilled from home by one replica at a time (a lease in the pool, taken over when its
//!   holder dies);
//! - replicas take their **slices** from the pool exactly as a leased limit's slices are taken
//!   from the store (`store/slices`): [`GlobalGrants`] is the store those slices are granted by.
//!
//! Why this shape: a grant from home is an ordinary all-or-nothing charge on the home counter,
//! pinned to the window, so home never grants past the limit whatever the regions do; a pool
//! never gives out more than home granted it; a slice never more than the pool gave. So the
//! total admitted in a window never exceeds the limit, and what is lost is what is unspent at
//! the window's end (pools and slices; [`GlobalTallies::stranded`]). No request waits on home
//! while its region's pool has units; a request that finds the pool dry waits (within its
//! deadline) for the one refill in flight, else is denied.
//!
//! - **Sizing.** A refill asks home for the region's demand over [`POOL_AHEAD_MS`] (the rate
//!   its replicas took units from the pool since the last refill, or since it asked home when
//!   they took all of it: `ask.rs`), at least the slice asked for and [`MIN_REFILL_SLICES`]
//!   slices, at most the region's max-min share of the window beside the other regions'
//!   reports (`fair.rs`) and, while those list no other region holding or taking units, a
//!   quarter of what home had left at the last refill (the pools shrink as the window fills,
//!   so regions share the tail). Below half of the last refill the pool is refilled ahead, in the
//!   background.
//! - **Giving back.** A slice a replica no longer spends goes back to the pool (idle, evicted,
//!   SIGTERM); a pool no replica took from for [`POOL_IDLE_MS`] goes back home (a refund on the
//!   window's home counter), so demand that moves to another region finds the units at home.
//! - **Home unreachable.** A refill that fails leaves the pool as it is: the region spends what
//!   it holds, then denies (`GLOBAL_UNREACHABLE=deny`), or admits its stated share of the
//!   limit on credit, charged home once it answers (`share`, [`Share`]; docs/semantics.md).

mod admin;
mod ask;
mod drain;
mod fair;
mod known;
mod moved;
mod pool;
mod refund;
mod regions;
mod share;
mod tallies;

pub use admin::GlobalAdmin;
pub use fair::{grant_on_board, share_left, FairAsk, FairGrant, FRESH_MS};
pub use pool::{MemoryPool, PoolOp, PoolState, RegionPool, Stamp};
pub use regions::{Demand, MemoryBoard, RegionBoard, RegionReport, MAX_REGIONS};
pub use share::Share;
pub use tallies::GlobalTallies;

use known::{make_room, Known};

use super::{BoxFuture, CounterKey, CounterStore, Decision, LimitCheck, Outcome, StoreError};
use crate::clock::Clock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What one refill covers: the region's demand over this long (ms).
pub const POOL_AHEAD_MS: u64 = 5_000;
/// A refill is at least this many of the limit's largest slices.
pub const MIN_REFILL_SLICES: u64 = 4;
/// A pool no replica took from for this long goes back home (ms, on the pool's clock).
pub const POOL_IDLE_MS: u64 = 2_000;
/// How long a refill's lease lasts before another replica may take it over (ms): a holder
/// that died mid-refill delays its region's next refill this long at most.
pub const REFILL_LEASE_MS: u64 = 3_000;
/// How long before an epoch-aligned window's end the next window's pool is filled (ms).
pub const PREFILL_MS: u64 = 2_000;
/// After a refill home did not answer, the region's pool is dry this long (ms): its replicas
/// deny what their slices cannot admit at once instead of each waiting on home again.
pub const HOME_RETRY_MS: u64 = 1_000;
/// How long a call to the region's pools may take on Redis before it is given up (at least
/// `REDIS_TIMEOUT`). No request waits on these calls (slices are refilled in tasks of their
/// own), and a call given up on while Redis still runs it loses the units it moved: a take
/// whose reply never came is units home counted and nobody can spend. Seen on a busy CI
/// machine at `REDIS_TIMEOUT`'s 100 ms: the home counter one above what was admitted.
pub const POOL_PATIENCE: Duration = Duration::from_secs(5);
/// How often a replica waiting on another's refill looks at the pool again.
const POLL: Duration = Duration::from_millis(5);

/// What one refill got from home.
struct Asked {
    got: u64,
    /// Home had nothing left: the pool is dry this long.
    dry_ms: u64,
    /// What home had left, as its last answer said.
    home_left: u64,
    /// Home did not answer.
    failed: Option<StoreError>,
    /// The pool's clock and `taken` when the refill asked home (`ask.rs`: a refill that got
    /// units reads the region's next rate from then).
    asked_at: (u64, u64),
    /// Home capped it at the region's share (`fair.rs`): the region is short.
    capped: bool,
    /// The reset record home's counter was fenced past (0: none): the pool is cleared for it
    /// before the units land (`land`).
    fence: u64,
}

/// The store a global limit's slices are granted by: the region's pool, refilled from home.
#[derive(Debug)]
pub struct GlobalGrants {
    pool: Arc<dyn RegionPool>,
    home: Arc<dyn CounterStore>,
    clock: Arc<dyn Clock>,
    known: Mutex<HashMap<(CounterKey, u64), Known>>,
    pub tallies: Arc<GlobalTallies>,
    /// The replica stops: no refill starts any more (its pools are being given back home).
    stopping: std::sync::atomic::AtomicBool,
    /// This replica's refills under way (from before their lease to their fill): the pools
    /// are given back home once they have landed.
    refilling: std::sync::atomic::AtomicUsize,
    /// Where refills and drains run: the runtime this was built on, never the serving thread
    /// of the request that started them (it ends at shutdown, cancelling what runs on it).
    background: crate::store::Background,
    /// `GLOBAL_UNREACHABLE=share`: the part of each limit a region cut off admits on credit.
    share: std::sync::OnceLock<Share>,
    /// Where this region reports its pools at home (`regions.rs`), for the operators' view.
    reporting: std::sync::OnceLock<regions::Reporting>,
    /// The other regions' reports, as the last report home answered them (`fair.rs`).
    boards: fair::Boards,
    /// The last home reset record seen, and the stamp cap (`admin.rs`; `None`: not read yet).
    resets_seen: Mutex<Option<(u64, u64)>>,
}

impl GlobalGrants {
    pub fn new(
        pool: Arc<dyn RegionPool>,
        home: Arc<dyn CounterStore>,
        clock: Arc<dyn Clock>,
    ) -> Arc<Self> {
        Arc::new(Self {
            pool,
            home,
            clock,
            known: Mutex::new(HashMap::new()),
            tallies: Arc::default(),
            stopping: std::sync::atomic::AtomicBool::new(false),
            refilling: std::sync::atomic::AtomicUsize::new(0),
            background: crate::store::Background::here(),
            share: std::sync::OnceLock::new(),
            reporting: std::sync::OnceLock::new(),
            boards: fair::Boards::default(),
            resets_seen: Mutex::new(None),
        })
    }

    /// The home store (for operators: inspect and reset reach the global counter there).
    pub fn home(&self) -> &Arc<dyn CounterStore> {
        &self.home
    }

    /// How long a pool lives past its last use: to its window's end and a minute more (a
    /// drain or a late give-back still finds it), or an hour for a token bucket's.
    fn ttl_ms(window: Option<(u64, u64)>, now_ms: u64) -> u64 {
        match window {
            Some((_, end)) if end != u64::MAX => {
                (end / 1000).saturating_sub(now_ms).saturating_add(60_000)
            }
            _ => 3_600_000,
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.clock.now().as_millis()).unwrap_or(u64::MAX)
    }

    /// A grant of `check.hits` for a slice (or, `check.refund`, a slice given back), and
    /// whether it was denied because home did not answer (cut off, nothing on credit).
    async fn grant(self: &Arc<Self>, check: &LimitCheck) -> Result<(Outcome, bool), StoreError> {
        let window = check.window;
        let window_ms = window_ms(window);
        let ttl = Self::ttl_ms(window, self.now_ms());
        let key = &check.key;
        let n = check.hits;
        if check.refund {
            return self.give_back(check, ttl).await;
        }
        // Known before the first take: it records the reset the units count after, which the
        // slice they go to reads (`CounterStore::cleared`).
        let _ = self.known(key, window);
        let mut st = self.take(key, window_ms, n, ttl).await?;
        self.seen(&st);
        // Up to three refills; every take is judged, the last one's too (a take that succeeded
        // and was answered as a denial left its units taken from the pool by no one).
        for refills in 0..=3 {
            if st.ok == 1 {
                let k = self.known(key, window);
                self.prefill_next(check, &k);
                if !k.draining {
                    self.drain_later(key, window, window_ms);
                }
                if st.left() < st.last_fill.max(k.last_refill) / 2 && !k.ahead {
                    self.update(key, window_ms, |k| k.ahead = true);
                    let me = Arc::clone(self);
                    let check = check.clone();
                    self.background.spawn(async move {
                        let _ = me.refill(&check, window_ms, ttl, 0).await;
                        me.update(&check.key, window_ms, |k| k.ahead = false);
                    });
                }
                let home_left = if k.home_left == u64::MAX {
                    0
                } else {
                    k.home_left
                };
                return Ok((
                    outcome(
                        true,
                        st.left().saturating_add(home_left),
                        window,
                        self.now_ms(),
                    ),
                    false,
                ));
            }
            if refills == 3 || st.dry_until > st.now {
                break; // home had nothing left a moment ago, or enough refills
            }
            let _ = self.known(key, window); // (a region's first take in the window)
            self.update(key, window_ms, |k| k.starved = true);
            // The whole take: the refill judges the pool it finds against it (what it lacks
            // now would be judged against the pool's total and seem enough).
            if self.refill(check, window_ms, ttl, n).await.is_err() && !self.shares() {
                // Home did not answer: cut off, the region denies what its pool cannot give
                // (never a limit of its own; docs/semantics.md, "Global limits"). With
                // `share`, the refill left the window's share on credit in the pool.
                return Ok((outcome(false, st.left(), window, self.now_ms()), true));
            }
            st = self.take(key, window_ms, n, ttl).await?;
            self.seen(&st);
        }
        Ok((outcome(false, st.left(), window, self.now_ms()), false))
    }

    /// A slice's units given back to the pool (`check.refund`).
    async fn give_back(
        self: &Arc<Self>,
        check: &LimitCheck,
        ttl: u64,
    ) -> Result<(Outcome, bool), StoreError> {
        let (key, window, n) = (&check.key, check.window, check.hits);
        let window_ms = window_ms(window);
        // Taken after the reset this replica's last take saw (its slice drops what it held
        // from before when that rises: `slices/take.rs`): refused into a pool cleared for
        // a later one (on the count home forgot), counted forgiven.
        let cleared = self.known(key, window).cleared;
        let give = PoolOp::Give { units: n, cleared };
        let st = self
            .pool
            .run(key, window_ms, give, ttl)
            .await
            .inspect_err(|_| self.tallies.stranded.add(n))?;
        if st.ok == 0 {
            self.tallies.forgiven.add(n);
        }
        self.seen(&st);
        let _ = self.known(key, window);
        self.drain_later(key, window, window_ms);
        Ok((outcome(true, st.left(), window, self.now_ms()), false))
    }

    /// Takes `n` units from the pool for a slice. A take that fails may still have been done
    /// (its reply lost): its units are counted stranded, the most it can have lost.
    async fn take(
        &self,
        key: &CounterKey,
        window_ms: u64,
        n: u64,
        ttl: u64,
    ) -> Result<PoolState, StoreError> {
        let st = self
            .pool
            .run(key, window_ms, PoolOp::Take(n), ttl)
            .await
            .inspect_err(|_| self.tallies.stranded.add(n))?;
        if st.ok == 1 {
            // The reset these units count after: this replica's slice of them is kept by a
            // clear for it (`CounterStore::cleared`).
            self.update(key, window_ms, |k| k.cleared = k.cleared.max(st.cleared));
        }
        Ok(st)
    }

    /// Near the end of an epoch-aligned window, the region's pool of the next one is filled
    /// ahead (once per replica and window), sized as this window's last refill: at the
    /// window's start no request waits a round trip to home. Safe because both levels keep one
    /// counter per window: the region's pools (`pool.rs`) and home's fixed windows on Redis
    /// (`decide/head.lua`), so the next window's charge never touches the current one's.
    fn prefill_next(self: &Arc<Self>, check: &LimitCheck, k: &Known) {
        let Some((start, end)) = check.window else {
            return;
        };
        let now_ms = self.now_ms();
        let end_ms = end / 1000;
        if k.prefilled
            || end == u64::MAX
            || check.key.limit.period.calendar().is_some()
            || now_ms.saturating_add(PREFILL_MS) < end_ms
            || now_ms >= end_ms
        {
            return;
        }
        self.update(&check.key, k.window_ms, |k| k.prefilled = true);
        let mut next = check.clone();
        next.window = Some((end, end.saturating_add(end - start)));
        let next_ms = end_ms;
        let ttl = Self::ttl_ms(next.window, now_ms);
        let need = k.last_refill.max(1);
        let me = Arc::clone(self);
        self.background.spawn(async move {
            let _ = me.known(&next.key, next.window);
            let _ = me.refill(&next, next_ms, ttl, need).await;
        });
    }

    fn seen(&self, st: &PoolState) {
        self.tallies.pool_held.store(st.left(), Relaxed);
    }

    /// One refill of the region's pool from home, by whichever replica takes the lease; the
    /// others wait (polling the pool) until it lands or the lease runs out.
    async fn refill(
        self: &Arc<Self>,
        check: &LimitCheck,
        window_ms: u64,
        ttl: u64,
        need: u64,
    ) -> Result<(), StoreError> {
        use std::sync::atomic::Ordering::SeqCst;
        // Counted before the look at `stopping` (which the give-back sets before it waits for
        // the count to fall): a refill either sees it and asks home nothing, or lands first.
        let begun = self.begun(check.window); // before any call: `land`
        self.refilling.fetch_add(1, SeqCst);
        let _landed = Landed(&self.refilling);
        if self.stopping.load(SeqCst) {
            return Ok(());
        }
        let key = &check.key;
        let token = rand_token();
        let lease_ms = REFILL_LEASE_MS;
        let lock = self
            .pool
            .run(key, window_ms, PoolOp::Lock { token, lease_ms }, ttl)
            .await?;
        if lock.ok == 0 {
            return self.await_other(key, window_ms, ttl, &lock).await;
        }
        let k = self.known(key, check.window);
        // Credit from a partition is charged home first (`share.rs`): home answers again.
        if let Err(e) = self
            .settle(key, (check.window, window_ms), ttl, lock.owed)
            .await
        {
            let asked = Asked {
                got: 0,
                dry_ms: 0,
                home_left: k.home_left,
                failed: Some(e),
                asked_at: (0, 0),
                capped: false,
                fence: 0,
            };
            return self
                .land(key, (check.window, window_ms, begun), ttl, token, asked)
                .await;
        }
        // Another replica's refill may have landed since this one was decided on: the pool has
        // what was needed (or, ahead, half of this replica's last refill) - nothing to ask.
        let enough = if need == 0 { k.last_refill / 2 } else { need };
        // A window that ended meanwhile (a refill ahead that waited on the lease) gets nothing
        // more from home.
        let ended = check
            .window
            .is_some_and(|(_, end)| end != u64::MAX && self.now_ms() >= end / 1000);
        if lock.left() >= enough.max(1) || ended {
            let release = PoolOp::Fill {
                units: 0,
                token,
                dry_ms: 0,
                fence: 0,
            };
            self.pool.run(key, window_ms, release, ttl).await?;
            return Ok(());
        }
        let asked = self.sized_ask(check, &k, &lock, (need, begun)).await;
        self.land(key, (check.window, window_ms, begun), ttl, token, asked)
            .await
    }

    /// A refill's grant from home goes into the pool (and its lease is released), even if the
    /// window ended meanwhile (the watcher's last drain counts it stranded).
    async fn land(
        self: &Arc<Self>,
        key: &CounterKey,
        (window, window_ms, begun): (Option<(u64, u64)>, u64, bool),
        ttl: u64,
        token: u64,
        asked: Asked,
    ) -> Result<(), StoreError> {
        let Asked {
            got,
            mut dry_ms,
            home_left,
            failed,
            asked_at,
            fence,
            ..
        } = asked;
        let fill = if failed.is_some() {
            // Home is unreachable: the region denies what it cannot admit for a while, rather
            // than every request waiting on home again (with `share`, once its credit is out).
            // Not a window that has not begun (its pool filled ahead): no request waits on it
            // yet, and the link may heal before it begins (seed 1795939937946169814: the next
            // window's first 700 ms denied with home answering again), as the refill started.
            dry_ms = if begun { HOME_RETRY_MS } else { 0 };
            self.cut_off_fill(key, (window, begun), token, dry_ms)
        } else {
            // Charged after home's reset (fenced at `fence`): the pool is cleared for it as
            // they land (once), so the clears of the reset's records this replica applies later
            // drop the old count's units, not these (`ResetRecord::keep_from`); a refill charged
            // before a fence the pool has seen lands nothing.
            PoolOp::Fill {
                units: got,
                token,
                dry_ms,
                fence,
            }
        };
        let st = self.pool.run(key, window_ms, fill, ttl).await;
        match (&st, fill) {
            (Err(_), _) => self.tallies.stranded.add(got),
            (Ok(st), PoolOp::Credit { .. }) => self.tallies.shared.add(st.ok),
            _ => {}
        }
        self.tallies.home_answered(failed.is_none(), self.now_ms());
        if let Some(e) = failed {
            self.tallies.refill_failures.add(1);
            return Err(e);
        }
        self.tallies.refills.add(1);
        self.tallies.refilled.add(got);
        let st = st?;
        self.seen(&st);
        self.report(key, window, &st, self.demand_of(key, window_ms));
        if got > 0 {
            // Watched until it goes back: a refill ahead can land after the last take, when
            // the pool's watcher has left it empty (no take follows to watch it again). Known
            // again first: the bound on known pools may have dropped it meanwhile.
            let _ = self.known(key, window);
            self.drain_later(key, window, window_ms);
        }
        self.update(key, window_ms, |k| {
            k.starved &= got == 0;
            k.home_left = home_left;
            k.last_refill = got;
            k.taken_at = st.taken;
            k.at_ms = st.now;
            // The ask of the refill that landed (none when it got nothing): `ask.rs`.
            (k.asked_ms, k.taken_asked) = if got > 0 { asked_at } else { (0, 0) };
        });
        Ok(())
    }

    /// Another replica refills the pool: waits until its units land, it gives up (home dry or
    /// unreachable) or its lease runs out.
    async fn await_other(
        &self,
        key: &CounterKey,
        window_ms: u64,
        ttl: u64,
        seen: &PoolState,
    ) -> Result<(), StoreError> {
        let until = tokio::time::Instant::now() + Duration::from_millis(REFILL_LEASE_MS);
        while tokio::time::Instant::now() < until {
            tokio::time::sleep(POLL).await;
            let st = self.pool.run(key, window_ms, PoolOp::Take(0), ttl).await?;
            if st.have > seen.have {
                // Another replica's refill brought units: home answers.
                self.tallies.home_answered(true, self.now_ms());
            }
            if st.have != seen.have || st.dry_until > st.now || !st.locked {
                break;
            }
        }
        Ok(())
    }
}

impl CounterStore for Arc<GlobalGrants> {
    fn decide<'a>(
        &'a self,
        checks: &'a [LimitCheck],
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        Box::pin(async move {
            let mut outcomes = Vec::with_capacity(checks.len());
            let mut cut_off = false;
            for c in checks {
                let (o, cut) = self.grant(c).await?;
                cut_off |= cut;
                outcomes.push(o);
            }
            use crate::store::DecidedAt::{Fallback, Unknown};
            Ok(Decision {
                at: if cut_off { Fallback } else { Unknown }, // denied for want of home
                admitted: outcomes.iter().all(|o| o.allowed),
                outcomes,
                steps: 1,
                ..Decision::default()
            })
        })
    }

    fn probe(&self) -> BoxFuture<'_, bool> {
        self.home.probe()
    }

    fn wanted(&self, check: &LimitCheck) {
        // Each request at most a slice (the caller chooses its hits: a huge one must not size
        // its region's refills), and only while the pool is dry: a slice short while the pool
        // holds units is refilled from the pool, not from home.
        let slice = check.slice.map_or(1, |t| u64::from(t.max_slice));
        let now = self.now_ms();
        self.update(&check.key, window_ms(check.window), |k| {
            if !k.starved {
                return;
            }
            if k.wanted == 0 {
                k.wanted_ms = now;
            }
            k.wanted = k.wanted.saturating_add(check.hits.min(slice));
        });
    }

    fn cleared(&self, check: &LimitCheck) -> u64 {
        let map = self.known.lock().unwrap_or_else(|e| e.into_inner());
        map.get(&(check.key.clone(), window_ms(check.window)))
            .map_or(0, |k| k.cleared)
    }

    fn ahead_of_window(&self, check: &LimitCheck) {
        if check.key.limit.period.calendar().is_some() {
            return; // not filled ahead (`prefill_next`): looked at before any entry is made
        }
        let k = self.known(&check.key, check.window);
        self.prefill_next(check, &k);
    }
}

/// A slice's answer from the pool: `remaining` what the region (and home, as last seen) has.
fn outcome(allowed: bool, remaining: u64, window: Option<(u64, u64)>, now_ms: u64) -> Outcome {
    let reset = window.map_or(Duration::ZERO, |(_, end)| {
        Duration::from_micros(end.saturating_sub(now_ms.saturating_mul(1000)))
    });
    Outcome {
        allowed,
        remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
        reset,
        retry_after: if allowed { Duration::ZERO } else { reset },
    }
}

/// The charge (or, `back`, the refund) of `hits` on the home counter of `key` in `window`:
/// the slices' grant, one level up.
fn grant_check(key: &CounterKey, window: Option<(u64, u64)>, hits: u64, back: bool) -> LimitCheck {
    super::slices::charge_check(key, window, hits, back)
}

/// Counts a refill as landed when it ends, however it ends.
struct Landed<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for Landed<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The millisecond a window starts at, which names its pool (0: a token bucket's, no window).
fn window_ms(window: Option<(u64, u64)>) -> u64 {
    window.map_or(0, |(start, _)| start / 1000)
}

/// A refill lease's token: distinct per attempt (the pool releases only its own).
fn rand_token() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(NEXT.fetch_add(1, Relaxed));
    h.finish() >> 11 // at most 2^53: exact in Lua's numbers
}
