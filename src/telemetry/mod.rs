//! What sluice tells operators about itself: Prometheus metrics (`/metrics`), OpenTelemetry
//! traces exported over OTLP, and the heavy-hitters view of who is being denied
//! (`/debug/offenders`). Everything here has bounded memory and never sits on a Redis call.

pub mod admin_metrics;
pub mod assignments;
pub mod envoy_stats;
mod global_metrics;
pub mod leases;
pub mod log_filter;
pub mod metrics;
pub mod offenders;
pub mod quota_metrics;
mod registrar;
mod slice_metrics;
pub mod spans;
pub mod trace;

use crate::clock::Clock;
use std::sync::Arc;

/// The telemetry the rate limiter (`service::RateLimiter`) feeds.
#[derive(Debug)]
pub struct Telemetry {
    pub metrics: metrics::Metrics,
    pub offenders: offenders::Offenders,
    /// The quota service's live assignments (`/debug/rlqs`).
    pub assignments: assignments::Assignments,
    /// `Some` with `TRACING_ENABLED`: spans are started on it.
    pub tracer: Option<opentelemetry_sdk::trace::SdkTracer>,
    /// The clock the service decides on (a manual one in tests): the offenders view and the
    /// quota streams' windows read it.
    pub clock: Arc<dyn Clock>,
}

impl Telemetry {
    /// Fresh metrics, an offenders view with default bounds on `clock`, and no tracing.
    pub fn new(clock: Arc<dyn Clock>) -> Result<Self, metrics::MetricsError> {
        Ok(Self {
            metrics: metrics::Metrics::new()?,
            offenders: offenders::Offenders::new(
                offenders::OffenderSettings::default(),
                Arc::clone(&clock),
            ),
            assignments: assignments::Assignments::new(),
            tracer: None,
            clock,
        })
    }
}
