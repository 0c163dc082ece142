//! What each region holds of a global limit, for operators: `sluice admin inspect` on a
//! global limit shows the home counter and every region's pool. A region's pool lives in the
//! region's own store, which no other region reaches; so the replica that changes it against
//! home (a refill landed, a pool given back) reports it at home too, in a hash per counter and
//! window beside the home counter (one field per region, living to the window's end and a
//! minute more). The report is sent off the request path after the call to home it follows
//! (one more home call per refill: refills are rare, a few per 100 000 decisions); a report
//! that fails is only a stale view, never a unit lost. This region's own pool is read live.

use super::{window_ms, GlobalGrants, PoolOp, PoolState};
use crate::store::{BoxFuture, CounterKey, LimitCheck, StoreError};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

/// Regions one Inspect lists at most (a region is a deployment, named by its operator's
/// `REGION`: a handful; the cap bounds the answer whatever the home store holds).
pub const MAX_REGIONS: usize = 100;

/// One region's pool of a global limit in one window, as it last reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionReport {
    pub region: String,
    /// Units in the pool, not yet taken by the region's replicas.
    pub pool: u64,
    /// Units the region's replicas took from the pool this window (slices: spent, or held
    /// by a replica).
    pub taken: u64,
    /// Units admitted on credit while cut off from home, not yet charged there.
    pub owed: u64,
    /// When the region reported it (Unix ms; this region's own pool: now).
    pub at_unix_ms: u64,
    /// Its demand then (`fair.rs`; a report from before it carried one: idle).
    pub demand: Demand,
}

impl RegionReport {
    /// The value stored at home: `pool taken owed at per_ks short`.
    pub fn encode(&self) -> String {
        format!(
            "{} {} {} {} {} {}",
            self.pool,
            self.taken,
            self.owed,
            self.at_unix_ms,
            self.demand.per_ks,
            u8::from(self.demand.short)
        )
    }

    /// A stored value back; `None` for anything else (a foreign write is skipped, not shown).
    pub fn decode(region: &str, value: &str) -> Option<Self> {
        let mut f = value.split(' ').map(str::parse::<u64>);
        let mut next = || f.next().and_then(Result::ok);
        let mut r = Self {
            region: region.to_string(),
            pool: next()?,
            taken: next()?,
            owed: next()?,
            at_unix_ms: next()?,
            demand: Demand::IDLE,
        };
        // A region on a release before fairness reports four fields: its demand is unknown.
        if let Some(per_ks) = next() {
            r.demand = Demand {
                per_ks,
                short: next()? == 1,
            };
        }
        Some(r)
    }
}

/// What a region reports of its demand.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Demand {
    /// The rate its replicas took units at, per 1 000 s (a region asking a unit a minute is
    /// 16 per 1 000 s, not 0 per s).
    pub per_ks: u64,
    /// It asked home for less than its demand, or got less than it asked.
    pub short: bool,
}

impl Demand {
    /// A pool given back: nobody takes from it.
    pub const IDLE: Demand = Demand {
        per_ks: 0,
        short: false,
    };
}

/// Where regions report their pools: the home store.
pub trait RegionBoard: Send + Sync + std::fmt::Debug {
    /// Stores `report` for `key`'s window starting at `window_ms`, living `ttl_ms`; every
    /// region's report, this one's included, as the store then holds them (at most
    /// [`MAX_REGIONS`]).
    fn report<'a>(
        &'a self,
        key: &'a CounterKey,
        window_ms: u64,
        report: &'a RegionReport,
        ttl_ms: u64,
    ) -> BoxFuture<'a, Result<Vec<RegionReport>, StoreError>>;

    /// Every region's last report for that window (at most [`MAX_REGIONS`]).
    fn read<'a>(
        &'a self,
        key: &'a CounterKey,
        window_ms: u64,
    ) -> BoxFuture<'a, Result<Vec<RegionReport>, StoreError>>;

    /// `region` found home short of what it asked, in that window: marked for `ttl_ms`
    /// (`moved.rs`: another region's idle pool then goes home at once).
    fn short<'a>(
        &'a self,
        key: &'a CounterKey,
        window_ms: u64,
        region: &'a str,
        ttl_ms: u64,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// The region that last marked that window short, while its mark lives.
    fn short_by<'a>(
        &'a self,
        key: &'a CounterKey,
        window_ms: u64,
    ) -> BoxFuture<'a, Result<Option<String>, StoreError>>;
}

/// Where this replica reports, and as which region.
#[derive(Debug)]
pub(super) struct Reporting {
    pub board: Arc<dyn RegionBoard>,
    pub region: String,
}

impl GlobalGrants {
    /// Reports this region's pools at `board`, as `region` (`REGION`).
    pub fn report_to(&self, board: Arc<dyn RegionBoard>, region: String) {
        let _ = self.reporting.set(Reporting { board, region });
    }

    /// Reports the pool as `st` left it and the region's `demand`, in the background (no
    /// request waits on it); the other regions' reports that come back are what this
    /// replica's next refill of the counter is sized on (`fair.rs`).
    pub(super) fn report(
        self: &Arc<Self>,
        key: &CounterKey,
        window: Option<(u64, u64)>,
        st: &PoolState,
        demand: Demand,
    ) {
        if self.reporting.get().is_none() {
            return;
        }
        let (me, key, st) = (Arc::clone(self), key.clone(), *st);
        self.background.spawn(async move {
            let Some(r) = me.reporting.get() else {
                return;
            };
            let report = RegionReport {
                region: r.region.clone(),
                pool: st.left(),
                taken: st.taken,
                owed: st.owed,
                at_unix_ms: me.now_ms(),
                demand,
            };
            let ttl = Self::ttl_ms(window, me.now_ms());
            let w = window_ms(window);
            match r.board.report(&key, w, &report, ttl).await {
                Ok(mut all) => {
                    me.tallies.heard(me.now_ms());
                    all.retain(|o| o.region != r.region);
                    me.boards.put(&key, w, all, me.now_ms());
                }
                Err(e) => tracing::debug!(error = %e, "cannot report the region's pool at home"),
            }
        });
    }

    /// Every region's pool of `check`'s counter in its window: as each reported it at home,
    /// this region's read now (a look: nothing taken, its idleness untouched).
    pub async fn regions(&self, check: &LimitCheck) -> Result<Vec<RegionReport>, StoreError> {
        let w = window_ms(check.window);
        let mut all = match self.reporting.get() {
            Some(r) => r.board.read(&check.key, w).await?,
            None => Vec::new(),
        };
        let here = self.reporting.get().map_or("", |r| r.region.as_str());
        let ttl = Self::ttl_ms(check.window, self.now_ms());
        let st = self.pool.run(&check.key, w, PoolOp::Take(0), ttl).await?;
        all.retain(|r| r.region != here);
        if st.have > 0 || st.owed > 0 {
            all.push(RegionReport {
                region: here.to_string(),
                pool: st.left(),
                taken: st.taken,
                owed: st.owed,
                at_unix_ms: self.now_ms(),
                demand: self.demand_of(&check.key, w),
            });
        }
        all.sort_by(|a, b| a.region.cmp(&b.region));
        all.truncate(MAX_REGIONS);
        Ok(all)
    }
}

/// The board in memory, for a model of many regions in one process (`tests/cases/
/// global_model.rs`): home is Redis in every deployment (`GLOBAL_REDIS_URL`). Reports never
/// expire here; the model's windows each have their own.
#[derive(Debug, Default)]
pub struct MemoryBoard {
    reports: Mutex<HashMap<(CounterKey, u64), BTreeMap<String, RegionReport>>>,
    marks: Mutex<HashMap<(CounterKey, u64), String>>,
}

impl RegionBoard for MemoryBoard {
    fn report<'a>(
        &'a self,
        key: &'a CounterKey,
        window_ms: u64,
        report: &'a RegionReport,
        _ttl_ms: u64,
    ) -> BoxFuture<'a, Result<Vec<RegionReport>, StoreError>> {
        Box::pin(async move {
            let mut map = self.reports.lock().unwrap_or_else(|e| e.into_inner());
            let board = map.entry((key.clone(), window_ms)).or_default();
            board.insert(report.region.clone(), report.clone());
            Ok(board.values().take(MAX_REGIONS).cloned().collect())
        })
    }

    fn read<'a>(
        &'a self,
        key: &'a CounterKey,
        window_ms: u64,
    ) -> BoxFuture<'a, Result<Vec<RegionReport>, StoreError>> {
        Box::pin(async move {
            let map = self.reports.lock().unwrap_or_else(|e| e.into_inner());
            Ok(map
                .get(&(key.clone(), window_ms))
                .map(|b| b.values().take(MAX_REGIONS).cloned().collect())
                .unwrap_or_default())
        })
    }

    fn short<'a>(
        &'a self,
        key: &'a CounterKey,
        window_ms: u64,
        region: &'a str,
        _ttl_ms: u64,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let mut marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
            marks.insert((key.clone(), window_ms), region.to_string());
            Ok(())
        })
    }

    fn short_by<'a>(
        &'a self,
        key: &'a CounterKey,
        window_ms: u64,
    ) -> BoxFuture<'a, Result<Option<String>, StoreError>> {
        Box::pin(async move {
            let marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
            Ok(marks.get(&(key.clone(), window_ms)).cloned())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_reads_back_and_anything_else_is_skipped() {
        let r = RegionReport {
            region: "eu".into(),
            pool: 120,
            taken: 3_000,
            owed: 7,
            at_unix_ms: 1_790_000_000_000,
            demand: Demand {
                per_ks: 2_500,
                short: true,
            },
        };
        assert_eq!(RegionReport::decode("eu", &r.encode()), Some(r.clone()));
        // A report from a release before fairness: idle.
        let old = RegionReport::decode("eu", "120 3000 7 1790000000000").expect("four fields");
        assert_eq!(old.demand, Demand::IDLE);
        assert_eq!(old.pool, 120);
        for bad in [
            "",
            "1 2 3",
            "1 2 x 4",
            "-1 2 3 4",
            "1 2 3 18446744073709551616",
            "1 2 3 4 5",
        ] {
            assert_eq!(RegionReport::decode("eu", bad), None, "{bad:?}");
        }
    }
}
