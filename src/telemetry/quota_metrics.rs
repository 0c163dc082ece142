//! The Rate Limit Quota Service's series (`sluice_rlqs_*`): streams, buckets and reports per
//! domain, registered with the rest of the service's metrics (which own this set: nothing
//! here names them back, so the two files form no circle).

use super::registrar::{MetricsError, Registrar};
use prometheus::{IntCounterVec, IntGaugeVec, Opts};

/// The Rate Limit Quota Service's series, per domain (a domain the config does not have is
/// labelled `unknown`, so a client cannot grow the series).
#[derive(Debug, Clone)]
pub struct QuotaMetrics {
    pub streams: IntGaugeVec,
    pub buckets: IntGaugeVec,
    pub reported: IntCounterVec,
    /// Bucket usages received (one per bucket per report): how big Envoy's reports are.
    pub bucket_reports: IntCounterVec,
    pub assigned_rate: prometheus::GaugeVec,
    pub refused: IntCounterVec,
}

impl QuotaMetrics {
    pub(super) fn register(r: &Registrar) -> Result<Self, MetricsError> {
        let gauge =
            |name: &str, help: &str| r.add(IntGaugeVec::new(Opts::new(name, help), &["domain"]));
        Ok(Self {
            streams: gauge("sluice_rlqs_streams", "Open RLQS streams, per domain.")?,
            buckets: gauge(
                "sluice_rlqs_buckets",
                "Buckets the RLQS streams hold (assigned, not yet abandoned), per domain.",
            )?,
            reported: r.add(IntCounterVec::new(
                Opts::new(
                    "sluice_rlqs_reported_requests_total",
                    "Requests Envoy reported over RLQS, per domain, allowed or denied by Envoy.",
                ),
                &["domain", "result"],
            ))?,
            bucket_reports: r.add(IntCounterVec::new(
                Opts::new(
                    "sluice_rlqs_bucket_reports_total",
                    "Bucket usages Envoy reported over RLQS (one per bucket per report), per domain.",
                ),
                &["domain"],
            ))?,
            assigned_rate: r.add(prometheus::GaugeVec::new(
                Opts::new(
                    "sluice_rlqs_assigned_rate",
                    "Requests per second currently assigned as token buckets, per domain.",
                ),
                &["domain"],
            ))?,
            refused: r.counter_vec(
                "sluice_rlqs_refused_total",
                "Bucket reports ignored or not tracked, by reason.",
                (
                    "reason",
                    &[
                        "empty",
                        "too_large",
                        "absurd_count",
                        "over_bucket_cap",
                        "over_total_bucket_cap",
                        "board_full",
                        "duplicate",
                    ],
                ),
            )?,
        })
    }
}
