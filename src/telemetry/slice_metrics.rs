//! The slices of leased limits (`sluice_slice_*`, see `store/slices.rs`): grants the store
//! answered and the units they took, units given back (a replica that stops, an evicted slice),
//! units stranded in slices whose window ended, requests that waited on a refill, evictions,
//! and the slices held. Running totals kept by the slices, brought up at each scrape.

use super::registrar::{catch_up, MetricsError, Registrar};
use crate::store::slices::SliceTallies;
use prometheus::{IntCounter, IntGauge};

#[derive(Debug, Clone)]
pub struct SliceMetrics {
    grants: IntCounter,
    granted: IntCounter,
    returned: IntCounter,
    stranded: IntCounter,
    waited: IntCounter,
    evictions: IntCounter,
    held: IntGauge,
}

impl SliceMetrics {
    pub(super) fn register(r: &Registrar) -> Result<Self, MetricsError> {
        let counter = |name: &str, help: &str| r.add(IntCounter::new(name, help));
        Ok(Self {
            grants: counter(
                "sluice_slice_grants_total",
                "Grants of slices of leased limits the store answered (one script call each).",
            )?,
            granted: counter(
                "sluice_slice_granted_total",
                "Units of leased limits granted to this replica's slices.",
            )?,
            returned: counter(
                "sluice_slice_returned_total",
                "Units of leased limits given back to the store unspent (a replica that stops, \
                 a slice evicted).",
            )?,
            stranded: counter(
                "sluice_slice_stranded_total",
                "Units left unspent in slices whose window ended (bounded per window by the \
                 replicas' last grants, at most replicas x max_slice).",
            )?,
            waited: counter(
                "sluice_slice_refills_waited_total",
                "Requests that found their slice empty and waited on its refill.",
            )?,
            evictions: counter(
                "sluice_slice_evictions_total",
                "Slices evicted to keep at most LEASED_MAX_COUNTERS (their units go back).",
            )?,
            held: r.add(IntGauge::new(
                "sluice_slices",
                "Slices of leased limits this replica holds.",
            ))?,
        })
    }

    pub(super) fn update(&self, t: &SliceTallies) {
        catch_up(&self.grants, t.grants.get());
        catch_up(&self.granted, t.granted.get());
        catch_up(&self.returned, t.returned.get());
        catch_up(&self.stranded, t.stranded.get());
        catch_up(&self.waited, t.waited.get());
        catch_up(&self.evictions, t.evictions.get());
        let held = t.held.load(std::sync::atomic::Ordering::Relaxed);
        self.held.set(i64::try_from(held).unwrap_or(i64::MAX));
    }
}
