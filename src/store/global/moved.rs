//! Demand that moves between regions mid-window. A region whose demand stopped keeps its pool
//! until it has been idle for [`POOL_IDLE_MS`](super::POOL_IDLE_MS) (2 s: a region with a
//! request every second must not send every one of them to home); meanwhile another region may
//! find home dry. So a refill that gets less than it asked leaves a mark at home ("this window
//! is short", for [`SHORT_MARK_MS`]), and while home is nearly dry (less than four of this
//! replica's last refills left there at its last one) a pool's watcher looks every
//! [`MOVED_TICK_MS`]: a pool no replica of its region took from for [`MOVED_IDLE_MS`], in a
//! window another region marked short, goes home at once, where that region's next refill
//! finds it. And a region whose demand fell does not wait to be asked: near a dry home its
//! watchers look every [`TRIM_TICK_MS`] and read its rate over [`RATE_SPAN_MS`]; a pool holding
//! more than twice what the region needs (5 s of that rate, at least four slices) keeps once
//! that and gives the rest home at once ([`PoolOp::Trim`]): home has it within two round
//! trips and a tick of the fall (`tests/cases/global_moved_model.rs`). Cost: none while home
//! has plenty (the limit not near); near it, one look at the region's pool per tick and
//! watching replica, one refund and report per trim, and one read at home per
//! [`MOVED_TICK_MS`] only while the pool is idle (at most seven per idle spell: after 2 s the
//! ordinary give-back takes over).

use super::regions::Demand;
use super::{window_ms, CounterKey, GlobalGrants, PoolOp, PoolState};
use std::sync::Arc;

/// A pool no replica took from for this long (ms) goes home when another region is short.
pub const MOVED_IDLE_MS: u64 = 250;
/// How often a nearly dry window's pool is looked at (ms).
pub const MOVED_TICK_MS: u64 = 250;
/// How long a region's "short" mark lives at home (ms): renewed by each short refill.
pub const SHORT_MARK_MS: u64 = 1_000;
/// How often a nearly dry window's pool is looked at for demand that fell (ms).
pub const TRIM_TICK_MS: u64 = 100;
/// The region's rate is read over at least this long (ms): over less, one slice taken or not
/// is most of the reading.
pub const RATE_SPAN_MS: u64 = 250;
/// Looks at a pool one watcher keeps (at [`TRIM_TICK_MS`], more than [`RATE_SPAN_MS`]).
const MAX_LOOKS: usize = 16;

/// A watcher's last looks at a pool: the pool's clock and what its replicas had taken then;
/// and when it last looked for another region short.
#[derive(Debug, Default)]
pub(super) struct Looks(
    std::collections::VecDeque<(u64, u64)>,
    pub(super) Option<tokio::time::Instant>,
);

impl Looks {
    /// Records a look at `now` (pool ms) with `taken`; the region's rate (units per 1 000 s)
    /// since the newest earlier look at least [`RATE_SPAN_MS`] before, if there is one.
    pub(super) fn rate(&mut self, now: u64, taken: u64) -> Option<u64> {
        // A pool clock gone back (a Redis failover) starts the reading afresh.
        self.0.retain(|&(at, _)| at <= now);
        // The looks older than the newest one old enough are no longer needed.
        while self
            .0
            .get(1)
            .is_some_and(|&(at, _)| now - at >= RATE_SPAN_MS)
        {
            self.0.pop_front();
        }
        let from = self
            .0
            .front()
            .copied()
            .filter(|&(at, _)| now - at >= RATE_SPAN_MS);
        if self.0.len() >= MAX_LOOKS {
            self.0.pop_front();
        }
        self.0.push_back((now, taken));
        let (at, before) = from?;
        // Slices given back lower `taken`: a rate of nothing, not an underflow.
        let units = u128::from(taken.saturating_sub(before));
        u64::try_from(units * 1_000_000 / u128::from(now - at)).ok()
    }
}

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

    /// Home is nearly dry and the region's demand fell (its rate over the last
    /// [`RATE_SPAN_MS`], `looks`): what the pool holds beyond twice what its region takes over
    /// [`POOL_AHEAD_MS`](super::POOL_AHEAD_MS) (and [`MIN_REFILL_SLICES`](super::MIN_REFILL_SLICES) slices) goes home now,
    /// the pool keeping once that, whether or not the region is idle: another region's next
    /// refill finds it there. A region taking at its refills' pace keeps what it holds (a
    /// refill is five seconds of demand at most).
    pub(super) async fn give_back_excess(
        self: &Arc<Self>,
        key: &CounterKey,
        window: Option<(u64, u64)>,
        window_ms: u64,
        looks: &mut Looks,
    ) {
        let ttl = Self::ttl_ms(window, self.now_ms());
        let Ok(st) = self.pool.run(key, window_ms, PoolOp::Take(0), ttl).await else {
            return;
        };
        let Some(per_ks) = looks.rate(st.now, st.taken) else {
            return;
        };
        let floor = {
            let map = self.known.lock().unwrap_or_else(|e| e.into_inner());
            map.get(&(key.clone(), window_ms)).map_or(0, |k| k.floor)
        };
        let ahead = u128::from(per_ks) * u128::from(super::POOL_AHEAD_MS) / 1_000_000;
        let keep = u64::try_from(ahead).unwrap_or(u64::MAX).max(floor);
        if floor == 0 || st.left() <= keep.saturating_mul(2) || st.locked || st.owed > 0 {
            return;
        }
        let Ok(st) = self
            .pool
            .run(key, window_ms, PoolOp::Trim { keep }, ttl)
            .await
        else {
            return;
        };
        if st.ok == 0 {
            return;
        }
        self.seen(&st);
        if self.refund(key, window, st.ok).await {
            self.tallies.moved.add(st.ok);
            let demand = Demand {
                per_ks,
                short: false,
            };
            self.report(key, window, &st, demand);
        }
    }

    /// What a pool given back leaves, as its region reports it.
    pub(super) fn emptied(st: &PoolState) -> PoolState {
        PoolState {
            have: st.taken,
            ..*st
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Looks, RATE_SPAN_MS};

    #[test]
    fn the_rate_is_read_over_at_least_a_span_and_never_underflows() {
        let mut looks = Looks::default();
        // No look old enough yet.
        assert_eq!(looks.rate(1_000, 0), None);
        assert_eq!(looks.rate(1_100, 10), None);
        // 250 ms after the first: 50 units over 250 ms, 200 a second.
        assert_eq!(looks.rate(1_000 + RATE_SPAN_MS, 50), Some(200_000));
        // The newest look at least a span old is used: 1 100 (10) to 1 400 (40), 100 a second.
        assert_eq!(looks.rate(1_400, 40), Some(100_000));
        // Slices given back lower `taken`: a rate of nothing.
        assert_eq!(looks.rate(1_700, 5), Some(0));
        // A pool clock gone back starts afresh.
        assert_eq!(looks.rate(500, 5), None);
        // Bounded, however many looks.
        for i in 0..1_000 {
            looks.rate(600 + i, i);
        }
        assert!(looks.0.len() <= super::MAX_LOOKS);
    }
}
