//! Giving a region's pool back home: once no replica of the region took from it for
//! [`POOL_IDLE_MS`](super::POOL_IDLE_MS) (a watcher per pool and replica, which also counts what
//! a window left unspent once it ends), and every pool a replica took from when it stops
//! (SIGTERM): demand that moves to another region, or a region scaled to zero, leaves the units
//! at home, where the other regions' refills find them.

use super::moved::{Looks, MOVED_TICK_MS, TRIM_TICK_MS};
use super::refund::Refund;
use super::regions::Demand;
use super::{window_ms, GlobalGrants, PoolOp, POOL_IDLE_MS, REFILL_LEASE_MS};
use crate::store::{CounterKey, CounterStore};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// Pools given back at once when a replica stops.
const GIVE_BACK_AT_ONCE: usize = 16;
/// Pools one replica watches every [`TRIM_TICK_MS`] at once, at most: the others near a dry
/// home are looked at every second, as any pool (each look is a call to the region's store:
/// a replica with thousands of global counters near dry must not make tens of thousands a
/// second). Demand that moves is then seen within a second for those, not 25 ms.
/// 16 at a look every 25 ms: the 640 looks a second 64 made at 100 ms.
pub(super) const MAX_FAST_WATCHES: usize = 16;

/// One watcher's claim on a fast tick (of [`MAX_FAST_WATCHES`]); given up when dropped.
pub(super) struct FastWatch<'a> {
    count: &'a AtomicUsize,
    held: bool,
}

impl<'a> FastWatch<'a> {
    pub(super) fn new(count: &'a AtomicUsize) -> Self {
        Self { count, held: false }
    }

    /// Claims a fast tick while `want` (if one is free), gives it up otherwise; whether held.
    pub(super) fn hold(&mut self, want: bool) -> bool {
        if want && !self.held {
            self.held = self
                .count
                .fetch_update(Relaxed, Relaxed, |n| {
                    (n < MAX_FAST_WATCHES).then_some(n + 1)
                })
                .is_ok();
        } else if !want && self.held {
            self.count.fetch_sub(1, Relaxed);
            self.held = false;
        }
        self.held
    }
}

impl Drop for FastWatch<'_> {
    fn drop(&mut self) {
        self.hold(false);
    }
}
/// No pool's give-back starts this close to its bound: its drain and refund go together.
const GIVE_BACK_MARGIN: Duration = Duration::from_millis(300);

impl GlobalGrants {
    /// Once the pool may be idle, drains it and gives its units back home.
    pub(super) fn drain_later(
        self: &Arc<Self>,
        key: &CounterKey,
        window: Option<(u64, u64)>,
        window_ms: u64,
    ) {
        {
            let mut map = self.known.lock().unwrap_or_else(|e| e.into_inner());
            match map.get_mut(&(key.clone(), window_ms)) {
                Some(k) if k.draining => {
                    k.poked = k.poked.wrapping_add(1);
                    return;
                }
                Some(k) => k.draining = true,
                None => return,
            }
        }
        let (me, key) = (Arc::clone(self), key.clone());
        self.background.spawn(async move {
            // A pool filled ahead for the next window is watched from that window's start.
            let start_ms = window.map_or(0, |(start, _)| start / 1000);
            // Never longer than a prefill's lead (a clock stepped back must not leave the pool
            // unwatched while `draining` keeps takes from watching it).
            let early = start_ms
                .saturating_sub(me.now_ms())
                .min(super::PREFILL_MS + POOL_IDLE_MS);
            tokio::time::sleep(Duration::from_millis(early)).await;
            loop {
                let seen = me.known(&key, window).poked;
                me.watch_idle(&key, window, window_ms).await;
                // The watch ends only if nothing came in since it began; else once more (the
                // flag and the look are one step under the lock: no give-back goes unwatched).
                let mut map = me.known.lock().unwrap_or_else(|e| e.into_inner());
                match map.get_mut(&(key.clone(), window_ms)) {
                    Some(k) if k.poked != seen => continue,
                    Some(k) => k.draining = false,
                    None => {}
                }
                break;
            }
        });
    }

    /// Until the pool is drained, empty or its window has passed: every [`POOL_IDLE_MS`], a
    /// drain (done only if no replica took from the pool meanwhile), its units given back home.
    /// Once the window is over, what the pool still holds is drained and counted stranded (by
    /// whichever watcher drains it first: each unit once).
    async fn watch_idle(
        self: &Arc<Self>,
        key: &CounterKey,
        window: Option<(u64, u64)>,
        window_ms: u64,
    ) {
        let end_ms = window.map_or(u64::MAX, |(_, end)| end / 1000);
        let mut looked = tokio::time::Instant::now();
        let mut looks = Looks::default();
        let mut fast = FastWatch::new(&self.tallies.fast_watches);
        loop {
            // Every 25 ms while home is nearly dry (`moved.rs`; [`MAX_FAST_WATCHES`] pools at
            // most), else every second (a look at this replica's memory); the ordinary
            // give-back every `POOL_IDLE_MS` and a little more.
            let tick = if fast.hold(self.near_dry(key, window_ms)) {
                TRIM_TICK_MS
            } else {
                1_000
            };
            tokio::time::sleep(Duration::from_millis(tick)).await;
            let now = self.now_ms();
            let ttl = Self::ttl_ms(window, now);
            if now >= end_ms {
                // Credit from a partition is charged home first, if home answers (a pool that
                // owes is never drained; unsettled, it expires with its window).
                let _ = self.settle_owed(key, (window, window_ms), ttl).await;
                // A refill still out holds the lease (and the drain back): once more after the
                // lease has run out, so what it brought is counted too.
                for _ in 0..2 {
                    let last = PoolOp::Drain { idle_ms: 0 };
                    match self.pool.run(key, window_ms, last, ttl).await {
                        Ok(st) if !st.locked => {
                            self.tallies.stranded.add(st.ok);
                            return;
                        }
                        Ok(st) => self.tallies.stranded.add(st.ok),
                        Err(_) => {}
                    }
                    tokio::time::sleep(Duration::from_millis(REFILL_LEASE_MS)).await;
                }
                return;
            }
            if looked.elapsed() < Duration::from_millis(POOL_IDLE_MS + 100) {
                if self
                    .near_dry_look((key, window, window_ms), &mut looks)
                    .await
                {
                    return;
                }
                continue;
            }
            looked = tokio::time::Instant::now();
            // Home unreachable (a partition): the pool keeps its units for when it answers, rather
            // than drain them into a refund that fails (whether a refund whose reply is lost was
            // applied is unknown: its units are counted stranded, never put back, never over).
            if !self.home.probe().await {
                continue;
            }
            // Home answers: credit from the partition is charged there before any unit goes
            // back (`share.rs`); the drain waits while anything is owed.
            let _ = self.settle_owed(key, (window, window_ms), ttl).await;
            let drain = PoolOp::Drain {
                idle_ms: POOL_IDLE_MS,
            };
            let Ok(st) = self.pool.run(key, window_ms, drain, ttl).await else {
                continue;
            };
            if st.ok == 0 && st.left() == 0 && st.owed == 0 {
                return; // nothing to give back; the next take watches again
            }
            if st.ok == 0 {
                continue; // in use: look again later
            }
            self.seen(&st);
            if self.refund(key, window, (st.ok, st.cleared)).await != Refund::Failed {
                self.report(key, window, &Self::emptied(&st), Demand::IDLE);
            }
            return;
        }
    }

    /// Near a dry home, between two ordinary give-backs: the pool's excess over its region's
    /// need goes home once its demand fell, and, every [`MOVED_TICK_MS`], the whole pool if
    /// idle while another region is short (`moved.rs`). Whether the pool went home whole.
    async fn near_dry_look(
        self: &Arc<Self>,
        (key, window, window_ms): (&CounterKey, Option<(u64, u64)>, u64),
        looks: &mut Looks,
    ) -> bool {
        if !self.near_dry(key, window_ms) {
            return false;
        }
        self.give_back_excess(key, window, window_ms, looks).await;
        let now = tokio::time::Instant::now();
        if looks
            .1
            .is_some_and(|at| now < at + Duration::from_millis(MOVED_TICK_MS))
        {
            return false;
        }
        looks.1 = Some(now);
        self.give_back_moved(key, window, window_ms).await
    }

    /// A replica that stops (SIGTERM), once its slices are back in the pools: every pool of a
    /// window still running that this replica took from goes back home at once (not only once
    /// idle: no replica of this region may be left to notice), so other regions, or this
    /// region's other replicas through a refill, can spend its units. No refill starts any
    /// more, and this replica's refills under way land first (until `deadline`). A pool whose
    /// lease another replica holds is left to that replica's idle drain. A pool's drain and
    /// its refund home go together, never cut in between (units drained and not refunded
    /// would be lost uncounted): none starts within [`GIVE_BACK_MARGIN`] of `deadline`, and
    /// a refund started runs to its answer (the home store's timeout bounds it). Returns the
    /// units given back home.
    pub async fn give_back_pools(self: &Arc<Self>, deadline: tokio::time::Instant) -> u64 {
        use futures_util::StreamExt;
        use std::sync::atomic::Ordering::SeqCst;
        self.stopping.store(true, SeqCst);
        while self.refilling.load(SeqCst) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let now = self.now_ms();
        let pools: Vec<(CounterKey, Option<(u64, u64)>)> = {
            let map = self.known.lock().unwrap_or_else(|e| e.into_inner());
            map.iter()
                .filter(|(_, k)| k.window.is_none_or(|(_, end)| end / 1000 > now))
                .map(|((key, _), k)| (key.clone(), k.window))
                .collect()
        };
        let total = AtomicU64::new(0);
        futures_util::stream::iter(pools)
            .for_each_concurrent(GIVE_BACK_AT_ONCE, |(key, window)| {
                let total = &total;
                async move {
                    if tokio::time::Instant::now() + GIVE_BACK_MARGIN >= deadline {
                        return;
                    }
                    let ttl = Self::ttl_ms(window, now);
                    let _ = self
                        .settle_owed(&key, (window, window_ms(window)), ttl)
                        .await;
                    let all = PoolOp::Drain { idle_ms: 0 };
                    let st = match self.pool.run(&key, window_ms(window), all, ttl).await {
                        Ok(st) if st.ok > 0 => st,
                        _ => return,
                    };
                    let back = self.refund(&key, window, (st.ok, st.cleared)).await;
                    if back == Refund::Back {
                        total.fetch_add(st.ok, Relaxed);
                    }
                    if back != Refund::Failed {
                        self.report(&key, window, &Self::emptied(&st), Demand::IDLE);
                    }
                }
            })
            .await;
        total.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_ticks_are_capped_and_given_up() {
        let count = AtomicUsize::new(0);
        let mut all: Vec<FastWatch> = (0..MAX_FAST_WATCHES + 3)
            .map(|_| FastWatch::new(&count))
            .collect();
        let held = all
            .iter_mut()
            .filter_map(|w| w.hold(true).then_some(()))
            .count();
        assert_eq!(held, MAX_FAST_WATCHES);
        assert_eq!(count.load(Relaxed), MAX_FAST_WATCHES);
        // Asking again while held claims nothing more.
        assert!(all[0].hold(true));
        assert_eq!(count.load(Relaxed), MAX_FAST_WATCHES);
        // One given up (no longer near dry): a waiting one gets it.
        assert!(!all[0].hold(false));
        assert!(all[MAX_FAST_WATCHES].hold(true));
        // Dropped watchers give theirs back.
        drop(all);
        assert_eq!(count.load(Relaxed), 0);
    }
}
