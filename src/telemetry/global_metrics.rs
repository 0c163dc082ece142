//! Global limits (`sluice_global_*`, see `store/global`): the refills of this replica's region
//! pools from the home store (answered, failed, the units they brought, their round trips),
//! units given back home, units stranded, units on credit while cut off (and settled), the
//! time this replica's refills found home cut off, and what the region's pool held at the last
//! operation this replica saw. Running totals kept by the grants, brought up at each scrape;
//! every series carries the replica's `region` (`REGION`), so a dashboard sums by region
//! whatever the scrape's target labels.

use super::registrar::{catch_up, MetricsError, Registrar};
use crate::store::global::GlobalTallies;
use prometheus::{CounterVec, IntCounterVec, IntGaugeVec, Opts};
use std::sync::atomic::Ordering::Relaxed;

#[derive(Debug, Clone)]
pub struct GlobalMetrics {
    refills: IntCounterVec,
    refill_failures: IntCounterVec,
    refilled: IntCounterVec,
    refill_us: IntCounterVec,
    last_refill_us: IntGaugeVec,
    returned: IntCounterVec,
    moved: IntCounterVec,
    stranded: IntCounterVec,
    forgiven: IntCounterVec,
    shared: IntCounterVec,
    settled: IntCounterVec,
    cut_off: CounterVec,
    pool: IntGaugeVec,
}

const REGION: &[&str] = &["region"];

impl GlobalMetrics {
    pub(super) fn register(r: &Registrar) -> Result<Self, MetricsError> {
        let counter =
            |name: &str, help: &str| r.add(IntCounterVec::new(Opts::new(name, help), REGION));
        let gauge = |name: &str, help: &str| r.add(IntGaugeVec::new(Opts::new(name, help), REGION));
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
                "Units given back to the home store (idle pools, and every pool a replica took \
                 from when it stops).",
            )?,
            moved: counter(
                "sluice_global_moved_total",
                "Of the units given back home, those of idle pools given back because another \
                 region found home short of them (demand that moved).",
            )?,
            stranded: counter(
                "sluice_global_stranded_total",
                "Units left unspent in pools whose window ended, or lost between home, the \
                 pool and the slices (a refill, take or give-back whose store call failed: the \
                 most it can have lost).",
            )?,
            forgiven: counter(
                "sluice_global_forgiven_total",
                "Units given back home that home refused: drained from a pool not cleared since \
                 an operator reset of their counter (they were on the count the reset forgot; \
                 the budget of that window is that much smaller, never over).",
            )?,
            shared: counter(
                "sluice_global_shared_total",
                "Units the region's pools added on credit while cut off from the home store \
                 (GLOBAL_UNREACHABLE=share: at most the stated share of each limit per window).",
            )?,
            settled: counter(
                "sluice_global_settled_total",
                "Units on credit charged at the home store once it answered again.",
            )?,
            cut_off: r.add(CounterVec::new(
                Opts::new(
                    "sluice_global_cut_off_seconds_total",
                    "Time this replica's refills found the home store cut off: from a refill \
                     home did not answer to the next one it did (the spell running included).",
                ),
                REGION,
            ))?,
            pool: gauge(
                "sluice_global_pool_units",
                "Units the region's pool held at the last operation this replica saw.",
            )?,
        })
    }

    pub(super) fn update(&self, t: &GlobalTallies) {
        let region = t.region.get().map_or("", String::as_str);
        let l = [region];
        catch_up(&self.refills.with_label_values(&l), t.refills.get());
        catch_up(
            &self.refill_failures.with_label_values(&l),
            t.refill_failures.get(),
        );
        catch_up(&self.refilled.with_label_values(&l), t.refilled.get());
        catch_up(&self.refill_us.with_label_values(&l), t.refill_us.get());
        catch_up(&self.returned.with_label_values(&l), t.returned.get());
        catch_up(&self.moved.with_label_values(&l), t.moved.get());
        catch_up(&self.stranded.with_label_values(&l), t.stranded.get());
        catch_up(&self.forgiven.with_label_values(&l), t.forgiven.get());
        catch_up(&self.shared.with_label_values(&l), t.shared.get());
        catch_up(&self.settled.with_label_values(&l), t.settled.get());
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let cut = self.cut_off.with_label_values(&l);
        // Milliseconds as seconds: exact below 2^53 ms (285 000 years).
        #[allow(clippy::cast_precision_loss)]
        let total = t.cut_off_ms_at(now_ms) as f64 / 1000.0;
        let seen = cut.get();
        if total > seen {
            cut.inc_by(total - seen);
        }
        let last = t.last_refill_us.load(Relaxed);
        self.last_refill_us
            .with_label_values(&l)
            .set(i64::try_from(last).unwrap_or(i64::MAX));
        let held = t.pool_held.load(Relaxed);
        self.pool
            .with_label_values(&l)
            .set(i64::try_from(held).unwrap_or(i64::MAX));
    }
}
