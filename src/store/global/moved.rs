//! Demand that moves between regions mid-window. A region whose demand stopped keeps its pool
//! until it has been idle for [`POOL_IDLE_MS`](super::POOL_IDLE_MS) (2 s: a region with a
//! request every second must not send every one of them to home); meanwhile another region may
//! find home dry. So a refill that gets less than it asked leaves a mark at home ("this window
//! is short", for [`SHORT_MARK_MS`]), and while home is nearly dry (less than four of this
//! replica's last refills left there at its last one) a pool's watcher looks every
//! [`MOVED_TICK_MS`]: a pool no replica of its region took from for [`MOVED_IDLE_MS`] (or four
//! of its slices at its rate, if longer, up to the ordinary 2 s), in a window another region
//! marked short, goes home at once, where that region's next refill
//! finds it. And a region whose demand fell does not wait to be asked: near a dry home its
//! watchers look every [`TRIM_TICK_MS`] and read its rate over [`RATE_SPAN_MS`]; a pool holding
//! more than twice what the region needs (5 s of that rate, at least four slices) keeps once
//! that and gives the rest home at once ([`PoolOp::Trim`]): home has it within the reading,
//! two ticks and a round trip of the fall (`tests/cases/global_moved_model.rs`). Cost: none while home
//! has plenty (the limit not near); near it, one look at the region's pool per tick and
//! watching replica, one refund and report per trim, and one read at home per
//! [`MOVED_TICK_MS`] only while the pool is idle (at most seven per idle spell: after 2 s the
//! ordinary give-back takes over).

use super::refund::Refund;
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
pub const TRIM_TICK_MS: u64 = 25;
/// The region's rate is read over at least this long (ms): over less, one slice taken or not
/// is most of the reading.
pub const RATE_SPAN_MS: u64 = 100;
/// Home answered this replica this recently (ms), and no refill failed since: a trim gives
/// back without a probe first. A partition that began since strands what the trim gave back
/// (counted: the refund's reply is lost), never more than the limit.
const HEARD_MS: u64 = 1_000;
/// Looks at a pool one watcher keeps (at [`TRIM_TICK_MS`], more than the longest reading,
/// [`POOL_AHEAD_MS`](super::POOL_AHEAD_MS)).
const MAX_LOOKS: usize = 256;

/// How long the region's rate is read over before a trim: [`RATE_SPAN_MS`], or four of its
/// largest slices (`floor` is [`MIN_REFILL_SLICES`](super::MIN_REFILL_SLICES) of them) at its
/// rate at the last refill (`per_ks`, per 1 000 s) if longer, at most
/// [`POOL_AHEAD_MS`](super::POOL_AHEAD_MS).
fn span_ms(floor: u64, per_ks: u64) -> u64 {
    let slices = u128::from(floor) * 4 / u128::from(super::MIN_REFILL_SLICES);
    let span = match per_ks {
        0 => u128::from(RATE_SPAN_MS),
        r => slices * 1_000_000 / u128::from(r),
    };
    u64::try_from(span)
        .unwrap_or(u64::MAX)
        .clamp(RATE_SPAN_MS, super::POOL_AHEAD_MS)
}

/// A watcher's last looks at a pool: the pool's clock and what its replicas had taken then;
/// and when it last looked for another region short.
#[derive(Debug, Default)]
pub(super) struct Looks(
    std::collections::VecDeque<(u64, u64)>,
    pub(super) Option<tokio::time::Instant>,
);

impl Looks {
    /// Records a look at `now` (pool ms) with `taken`; the region's rate (units per 1 000 s)
    /// since the newest earlier look at least `span` ms before, if there is one.
    pub(super) fn rate(&mut self, now: u64, taken: u64, span: u64) -> Option<u64> {
        // A pool clock gone back (a Redis failover) starts the reading afresh.
        self.0.retain(|&(at, _)| at <= now);
        // Looks older than the newest one past the longest reading are no longer needed.
        while self
            .0
            .get(1)
            .is_some_and(|&(at, _)| now - at >= super::POOL_AHEAD_MS)
        {
            self.0.pop_front();
        }
        let from = self
            .0
            .iter()
            .rev()
            .find(|&&(at, _)| now - at >= span)
            .copied();
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

    /// If no replica of this region took from the pool for its idle span (`idle_span`:
    /// [`MOVED_IDLE_MS`] to 2 s) and another region marked the window short, the pool goes
    /// home now. Whether it went.
    pub(super) async fn give_back_moved(
        self: &Arc<Self>,
        key: &CounterKey,
        window: Option<(u64, u64)>,
        window_ms: u64,
    ) -> bool {
        let ttl = Self::ttl_ms(window, self.now_ms());
        let idle_ms = self.idle_span(key, window_ms);
        let Ok(st) = self.pool.run(key, window_ms, PoolOp::Take(0), ttl).await else {
            return false;
        };
        let idle = st.now.saturating_sub(st.last_take) >= idle_ms;
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
        let drain = PoolOp::Drain { idle_ms };
        let Ok(st) = self.pool.run(key, window_ms, drain, ttl).await else {
            return false;
        };
        if st.ok == 0 {
            return false;
        }
        self.seen(&st);
        let back = self.refund(key, window, (st.ok, st.cleared)).await;
        if back == Refund::Back {
            self.tallies.moved.add(st.ok);
        }
        if back != Refund::Failed {
            self.report(key, window, &Self::emptied(&st), Demand::IDLE);
        }
        true
    }

    /// Home is nearly dry and the region's demand fell to under half its rate at this
    /// replica's last refill (its rate over the last
    /// [`RATE_SPAN_MS`] or more, `looks`: at least four of its largest slices at its rate at
    /// this replica's last refill, so that a region taking a few slices a second is not read
    /// as idle between two of them): what the pool holds beyond twice what its region takes
    /// over [`POOL_AHEAD_MS`](super::POOL_AHEAD_MS) (and beyond twice
    /// [`MIN_REFILL_SLICES`](super::MIN_REFILL_SLICES) slices) goes home now, the pool keeping
    /// once that, whether or not the region is idle: another region's next refill finds it
    /// there. Not while home does not answer (the pool is all the region has: a probe, unless
    /// home answered within [`HEARD_MS`] and no refill failed since), nor in a window's last
    /// second (what the window leaves is counted at its end).
    pub(super) async fn give_back_excess(
        self: &Arc<Self>,
        key: &CounterKey,
        window: Option<(u64, u64)>,
        window_ms: u64,
        looks: &mut Looks,
    ) {
        let (floor, was_per_ks) = {
            let map = self.known.lock().unwrap_or_else(|e| e.into_inner());
            map.get(&(key.clone(), window_ms))
                .map_or((0, 0), |k| (k.floor, k.demand.per_ks))
        };
        let now = self.now_ms();
        if floor == 0 || window.is_some_and(|(_, end)| now.saturating_add(1_000) >= end / 1000) {
            return;
        }
        let ttl = Self::ttl_ms(window, now);
        let Ok(st) = self.pool.run(key, window_ms, PoolOp::Take(0), ttl).await else {
            return;
        };
        let Some(per_ks) = looks.rate(st.now, st.taken, span_ms(floor, was_per_ks)) else {
            return;
        };
        let ahead = u128::from(per_ks) * u128::from(super::POOL_AHEAD_MS) / 1_000_000;
        let keep = u64::try_from(ahead).unwrap_or(u64::MAX).max(floor);
        // Fell: under half the rate of this replica's last refill (a reading a little low on
        // a busy machine, or one slice late, is not a fall).
        let fell = per_ks.saturating_mul(2) < was_per_ks;
        if !fell || st.left() <= keep.saturating_mul(2) || st.locked || st.owed > 0 {
            return;
        }
        // Home answered this replica in the last second, or answers a probe now: a probe
        // every time would put a round trip to home between the fall and the give-back.
        if !self.tallies.heard_within(self.now_ms(), HEARD_MS) && !self.home.probe().await {
            return;
        }
        // Only the pool looked at: a refill that landed since is not trimmed on that look.
        let trim = PoolOp::Trim {
            keep,
            have: st.have,
        };
        let Ok(st) = self.pool.run(key, window_ms, trim, ttl).await else {
            return;
        };
        if st.ok == 0 {
            return;
        }
        self.seen(&st);
        // Reported as the refund goes, not after it: the other regions' next refills read
        // this region's fall (and its smaller pool) a round trip sooner. The report says what
        // the pool holds, given back home or stranded.
        let demand = Demand {
            per_ks,
            short: false,
        };
        self.report(key, window, &st, demand);
        if self.refund(key, window, (st.ok, st.cleared)).await == Refund::Back {
            self.tallies.moved.add(st.ok);
        }
    }

    /// How long a pool must go untaken to count as idle: [`MOVED_IDLE_MS`], or four of its
    /// largest slices at its region's rate at this replica's last refill if longer
    /// ([`span_ms`]), at most the ordinary give-back's [`POOL_IDLE_MS`](super::POOL_IDLE_MS):
    /// a region taking a slice every second is not idle between two of them (its pool given
    /// home, reported idle, then refilled, each time another region is short: the hungry
    /// regions' share would take what it asks, `tests/cases/global_fair.rs`).
    fn idle_span(&self, key: &CounterKey, window_ms: u64) -> u64 {
        let map = self.known.lock().unwrap_or_else(|e| e.into_inner());
        map.get(&(key.clone(), window_ms))
            .filter(|k| k.floor > 0)
            .map_or(MOVED_IDLE_MS, |k| {
                span_ms(k.floor, k.demand.per_ks).clamp(MOVED_IDLE_MS, super::POOL_IDLE_MS)
            })
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
        // No look old enough yet (the span is 250 ms here).
        let span = 250;
        assert!(RATE_SPAN_MS <= span);
        assert_eq!(looks.rate(1_000, 0, span), None);
        assert_eq!(looks.rate(1_100, 10, span), None);
        // 250 ms after the first: 50 units over 250 ms, 200 a second.
        assert_eq!(looks.rate(1_250, 50, span), Some(200_000));
        // The newest look at least a span old is used: 1 100 (10) to 1 400 (40), 100 a second.
        assert_eq!(looks.rate(1_400, 40, span), Some(100_000));
        // A longer span reads further back: 1 000 (0) to 1 500 (60), 120 a second.
        assert_eq!(looks.rate(1_500, 60, 500), Some(120_000));
        // Slices given back lower `taken`: a rate of nothing.
        assert_eq!(looks.rate(1_800, 5, span), Some(0));
        // The least span: 1 500 (60) to 1 800 (5) is no rate; 1 800 (5) to 1 900 (25), 200 a
        // second.
        assert_eq!(looks.rate(1_900, 25, RATE_SPAN_MS), Some(200_000));
        // A pool clock gone back starts afresh.
        assert_eq!(looks.rate(500, 5, span), None);
        // Bounded, however many looks.
        for i in 0..1_000 {
            looks.rate(600 + i, i, span);
        }
        assert!(looks.0.len() <= super::MAX_LOOKS);
    }

    #[test]
    fn a_region_taking_a_few_slices_a_second_is_read_over_four_of_them() {
        // Slices of 50 (a floor of 200), 100 a second: four slices take 2 s.
        assert_eq!(super::span_ms(200, 100_000), 2_000);
        // Slices of 5 at 200 a second: 100 ms, so the least span.
        assert_eq!(super::span_ms(20, 200_000), RATE_SPAN_MS);
        // Unmeasured, the least; very slow, at most five seconds.
        assert_eq!(super::span_ms(20, 0), RATE_SPAN_MS);
        assert_eq!(super::span_ms(200, 1), super::super::POOL_AHEAD_MS);
    }
}
