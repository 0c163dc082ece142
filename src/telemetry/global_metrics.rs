//! Global limits (`sluice_global_*`, see `store/global`): the refills of this replica's region
//! pools from the home store (answered, failed, the units they brought, their round trips),
//! units given back home from idle pools, units stranded in pools whose window ended, and what
//! the region's pool held at the last operation this replica saw. Running totals kept by the
//! grants, brought up at each scrape; Prometheus's target labels name the region.

use super::registrar::{catch_up, MetricsError, Registrar};
use crate::store::global::GlobalTallies;
use prometheus::{IntCounter, IntGauge};
use std::sync::atomic::Ordering::Relaxed;

#[derive(Debug, Clone)]
pub struct GlobalMetrics {
    refills: IntCounter,
    refill_failures: IntCounter,
    refilled: IntCounter,
    refill_us: IntCounter,
    last_refill_us: IntGauge,
    returned: IntCounter,
    stranded: IntCounter,
    pool: IntGauge,
}

impl GlobalMetrics {
    pub(super) fn register(r: &Registrar) -> Result<Self, MetricsError> {
        let counter = |name: &str, help: &str| r.add(IntCounter::new(name, help));
        let gauge = |name: &str, help: &str| r.add(IntGauge::new(name, help));
        Ok(Self {
            refills: counter(
                "sluice_global_refills_total",
                "Refills of the region's pools of global limits the home store answered (one \
                 home round trip each).",
            )?,
            refill_failures: counter(
                "sluice_global_refill_failures_total",
                "Refills the home store did not answer in time (GLOBAL_REDIS_TIMEOUT).",
            )?,
            refilled: counter(
                "sluice_global_refilled_total",
                "Units of global limits the home store granted to the region's pools.",
            )?,
            refill_us: counter(
                "sluice_global_refill_microseconds_total",
                "Time the refills took, home round trip included (divide by the refills).",
            )?,
            last_refill_us: gauge(
                "sluice_global_last_refill_microseconds",
                "The last refill's time, home round trip included.",
            )?,
            returned: counter(
                "sluice_global_returned_total",
                "Units given back to the home store from idle pools.",
            )?,
            stranded: counter(
                "sluice_global_stranded_total",
                "Units left unspent in pools whose window ended, or lost between home, the \
                 pool and the slices (a refill, take or give-back whose store call failed: the \
                 most it can have lost).",
            )?,
            pool: gauge(
                "sluice_global_pool_units",
                "Units the region's pool held at the last operation this replica saw.",
            )?,
        })
    }

    pub(super) fn update(&self, t: &GlobalTallies) {
        catch_up(&self.refills, t.refills.get());
        catch_up(&self.refill_failures, t.refill_failures.get());
        catch_up(&self.refilled, t.refilled.get());
        catch_up(&self.refill_us, t.refill_us.get());
        catch_up(&self.returned, t.returned.get());
        catch_up(&self.stranded, t.stranded.get());
        let last = t.last_refill_us.load(Relaxed);
        self.last_refill_us
            .set(i64::try_from(last).unwrap_or(i64::MAX));
        let held = t.pool_held.load(Relaxed);
        self.pool.set(i64::try_from(held).unwrap_or(i64::MAX));
    }
}
