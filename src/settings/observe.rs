//! Metrics, response headers and traces: `NEAR_LIMIT_RATIO`, `LIMIT_RESPONSE_HEADERS_ENABLED`,
//! the header names and the OpenTelemetry settings.

use super::parse_go_bool;
use crate::service::headers::HeaderOptions;
use crate::telemetry::trace::TraceSettings;
use clap::{Args, ValueEnum};
/// Metrics, response headers and traces.
#[derive(Debug, Clone, Args)]
pub struct ObserveArgs {
    /// Share of a limit past which allowed hits count as `near_limit` in metrics (0..=1).
    #[arg(long, env = "NEAR_LIMIT_RATIO", default_value_t = crate::service::DEFAULT_NEAR_LIMIT_RATIO, value_parser = parse_ratio)]
    pub near_limit_ratio: f64,

    /// Add `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset` (and `Retry-After` on
    /// OVER_LIMIT) to the response headers Envoy sends the client.
    #[arg(
        long,
        env = "LIMIT_RESPONSE_HEADERS_ENABLED",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub limit_response_headers_enabled: bool,

    /// Name of the header with the most restrictive limit's quota.
    #[arg(long, env = "LIMIT_LIMIT_HEADER", default_value = "RateLimit-Limit", value_parser = parse_header_name)]
    pub limit_limit_header: String,

    /// Name of the header with the hits left in its window.
    #[arg(long, env = "LIMIT_REMAINING_HEADER", default_value = "RateLimit-Remaining", value_parser = parse_header_name)]
    pub limit_remaining_header: String,

    /// Name of the header with the seconds until its window resets.
    #[arg(long, env = "LIMIT_RESET_HEADER", default_value = "RateLimit-Reset", value_parser = parse_header_name)]
    pub limit_reset_header: String,

    /// `ietf`: also send the IETF draft pair `RateLimit-Policy` and `RateLimit`.
    #[arg(long, env = "RATELIMIT_HEADERS_DRAFT", value_enum, ignore_case = true)]
    pub ratelimit_headers_draft: Option<HeadersDraft>,

    /// Export traces over OTLP (gRPC) to OTEL_EXPORTER_OTLP_ENDPOINT.
    #[arg(
        long,
        env = "TRACING_ENABLED",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub tracing_enabled: bool,

    /// OTLP gRPC endpoint of an OpenTelemetry Collector (or any OTLP receiver).
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_ENDPOINT",
        default_value = crate::telemetry::trace::DEFAULT_ENDPOINT
    )]
    pub otel_exporter_otlp_endpoint: String,

    /// `service.name` of the exported spans.
    #[arg(long, env = "OTEL_SERVICE_NAME", default_value = crate::telemetry::trace::DEFAULT_SERVICE_NAME)]
    pub otel_service_name: String,

    /// Share of root traces sampled (0..=1); a sampled incoming `traceparent` is always followed.
    #[arg(long, env = "TRACING_SAMPLING_RATE", default_value = "1", value_parser = parse_ratio)]
    pub tracing_sampling_rate: f64,

    /// envoyproxy/ratelimit's exporter protocol: only `grpc` is supported (OTLP over HTTP is
    /// refused at start rather than silently dropping spans).
    #[arg(long, env = "TRACING_EXPORTER_PROTOCOL", default_value = "grpc", value_parser = parse_exporter_protocol)]
    pub tracing_exporter_protocol: String,
}

/// `RATELIMIT_HEADERS_DRAFT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HeadersDraft {
    /// draft-ietf-httpapi-ratelimit-headers: `RateLimit-Policy` and `RateLimit`.
    Ietf,
}

impl ObserveArgs {
    /// The response headers to add, or `None` when disabled.
    pub fn headers(&self) -> Option<HeaderOptions> {
        self.limit_response_headers_enabled.then(|| HeaderOptions {
            limit: self.limit_limit_header.clone(),
            remaining: self.limit_remaining_header.clone(),
            reset: self.limit_reset_header.clone(),
            ietf_draft: self.ratelimit_headers_draft == Some(HeadersDraft::Ietf),
        })
    }

    /// The trace export settings, or `None` when disabled.
    pub fn tracing(&self) -> Option<TraceSettings> {
        self.tracing_enabled.then(|| TraceSettings {
            endpoint: self.otel_exporter_otlp_endpoint.clone(),
            service_name: self.otel_service_name.clone(),
            sampling_rate: self.tracing_sampling_rate,
        })
    }
}

/// A number in `0..=1` (`NEAR_LIMIT_RATIO`, `TRACING_SAMPLING_RATE`).
pub fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!(
            "invalid ratio {s:?} (a number from 0 to 1, e.g. 0.8)"
        )),
    }
}

/// A valid HTTP header name (Envoy rejects a response carrying an invalid one).
pub fn parse_header_name(s: &str) -> Result<String, String> {
    let s = s.trim();
    axum::http::HeaderName::try_from(s)
        .map(|_| s.to_string())
        .map_err(|_| format!("invalid HTTP header name {s:?}"))
}

/// `grpc` only.
pub fn parse_exporter_protocol(s: &str) -> Result<String, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "grpc" => Ok("grpc".into()),
        other => Err(format!(
            "unsupported trace exporter protocol {other:?}: sluice exports OTLP over gRPC only \
             (point OTEL_EXPORTER_OTLP_ENDPOINT at the collector's gRPC port, usually 4317)"
        )),
    }
}
