//! Demand that moves between regions mid-window. A region whose demand stopped keeps its pool
//! until it has been idle for [`POOL_IDLE_MS`](super::POOL_IDLE_MS) (2 s: a region with a
//! request every second must not send every one of them to home); meanwhile another region may
//! find home dry. So a refill that gets less than it asked leaves a mark at home ("this window
//! is short", for [`SHORT_MARK_MS`]), and while home is nearly dry (less than four of this
//! replica's last refills left there at its last one) a pool's watcher looks every
//! [`MOVED_TICK_MS`]: a pool no replica of its region took from for [`MOVED_IDLE_MS`], in a
//! window another region marked short, goes home at once, where that region's next refill
//! finds it. Cost: none while home has plenty (the limit not near); near it, one look at the
//! region's pool per tick and watching replica, and one read at home per tick only while the
//! pool is idle (at most seven per idle spell: after 2 s the ordinary give-back takes over).

use super::regions::Demand;
use super::{window_ms, CounterKey, GlobalGrants, PoolOp, PoolState};
use std::sync::Arc;

/// A pool no replica took from for this long (ms) goes home when another region is short.
pub const MOVED_IDLE_MS: u64 = 250;
/// How often a nearly dry window's pool is looked at (ms).
pub const MOVED_TICK_MS: u64 = 250;
/// How long a region's "short" mark lives at home (ms): renewed by each short refill.
pub const SHORT_MARK_MS: u64 = 1_000;

impl GlobalGrants {
    /// Home had less than four of this replica's last refills left at its last one.
    pub(super) fn near_dry(&self, key: &CounterKey, window_ms: u64) -> bool {
        if self.reporting.get().is_none() {
            return false;
        }
        let map = self.known.lock().unwrap_or_else(|e| e.into_inner());
        map.get(&(key.clone(), window_ms)).is_some_and(|k| {
            k.home_left != u64::MAX && k.home_left < k.last_refill.max(1).saturating_mul(4)
        })
    }

    /// A refill got less than it asked: the window is marked short at home (in the background:
    /// the refill's answer does not wait on it).
    pub(super) fn mark_short(self: &Arc<Self>, key: &CounterKey, window: Option<(u64, u64)>) {
        let Some(r) = self.reporting.get() else {
            return;
        };
        let (board, region, key) = (Arc::clone(&r.board), r.region.clone(), key.clone());
        self.background.spawn(async move {
            let w = window_ms(window);
            if let Err(e) = board.short(&key, w, &region, SHORT_MARK_MS).await {
                tracing::debug!(error = %e, "cannot mark the window short at home");
            }
        });
    }

    /// If no replica of this region took from the pool for [`MOVED_IDLE_MS`] and another
    /// region marked the window short, the pool goes home now. Whether it went.
    pub(super) async fn give_back_moved(
        self: &Arc<Self>,
        key: &CounterKey,
        window: Option<(u64, u64)>,
        window_ms: u64,
    ) -> bool {
        let ttl = Self::ttl_ms(window, self.now_ms());
        let Ok(st) = self.pool.run(key, window_ms, PoolOp::Take(0), ttl).await else {
            return false;
        };
        let idle = st.now.saturating_sub(st.last_take) >= MOVED_IDLE_MS;
        if st.left() == 0 || st.owed > 0 || st.locked || !idle {
            return false;
        }
        let Some(r) = self.reporting.get() else {
            return false;
        };
        match r.board.short_by(key, window_ms).await {
            Ok(Some(other)) if other != r.region => {}
            _ => return false,
        }
        let drain = PoolOp::Drain {
            idle_ms: MOVED_IDLE_MS,
        };
        let Ok(st) = self.pool.run(key, window_ms, drain, ttl).await else {
            return false;
        };
        if st.ok == 0 {
            return false;
        }
        self.seen(&st);
        if self.refund(key, window, st.ok).await {
            self.tallies.moved.add(st.ok);
            self.report(key, window, &Self::emptied(&st), Demand::IDLE);
        }
        true
    }

    /// What a pool given back leaves, as its region reports it.
    pub(super) fn emptied(st: &PoolState) -> PoolState {
        PoolState {
            have: st.taken,
            ..*st
        }
    }
}
