//! Max-min fairness between regions: a region that needs little is sure to get it, and the
//! rest goes to the regions that want more, in equal parts. Without it a region's share follows
//! its request rate: two regions offered twice the limit empty home early in each window, and
//! a region that asks for 5 % of the limit, steadily, is denied most of it.
//!
//! Each region's report at home (`regions.rs`) carries what it was granted this window, the
//! rate its replicas took units at, and whether it was short (it asked home for less than its
//! demand, or got less than it asked). The report is one script call that writes it and
//! answers every region's: the board a replica sizes its next refill on comes back with the
//! report it sends after each refill; a replica whose board was not read in the window, or
//! not in the last 5 s, or not in the last second and lists no other region holding or taking
//! units, reads it before its refill (one more home call, at most one a second: a board read
//! as the window began lists none of the regions that had not reported yet, and a refill
//! sized on it seconds later would take their shares); one older than a second that lists
//! another region is read again beside the refill, not before it. A refill is then
//! capped at this region's max-min share of the window, less what it was granted (fairness
//! only lowers a refill; the quarter rule of `ask.rs` holds too while the board lists no other
//! region holding or taking units in the window):
//!
//! - another region's **demand** for the window is what it was granted plus its rate from its
//!   report until the window ends and for twice [`POOL_AHEAD_MS`](super::POOL_AHEAD_MS) more
//!   (what its pool holds ahead, and a margin: a rate read low would hand units to the others
//!   for good); unbounded if it was short, or holds units at a rate not measured yet (its
//!   first refill in the window); just what it was granted once its report is older than
//!   [`FRESH_MS`] (a region that died, or went idle without a drain), or, for a region that
//!   was not short, than twice the time its pool lasts at its rate, if longer;
//! - the **level** λ is the largest with Σ max(granted, min(demand, λ)) ≤ limit over the
//!   regions, this one's demand unbounded; this region may be granted up to λ in all.
//!
//! The cap is decided at home, in the grant's own call ([`FairAsk`]): the home store's script
//! reads the reports beside the counter and caps the charge at the share they give then (the
//! Redis script mirrors [`share_left`]); the board a replica reads (above) still decides the
//! quarter rule and how fast its demand is read, and caps refills only on a home that cannot.
//!
//! A region over its share is denied while home still holds units for the others (its pool
//! dry for [`FAIR_RETRY_MS`], then it asks home again). What is held back for a region and not
//! spent by the window's end is under-admission, bounded by how far its rate was off: a region
//! that stops gives its pool back (its report then says idle). On a home that cannot cap, a
//! refill without a board read in the last [`FRESH_MS`] (home unreachable, no report answered)
//! is not capped by fairness. `REGION` names the region on the board: regions that share a
//! name (or leave it empty) see no report of each other (home caps a region on the others'
//! reports, not its own name's), and share by the quarter rule alone.

use super::regions::{Demand, MemoryBoard, RegionBoard, RegionReport};
use crate::store::{CounterKey, CounterStore, LimitCheck, Outcome, StoreError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A report older than this (ms) says nothing of the region's demand any more: it counts for
/// what it was granted only.
pub const FRESH_MS: u64 = 10_000;
/// A board older than this (ms) is read again: before a refill is sized on it when it lists no
/// other region holding or taking units (a board read at a window's start, before the others'
/// first refills reported, lists none of them, and a refill sized on it seconds later would
/// take their shares: a quarter of home's rest, not its own share), else beside the refill.
pub const BOARD_REREAD_MS: u64 = 1_000;
/// A region over its share finds its pool dry this long (ms) before it asks again.
pub const FAIR_RETRY_MS: u64 = 250;
/// Boards one replica keeps at most (one per global counter and window it refilled).
const MAX_BOARDS: usize = 10_000;

/// Another region's claim on the window, as its report says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Claim {
    granted: u64,
    /// `None`: more than any share.
    demand: Option<u64>,
}

impl Claim {
    fn from_report(r: &RegionReport, now_ms: u64, end_ms: u64) -> Self {
        let granted = r.pool.saturating_add(r.taken);
        // A region that takes slowly reports seldom (once per refill): its report holds
        // while its pool lasts twice over at its rate.
        let lasts_ms = match r.demand.per_ks {
            0 => 0,
            per_ks => u64::try_from(u128::from(r.pool) * 2_000_000 / u128::from(per_ks))
                .unwrap_or(u64::MAX),
        };
        let fresh_ms = if r.demand.short {
            FRESH_MS
        } else {
            FRESH_MS.max(lasts_ms)
        };
        if now_ms.saturating_sub(r.at_unix_ms) > fresh_ms {
            return Self {
                granted,
                demand: Some(granted),
            };
        }
        // Short, or holding units at a rate not measured yet (its first refill in the window,
        // or a release that reports none): as much as any.
        if r.demand.short || (r.demand.per_ks == 0 && r.pool > 0) {
            return Self {
                granted,
                demand: None,
            };
        }
        // Its rate from when it reported (what it took since is not in `granted`) to the
        // window's end, and twice what a refill sized on it holds ahead: the pool it keeps
        // until the end, and a margin for a rate read a little low (each lower reading would
        // hand units to the others for good).
        let rest = u128::from(end_ms.saturating_sub(r.at_unix_ms.min(now_ms)))
            + u128::from(2 * super::POOL_AHEAD_MS);
        let more =
            u64::try_from(u128::from(r.demand.per_ks) * rest / 1_000_000).unwrap_or(u64::MAX);
        Self {
            granted,
            demand: Some(granted.saturating_add(more)),
        }
    }

    /// What it holds at level `level`.
    fn at(&self, level: u64) -> u64 {
        let wants = self.demand.map_or(level, |d| d.min(level));
        self.granted.max(wants)
    }
}

/// The most this region may still be granted in the window (limit `limit`, ending at `end_ms`)
/// beside the others' reports, having been granted `mine`.
pub fn share_left(limit: u64, mine: u64, others: &[RegionReport], now_ms: u64, end_ms: u64) -> u64 {
    let claims: Vec<Claim> = others
        .iter()
        .map(|r| Claim::from_report(r, now_ms, end_ms))
        .collect();
    let held = |level: u64| -> u64 {
        claims
            .iter()
            .fold(mine.max(level), |sum, c| sum.saturating_add(c.at(level)))
    };
    // The largest level whose holdings fit the limit (0 if the others and this region already
    // hold it all).
    let (mut lo, mut hi) = (0u64, limit);
    if held(0) > limit {
        return 0;
    }
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if held(mid) <= limit {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo.saturating_sub(mine)
}

/// A refill's ask of home with the region's share decided there, in the grant's own call
/// ([`CounterStore::grant_fair`]): the board a replica reads is half a round trip old when its
/// refill arrives at home, and a region whose demand fell reports it (and gives its units back)
/// in between; capped at home, the refill takes what that region left at once, not a refill
/// later (`tests/cases/global_moved_model.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FairAsk {
    /// The region asking (its own report is not another region's claim).
    pub region: String,
    /// What it was granted in the window so far (its pool's `have`).
    pub mine: u64,
    /// When the window ends (Unix ms).
    pub end_ms: u64,
}

/// What a grant capped at home came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FairGrant {
    /// The hits charged (allowed) or asked (denied): the ask's, capped at the share; 0: the
    /// share was spent, nothing was charged (the outcome is a check's: what home has left).
    pub hits: u64,
    /// The charge's outcome (`None`: home answered none).
    pub outcome: Option<Outcome>,
    /// The reset record past which home's counter of the window was fenced (0: none): the
    /// units are on the count after that reset, and the pool they land in is cleared for it
    /// first (a region that refilled before it applied the reset keeps them: `mod.rs`, `land`).
    pub fence: u64,
}

/// [`CounterStore::grant_fair`] where the reports live in memory beside the home counter (one
/// process, no await between reading them and the charge): the share as `board` has it at
/// `now_ms`, then the charge of `check`'s hits capped at it.
pub async fn grant_on_board(
    home: &dyn CounterStore,
    board: &MemoryBoard,
    check: &LimitCheck,
    ask: &FairAsk,
    now_ms: u64,
) -> Result<Option<FairGrant>, StoreError> {
    let mut others = board
        .read(&check.key, super::window_ms(check.window))
        .await?;
    others.retain(|r| r.region != ask.region);
    let limit = check
        .admin_limit
        .unwrap_or(check.key.limit.requests_per_unit);
    let share = share_left(u64::from(limit), ask.mine, &others, now_ms, ask.end_ms);
    // A share of 0: a check of 0 hits, nothing charged, what home has left answered.
    let mut capped = check.clone();
    capped.hits = check.hits.min(share);
    let d = home.decide(std::slice::from_ref(&capped)).await?;
    Ok(Some(FairGrant {
        hits: capped.hits,
        outcome: d.outcomes.first().copied(),
        fence: 0,
    }))
}

impl super::GlobalGrants {
    /// The region's demand for `key`'s window as this replica's last refill measured it.
    pub(super) fn demand_of(&self, key: &CounterKey, window_ms: u64) -> Demand {
        let map = self.known.lock().unwrap_or_else(|e| e.into_inner());
        map.get(&(key.clone(), window_ms))
            .map_or(Demand::IDLE, |k| k.demand)
    }
}

impl super::GlobalGrants {
    /// The other regions' reports for `check`'s window, read at home when this replica has
    /// none fresh enough: none yet, fetched before the window began (a refill ahead's report
    /// for the next window), or older than [`BOARD_REREAD_MS`] (the region's other replicas'
    /// refills refresh theirs, not this one's; a refill right after this replica's last one
    /// has its report's answer). A read that fails is tried again after half of
    /// [`FRESH_MS`], not at every refill (each would pay the home timeout while cut off).
    pub(super) async fn board_for(self: &Arc<Self>, check: &crate::store::LimitCheck) {
        let (Some((start, _)), Some(_)) = (check.window, self.reporting.get()) else {
            return;
        };
        let w = super::window_ms(check.window);
        match self
            .boards
            .try_read(&check.key, w, start / 1000, self.now_ms())
        {
            Read::No => {}
            Read::Now => self.read_board(&check.key, w).await,
            Read::Behind => {
                let (me, key) = (Arc::clone(self), check.key.clone());
                self.background
                    .spawn(async move { me.read_board(&key, w).await });
            }
        }
    }

    /// The other regions' reports read at home into this replica's board.
    pub(super) async fn read_board(&self, key: &CounterKey, w: u64) {
        let Some(r) = self.reporting.get() else {
            return;
        };
        let now = self.now_ms();
        match r.board.read(key, w).await {
            Ok(mut all) => {
                all.retain(|o| o.region != r.region);
                self.boards.put(key, w, all, now);
            }
            Err(e) => tracing::debug!(error = %e, "cannot read the regions' reports at home"),
        }
    }
}

/// Whether a refill reads the board first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Read {
    No,
    /// Before it is sized: none yet, from before the window, older than half of [`FRESH_MS`],
    /// or older than [`BOARD_REREAD_MS`] listing no other region holding or taking units.
    Now,
    /// Older than [`BOARD_REREAD_MS`] and listing another region holding or taking units:
    /// read beside the refill (sized on the board as it is; its shares already cap it).
    Behind,
}

/// The other regions' reports as one replica last read them.
#[derive(Debug, Clone, Default)]
struct Board {
    reports: Vec<RegionReport>,
    /// When they were read (this replica's clock, ms; 0: never).
    read_ms: u64,
    /// When a read was last tried.
    tried_ms: u64,
}

/// The other regions' reports this replica last saw, per global counter and window.
#[derive(Debug, Default)]
pub struct Boards(Mutex<HashMap<(CounterKey, u64), Board>>);

impl Boards {
    fn slot<'a>(
        map: &'a mut HashMap<(CounterKey, u64), Board>,
        key: &CounterKey,
        window_ms: u64,
    ) -> &'a mut Board {
        let slot = (key.clone(), window_ms);
        super::make_room(map, &slot, MAX_BOARDS);
        map.entry(slot).or_default()
    }

    /// The reports as a report's answer or a read brought them at `now_ms`.
    pub fn put(&self, key: &CounterKey, window_ms: u64, others: Vec<RegionReport>, now_ms: u64) {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let b = Self::slot(&mut map, key, window_ms);
        if now_ms < b.read_ms {
            return; // a read that started before the board it would replace
        }
        b.reports = others;
        b.read_ms = now_ms.max(1);
    }

    /// Whether to read the board at home (and, if so, the attempt is noted).
    fn try_read(&self, key: &CounterKey, window_ms: u64, start_ms: u64, now_ms: u64) -> Read {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let b = Self::slot(&mut map, key, window_ms);
        let age = now_ms.saturating_sub(b.read_ms);
        let this_window = b.read_ms > 0 && b.read_ms >= start_ms;
        // A read that failed (or is out) since the last one that answered: not again for a
        // while.
        let tried = b.tried_ms > b.read_ms && now_ms.saturating_sub(b.tried_ms) < FRESH_MS / 2;
        if (this_window && age <= BOARD_REREAD_MS) || tried {
            return Read::No;
        }
        b.tried_ms = now_ms.max(1);
        let busy = b.reports.iter().any(|r| {
            now_ms.saturating_sub(r.at_unix_ms) <= FRESH_MS
                && (r.pool > 0 || r.demand.per_ks > 0 || r.demand.short)
        });
        if this_window && age <= FRESH_MS / 2 && busy {
            Read::Behind
        } else {
            Read::Now
        }
    }

    /// The reports, if read in the window (it starts at `start_ms`) at most [`FRESH_MS`] ago.
    pub fn get(
        &self,
        key: &CounterKey,
        window_ms: u64,
        start_ms: u64,
        now_ms: u64,
    ) -> Option<Vec<RegionReport>> {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let b = map.get(&(key.clone(), window_ms))?;
        let fresh =
            b.read_ms > 0 && b.read_ms >= start_ms && now_ms.saturating_sub(b.read_ms) <= FRESH_MS;
        fresh.then(|| b.reports.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(pool: u64, taken: u64, per_ks: u64, short: bool, at: u64) -> RegionReport {
        RegionReport {
            region: "x".into(),
            pool,
            taken,
            owed: 0,
            at_unix_ms: at,
            demand: Demand { per_ks, short },
        }
    }

    #[test]
    fn a_region_that_needs_little_gets_it_and_the_hungry_ones_split_the_rest() {
        // A minute of 3 000, 10 s in: region "small" took 25 at 2.5/s (150 a minute), the
        // other hungry one holds 600 and is short.
        let now = 10_000;
        let end = 60_000;
        let small = report(5, 20, 2_500, false, now);
        let hungry = report(100, 500, 0, true, now);
        let left = share_left(3_000, 600, &[small.clone(), hungry.clone()], now, end);
        // small: 25 + 2.5 x (50 s left + 10 s ahead) = 175; the two hungry ones 1 412 each.
        assert_eq!(left, 1_412 - 600);
        // A hungry region that already holds more than its share gets nothing more.
        assert_eq!(share_left(3_000, 1_500, &[small, hungry], now, end), 0);
    }

    #[test]
    fn idle_or_silent_regions_leave_the_rest_at_once() {
        let now = 30_000;
        let end = 60_000;
        let idle = report(0, 1_500, 0, false, now);
        let left = share_left(3_000, 1_000, &[idle], now, end);
        assert_eq!(left, 500);
        // A region that holds units at a rate not measured yet may want as much as any.
        let first = report(40, 0, 0, false, now);
        assert_eq!(share_left(3_000, 0, &[first], now, end), 1_500);
        // A report older than FRESH_MS counts for what it holds only, short or not.
        let silent = report(200, 800, 9_000, true, now - FRESH_MS - 1);
        assert_eq!(share_left(3_000, 0, &[silent], now, end), 2_000);
        // Unless its pool lasts longer than that at its rate: 100 units at 1 a second.
        let slow = report(100, 100, 1_000, false, now - FRESH_MS - 1);
        let left = share_left(3_000, 0, &[slow], now, end);
        assert_eq!(
            left,
            3_000 - 250,
            "200 granted, 1 a second from its report to the end (40 s) and 10 s ahead"
        );
    }

    proptest::proptest! {
        /// Whatever the other regions report (operators' processes, but on another machine
        /// and clock): what this region may still be granted, with what it and the others
        /// were granted, never passes the limit; and with every other region short (and its
        /// report fresh), each counted at the level, neither.
        #[test]
        fn a_share_never_passes_what_the_limit_leaves(
            limit in 0u64..1_000_000,
            mine in 0u64..1_000_000,
            reports in proptest::collection::vec(
                (0u64..500_000, 0u64..500_000, 0u64..10_000_000, proptest::bool::ANY, 0u64..120_000),
                0..6,
            ),
            now in 0u64..120_000,
        ) {
            let others: Vec<RegionReport> = reports
                .iter()
                .map(|&(pool, taken, per_ks, short, at)| report(pool, taken, per_ks, short, at))
                .collect();
            let left = share_left(limit, mine, &others, now, 60_000);
            let granted: u64 = others.iter().map(|r| r.pool + r.taken).sum();
            proptest::prop_assert!(left == 0 || mine + left + granted <= limit);
            let fresh_short = |r: &RegionReport| {
                r.demand.short && now.saturating_sub(r.at_unix_ms) <= FRESH_MS
            };
            if others.iter().all(fresh_short) && left > 0 {
                let level = mine + left;
                let held: u64 = others.iter().map(|r| (r.pool + r.taken).max(level)).sum();
                proptest::prop_assert!(level + held <= limit);
            }
        }
    }

    #[test]
    fn a_board_older_than_a_second_is_read_again_and_a_failed_read_waits() {
        let boards = Boards::default();
        let key = crate::store::LimitCheck::for_tests(
            "d",
            "a",
            crate::config::Limit::fixed(10, crate::config::Unit::Minute),
            1,
        )
        .key;
        let (w, start) = (60_000, 60_000);
        // None yet: read; read as the window began (and answered): not again within a second.
        assert_eq!(boards.try_read(&key, w, start, start + 10), Read::Now);
        boards.put(&key, w, Vec::new(), start + 20);
        let t = start + 20 + BOARD_REREAD_MS;
        assert_eq!(boards.try_read(&key, w, start, t), Read::No);
        // Three seconds later, listing nobody: read again before the refill is sized.
        assert_eq!(boards.try_read(&key, w, start, start + 3_000), Read::Now);
        // That read failed (no answer put): not again until half of FRESH_MS has passed.
        let t = start + 3_000 + BOARD_REREAD_MS + 1;
        assert_eq!(boards.try_read(&key, w, start, t), Read::No);
        let t = start + 3_000 + FRESH_MS / 2 - 1;
        assert_eq!(boards.try_read(&key, w, start, t), Read::No);
        let t = start + 3_000 + FRESH_MS / 2;
        assert_eq!(boards.try_read(&key, w, start, t), Read::Now);
        // A board listing another region taking units, two seconds old: read beside the refill.
        let busy = report(10, 20, 5_000, false, start + 9_000);
        boards.put(&key, w, vec![busy], start + 9_000);
        assert_eq!(
            boards.try_read(&key, w, start, start + 11_000),
            Read::Behind
        );
        // A board read before the window began (a refill ahead's report) is read again first.
        assert_eq!(
            boards.try_read(&key, w, start + 60_000, start + 60_001),
            Read::Now
        );
    }

    #[test]
    fn the_level_never_passes_the_limit() {
        for (limit, mine, a, b) in [(10, 0, 0, 0), (0, 0, 0, 0), (7, 9, 1, 1), (100, 10, 95, 0)] {
            let others = [report(a, 0, 0, true, 0), report(b, 0, 0, true, 0)];
            let left = share_left(limit, mine, &others, 0, 60_000);
            let held: u64 = mine + left + a.max(mine + left) + b.max(mine + left);
            assert!(
                left == 0 || held <= limit,
                "{limit} {mine} {a} {b}: {left} more"
            );
        }
    }
}
