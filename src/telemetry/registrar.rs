//! Where every metric is registered as it is made (so none is built and forgotten), the
//! latency buckets every histogram shares, and the one error registering can give.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

/// Decision latency buckets (seconds): a memory decision is microseconds, a Redis one a
/// fraction of a millisecond to a few, and `REDIS_TIMEOUT` (100 ms default) caps the tail.
/// 20 ms is Envoy's default rate-limit timeout: whether sluice answered within it is one bucket.
const LATENCY_BUCKETS: [f64; 15] = [
    0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.02, 0.025,
    0.05, 0.1, 0.25, 1.0,
];

/// Why the metric set could not be built (a programming error: a duplicate or invalid name).
#[derive(Debug, thiserror::Error)]
#[error("cannot register metrics: {0}")]
pub struct MetricsError(#[from] prometheus::Error);

/// Registers each metric as it is made, so a metric cannot be built and forgotten.
pub(super) struct Registrar(pub(super) Registry);

impl Registrar {
    pub(super) fn add<C: prometheus::core::Collector + Clone + 'static>(
        &self,
        metric: Result<C, prometheus::Error>,
    ) -> Result<C, MetricsError> {
        let metric = metric?;
        self.0.register(Box::new(metric.clone()))?;
        Ok(metric)
    }

    /// A per-descriptor counter (`domain`, `descriptor` labels).
    pub(super) fn descriptor_counter(
        &self,
        name: &str,
        help: &str,
    ) -> Result<IntCounterVec, MetricsError> {
        let opts = Opts::new(format!("sluice_rate_limit_{name}"), help);
        self.add(IntCounterVec::new(opts, &["domain", "descriptor"]))
    }

    /// A counter with one label, every value of it present from the start (at 0), so `rate()`
    /// over them works before the first event.
    pub(super) fn counter_vec(
        &self,
        name: &str,
        help: &str,
        (label, values): (&str, &[&str]),
    ) -> Result<IntCounterVec, MetricsError> {
        let counter = self.add(IntCounterVec::new(Opts::new(name, help), &[label]))?;
        for value in values {
            counter.with_label_values(&[*value]);
        }
        Ok(counter)
    }

    pub(super) fn latency(
        &self,
        name: &str,
        help: &str,
        label: &str,
    ) -> Result<HistogramVec, MetricsError> {
        let opts = HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec());
        self.add(HistogramVec::new(opts, &[label]))
    }
}

/// Brings a counter up to a running total kept elsewhere.
pub(super) fn catch_up(c: &prometheus::IntCounter, total: u64) {
    let seen = c.get();
    if total > seen {
        c.inc_by(total - seen);
    }
}
