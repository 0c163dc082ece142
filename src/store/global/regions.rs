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
use std::sync::Arc;

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
}

impl RegionReport {
    /// The value stored at home: `pool taken owed at`.
    pub fn encode(&self) -> String {
        format!(
            "{} {} {} {}",
            self.pool, self.taken, self.owed, self.at_unix_ms
        )
    }

    /// A stored value back; `None` for anything else (a foreign write is skipped, not shown).
    pub fn decode(region: &str, value: &str) -> Option<Self> {
        let mut f = value.split(' ').map(str::parse::<u64>);
        let mut next = || f.next().and_then(Result::ok);
        Some(Self {
            region: region.to_string(),
            pool: next()?,
            taken: next()?,
            owed: next()?,
            at_unix_ms: next()?,
        })
    }
}

/// Where regions report their pools: the home store.
pub trait RegionBoard: Send + Sync + std::fmt::Debug {
    /// Stores `report` for `key`'s window starting at `window_ms`, living `ttl_ms`.
    fn report<'a>(
        &'a self,
        key: &'a CounterKey,
        window_ms: u64,
        report: &'a RegionReport,
        ttl_ms: u64,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

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

    /// Reports the pool as `st` left it, in the background (the view at home; no request
    /// waits on it).
    pub(super) fn report(
        self: &Arc<Self>,
        key: &CounterKey,
        window: Option<(u64, u64)>,
        st: &PoolState,
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
            };
            let ttl = Self::ttl_ms(window, me.now_ms());
            if let Err(e) = r.board.report(&key, window_ms(window), &report, ttl).await {
                tracing::debug!(error = %e, "cannot report the region's pool at home");
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
            });
        }
        all.sort_by(|a, b| a.region.cmp(&b.region));
        all.truncate(MAX_REGIONS);
        Ok(all)
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
        };
        assert_eq!(RegionReport::decode("eu", &r.encode()), Some(r));
        for bad in [
            "",
            "1 2 3",
            "1 2 x 4",
            "-1 2 3 4",
            "1 2 3 18446744073709551616",
        ] {
            assert_eq!(RegionReport::decode("eu", bad), None, "{bad:?}");
        }
    }
}
