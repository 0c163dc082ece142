//! OpenTelemetry tracing: an OTLP/gRPC span pipeline (batch exporter) per server, and the W3C
//! trace-context extraction that lets a `ShouldRateLimit` span join the trace Envoy started.
//! Nothing here is global (no global provider, no global propagator), so several servers in one
//! process (the integration tests) each export to their own collector.

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::{Context, InstrumentationScope};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider, SpanData, SpanExporter,
};
use opentelemetry_sdk::Resource;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Default OTLP/gRPC collector endpoint (the OTel spec default).
pub const DEFAULT_ENDPOINT: &str = "http://localhost:4317";

/// Default `service.name` resource attribute.
pub const DEFAULT_SERVICE_NAME: &str = "sluice";

/// Upper bound on the final flush at shutdown: a dead or slow collector costs at most this much
/// of the shutdown, never a hang.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Instrumentation scope name of every span sluice starts.
const SCOPE_NAME: &str = "sluice";

/// W3C trace-context header names (lower case: gRPC metadata and `http` header names are).
const TRACEPARENT: &str = "traceparent";
const TRACESTATE: &str = "tracestate";

/// `TRACING_ENABLED=true` settings (env names as envoyproxy/ratelimit and the OTel spec).
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSettings {
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` (gRPC, e.g. `http://otel-collector:4317`); default
    /// [`DEFAULT_ENDPOINT`].
    pub endpoint: String,
    /// `OTEL_SERVICE_NAME`; default [`DEFAULT_SERVICE_NAME`].
    pub service_name: String,
    /// `TRACING_SAMPLING_RATE` in `[0, 1]`; default 1.0. Parent-based: a sampled `traceparent`
    /// is always followed (and an unsampled one never); root spans are sampled at this ratio.
    pub sampling_rate: f64,
}

impl Default for TraceSettings {
    fn default() -> Self {
        Self {
            endpoint: DEFAULT_ENDPOINT.to_string(),
            service_name: DEFAULT_SERVICE_NAME.to_string(),
            sampling_rate: 1.0,
        }
    }
}

/// Why the trace pipeline could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("invalid TRACING_SAMPLING_RATE {0}: must be a number between 0 and 1")]
    SamplingRate(f64),
    #[error("invalid OTLP trace exporter configuration (endpoint {endpoint:?}): {source}")]
    Exporter {
        endpoint: String,
        source: opentelemetry_otlp::ExporterBuildError,
    },
    #[error("the OTLP trace exporter must be started inside a Tokio runtime")]
    NoRuntime,
}

/// A running OTLP trace pipeline (batch exporter over gRPC). Not global: each server owns one,
/// so tests in one process can each have their own.
pub struct Tracing {
    /// `None` once [`Tracing::shutdown`] took it (so `Drop` knows there is nothing left to do).
    provider: Option<SdkTracerProvider>,
    tracer: SdkTracer,
    settings: TraceSettings,
}

impl fmt::Debug for Tracing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tracing")
            .field("endpoint", &self.settings.endpoint)
            .field("service_name", &self.settings.service_name)
            .field("sampling_rate", &self.settings.sampling_rate)
            .field("running", &self.provider.is_some())
            .finish()
    }
}

impl Tracing {
    /// Builds the provider + OTLP gRPC exporter (batch span processor). Must be called inside a
    /// Tokio runtime. Does not fail if the collector is unreachable (spans are dropped, one
    /// warning logged).
    pub fn start(settings: &TraceSettings) -> Result<Self, TraceError> {
        let rate = settings.sampling_rate;
        if !(0.0..=1.0).contains(&rate) {
            // Also rejects NaN, which `contains` never matches.
            return Err(TraceError::SamplingRate(rate));
        }
        // The tonic exporter builds its channel with `connect_lazy`, which spawns the channel's
        // worker on the current Tokio runtime and would panic outside one: report it instead.
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(TraceError::NoRuntime);
        }
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(settings.endpoint.clone())
            .build()
            .map_err(|source| TraceError::Exporter {
                endpoint: settings.endpoint.clone(),
                source,
            })?;
        let exporter = WarnOnFailure {
            inner: exporter,
            endpoint: settings.endpoint.clone(),
            failing: AtomicBool::new(false),
        };

        // The SDK's thread-based batch processor: it exports from its own OS thread by driving
        // the export future with a plain executor. That works with the tonic exporter because
        // the channel (and its connection tasks) were bound to the Tokio runtime above, so the
        // I/O runs on the runtime and the processor thread only waits for the answer. It needs
        // no experimental SDK feature, and request threads only ever enqueue (never block).
        let processor = BatchSpanProcessor::builder(exporter).build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                rate,
            ))))
            // `Resource::builder` keeps the SDK attributes (telemetry.sdk.*) and
            // OTEL_RESOURCE_ATTRIBUTES; the configured service name wins over both.
            .with_resource(
                Resource::builder()
                    .with_service_name(settings.service_name.clone())
                    .build(),
            )
            .build();
        let scope = InstrumentationScope::builder(SCOPE_NAME)
            .with_version(env!("CARGO_PKG_VERSION"))
            .build();
        let tracer = provider.tracer_with_scope(scope);
        Ok(Self {
            provider: Some(provider),
            tracer,
            settings: settings.clone(),
        })
    }

    /// The tracer the service starts spans with (cheap clone).
    pub fn tracer(&self) -> SdkTracer {
        self.tracer.clone()
    }

    /// The settings this pipeline was started with.
    pub fn settings(&self) -> &TraceSettings {
        &self.settings
    }

    /// Flushes pending spans and stops the exporter; called once when the server stops. Takes
    /// at most about [`SHUTDOWN_TIMEOUT`], also when the collector is dead or hangs.
    pub async fn shutdown(mut self) {
        let Some(provider) = self.provider.take() else {
            return;
        };
        // The SDK's shutdown blocks the calling thread until the processor thread has exported
        // the last batch, and that export needs the Tokio runtime to make progress (on a
        // current-thread runtime, blocking here would stall it until the timeout). So it runs
        // on the blocking pool, and this task only awaits it.
        let flush =
            tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT));
        // The SDK bounds its own wait; this outer cap only guards against that bound failing
        // (a blocking task cannot be cancelled, but nobody waits for it any more).
        match tokio::time::timeout(SHUTDOWN_TIMEOUT + Duration::from_secs(1), flush).await {
            Ok(Ok(Ok(()))) => tracing::debug!("trace exporter flushed and stopped"),
            Ok(Ok(Err(e))) => {
                tracing::warn!(error = %e, "trace exporter did not shut down cleanly; pending spans may be lost")
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "trace exporter shutdown task failed"),
            Err(_) => tracing::warn!(
                timeout_secs = SHUTDOWN_TIMEOUT.as_secs(),
                "trace exporter shutdown timed out; pending spans are lost"
            ),
        }
    }
}

impl Drop for Tracing {
    /// Dropped without [`Tracing::shutdown`] (e.g. a server dropped in a test): stop the
    /// exporter anyway, but on a plain thread, because the SDK's shutdown blocks and may be
    /// reached from a Tokio worker here. Once shut down, the last tracer clone dropping later
    /// does not try again.
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            let spawned = std::thread::Builder::new()
                .name("sluice-otlp-shutdown".into())
                .spawn(move || {
                    let _ = provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT);
                });
            if let Err(e) = spawned {
                tracing::debug!(error = %e, "cannot spawn the trace shutdown thread");
            }
        }
    }
}

/// Logs the first failed export of an outage as a warning (and the recovery as info), so a
/// missing collector is visible without one log line per batch. The SDK's own diagnostics are
/// compiled out (`internal-logs` is off).
#[derive(Debug)]
struct WarnOnFailure<E> {
    inner: E,
    endpoint: String,
    failing: AtomicBool,
}

impl<E: SpanExporter> SpanExporter for WarnOnFailure<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        let result = self.inner.export(batch).await;
        match &result {
            Ok(()) => {
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!(endpoint = %self.endpoint, "trace export works again");
                }
            }
            Err(e) => {
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        endpoint = %self.endpoint,
                        error = %e,
                        dropped_spans = spans,
                        "cannot export traces to the OTLP collector; spans are dropped until it answers"
                    );
                } else {
                    tracing::debug!(endpoint = %self.endpoint, error = %e, dropped_spans = spans, "trace export failed");
                }
            }
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn shutdown(&self) -> OTelSdkResult {
        self.inner.shutdown()
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        // The OTLP exporter sends the resource with every batch: it must see it.
        self.inner.set_resource(resource);
    }
}

/// The parent context from W3C `traceparent`/`tracestate` in incoming gRPC metadata (an empty
/// context when absent or malformed).
pub fn parent_from_metadata(md: &tonic::metadata::MetadataMap) -> Context {
    let values = |name: &str| -> Vec<&str> {
        md.get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect()
    };
    extract(TraceHeaders::new(values(TRACEPARENT), values(TRACESTATE)))
}

/// Same for plain HTTP headers (the `/json` endpoint).
pub fn parent_from_headers(headers: &axum::http::HeaderMap) -> Context {
    let values = |name: &str| -> Vec<&str> {
        headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect()
    };
    extract(TraceHeaders::new(values(TRACEPARENT), values(TRACESTATE)))
}

fn extract(headers: TraceHeaders<'_>) -> Context {
    // Extracting into an empty context (not `Context::current()`): the parent must come from
    // this request only, never from whatever the handling task happens to carry.
    TraceContextPropagator::new().extract_with_context(&Context::new(), &headers)
}

/// The two trace-context fields of one request, normalised as W3C Trace Context asks: several
/// `traceparent` values make it invalid (ignored), several `tracestate` values are one list.
struct TraceHeaders<'a> {
    traceparent: Option<&'a str>,
    tracestate: Option<String>,
}

impl<'a> TraceHeaders<'a> {
    fn new(traceparent: Vec<&'a str>, tracestate: Vec<&'a str>) -> Self {
        let traceparent = match traceparent.as_slice() {
            [one] if well_sized(one) => Some(*one),
            _ => None,
        };
        let tracestate = (!tracestate.is_empty()).then(|| tracestate.join(","));
        Self {
            traceparent,
            tracestate,
        }
    }
}

/// Whether the `traceparent` fields have their W3C sizes (2-32-16-2 hex digits). The SDK's
/// parser checks the characters but accepts ids that are too short (it parses them as numbers),
/// and a truncated id must not silently become a different trace.
fn well_sized(traceparent: &str) -> bool {
    let mut fields = traceparent.trim().split('-');
    [2, 32, 16, 2]
        .iter()
        .all(|&len| fields.next().is_some_and(|f| f.len() == len))
}

impl Extractor for TraceHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        if key.eq_ignore_ascii_case(TRACEPARENT) {
            self.traceparent
        } else if key.eq_ignore_ascii_case(TRACESTATE) {
            self.tracestate.as_deref()
        } else {
            None
        }
    }

    fn keys(&self) -> Vec<&str> {
        let mut keys = Vec::new();
        if self.traceparent.is_some() {
            keys.push(TRACEPARENT);
        }
        if self.tracestate.is_some() {
            keys.push(TRACESTATE);
        }
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{HeaderMap, HeaderValue};
    use opentelemetry::trace::{SpanId, TraceContextExt, TraceId};
    use tonic::metadata::{MetadataMap, MetadataValue};

    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const SPAN: &str = "00f067aa0ba902b7";

    fn md(pairs: &[(&'static str, &str)]) -> MetadataMap {
        let mut m = MetadataMap::new();
        for (k, v) in pairs {
            m.append(*k, MetadataValue::try_from(*v).unwrap());
        }
        m
    }

    fn hm(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn parent(flags: &str) -> String {
        format!("00-{TRACE}-{SPAN}-{flags}")
    }

    #[test]
    fn a_sampled_traceparent_is_a_remote_sampled_parent() {
        for cx in [
            parent_from_metadata(&md(&[("traceparent", &parent("01"))])),
            parent_from_headers(&hm(&[("traceparent", &parent("01"))])),
        ] {
            let span = cx.span();
            let sc = span.span_context();
            assert!(sc.is_valid());
            assert!(sc.is_remote());
            assert!(sc.is_sampled());
            assert_eq!(sc.trace_id(), TraceId::from_hex(TRACE).unwrap());
            assert_eq!(sc.span_id(), SpanId::from_hex(SPAN).unwrap());
        }
    }

    #[test]
    fn a_future_version_with_more_fields_is_understood() {
        let v = format!("cc-{TRACE}-{SPAN}-01-what-the-future-will-be-like");
        let cx = parent_from_headers(&hm(&[("traceparent", &v)]));
        let span = cx.span();
        let sc = span.span_context();
        assert!(sc.is_valid());
        assert_eq!(sc.trace_id(), TraceId::from_hex(TRACE).unwrap());
    }

    #[test]
    fn an_unsampled_traceparent_keeps_its_flag() {
        let cx = parent_from_metadata(&md(&[("traceparent", &parent("00"))]));
        let span = cx.span();
        let sc = span.span_context();
        assert!(sc.is_valid());
        assert!(!sc.is_sampled());
    }

    #[test]
    fn tracestate_is_carried_and_joined() {
        let cx = parent_from_metadata(&md(&[
            ("traceparent", &parent("01")),
            ("tracestate", "a=1"),
            ("tracestate", "b=2"),
        ]));
        let span = cx.span();
        let state = span.span_context().trace_state().clone();
        assert_eq!(state.get("a"), Some("1"));
        assert_eq!(state.get("b"), Some("2"));

        let cx = parent_from_headers(&hm(&[
            ("traceparent", &parent("01")),
            ("tracestate", "x=y"),
        ]));
        assert_eq!(cx.span().span_context().trace_state().get("x"), Some("y"));
    }

    #[test]
    fn missing_or_malformed_traceparent_gives_no_parent() {
        let bad = [
            "",
            "garbage",
            "00-xyz-abc-01",
            // All-zero ids are invalid.
            "00-00000000000000000000000000000000-0000000000000000-01",
            // Upper case hex is not allowed.
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            // Wrong lengths.
            "00-4bf92f3577b34da6a3ce929d0e0e47-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba9-01",
            // Version 00 with extra fields.
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            // Version ff is forbidden.
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ];
        for v in bad {
            let cx = parent_from_metadata(&md(&[("traceparent", v)]));
            assert!(!cx.span().span_context().is_valid(), "metadata {v:?}");
            let cx = parent_from_headers(&hm(&[("traceparent", v)]));
            assert!(!cx.span().span_context().is_valid(), "headers {v:?}");
        }
        assert!(!parent_from_metadata(&MetadataMap::new())
            .span()
            .span_context()
            .is_valid());
        assert!(!parent_from_headers(&HeaderMap::new())
            .span()
            .span_context()
            .is_valid());
        // Only a tracestate: still no parent.
        assert!(!parent_from_metadata(&md(&[("tracestate", "a=1")]))
            .span()
            .span_context()
            .is_valid());
    }

    #[test]
    fn two_traceparents_are_ignored() {
        let other = format!("00-{TRACE}-1111111111111111-01");
        let cx = parent_from_metadata(&md(&[
            ("traceparent", &parent("01")),
            ("traceparent", &other),
        ]));
        assert!(!cx.span().span_context().is_valid());
    }

    #[test]
    fn settings_defaults() {
        let s = TraceSettings::default();
        assert_eq!(s.endpoint, "http://localhost:4317");
        assert_eq!(s.service_name, "sluice");
        assert_eq!(s.sampling_rate, 1.0);
    }

    #[test]
    fn start_outside_a_runtime_is_an_error_not_a_panic() {
        assert!(matches!(
            Tracing::start(&TraceSettings::default()),
            Err(TraceError::NoRuntime)
        ));
    }

    #[tokio::test]
    async fn bad_settings_are_rejected() {
        for rate in [-0.1, 1.5, f64::NAN] {
            let s = TraceSettings {
                sampling_rate: rate,
                ..TraceSettings::default()
            };
            assert!(
                matches!(Tracing::start(&s), Err(TraceError::SamplingRate(_))),
                "{rate}"
            );
        }
        let s = TraceSettings {
            endpoint: "not a uri at all".into(),
            ..TraceSettings::default()
        };
        assert!(matches!(
            Tracing::start(&s),
            Err(TraceError::Exporter { .. })
        ));
    }

    /// Starts tracing towards `endpoint`, ends one span named `span_name`, and asserts that
    /// shutdown (which flushes it) is bounded by the shutdown cap.
    async fn assert_shutdown_is_capped(endpoint: String, span_name: &'static str) {
        use opentelemetry::trace::{Span as _, Tracer as _};
        let tracing = Tracing::start(&TraceSettings {
            endpoint,
            ..TraceSettings::default()
        })
        .unwrap();
        let mut span = tracing.tracer().start(span_name);
        span.end();
        let started = std::time::Instant::now();
        tracing.shutdown().await;
        assert!(
            started.elapsed() < SHUTDOWN_TIMEOUT + Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }

    #[tokio::test]
    async fn a_dead_collector_neither_fails_start_nor_hangs_shutdown() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        assert_shutdown_is_capped(format!("http://127.0.0.1:{port}"), "lost").await;
    }

    #[tokio::test]
    async fn a_collector_that_never_answers_costs_shutdown_at_most_the_cap() {
        // Connections land in the backlog and are never served: the export hangs until its own
        // 10 s timeout, so only the shutdown cap can end the flush earlier.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", silent.local_addr().unwrap());
        assert_shutdown_is_capped(endpoint, "stuck").await;
        drop(silent);
    }
}
