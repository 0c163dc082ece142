//! The HTTP admin server of envoyproxy/ratelimit: `/healthcheck` for load balancers and probes,
//! `/rlconfig` to see the loaded rules, `/json` to ask for a decision with protojson (curl,
//! scripts, services without gRPC), `/metrics` for Prometheus, and `/debug/offenders` to see
//! who is being denied.

use super::signal::ShutdownWatch;
use crate::proto::{RateLimitRequest, RateLimitResponse};
use crate::service::{Edge, RateLimiter, RequestError};
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use prost::Message;
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, SerializeOptions};
use std::sync::Arc;

const REQUEST_TYPE: &str = "envoy.service.ratelimit.v3.RateLimitRequest";
const RESPONSE_TYPE: &str = "envoy.service.ratelimit.v3.RateLimitResponse";

/// Why the admin server could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TranscodeSetupError {
    #[error("embedded proto descriptors are invalid: {0}")]
    Descriptors(#[from] prost_reflect::DescriptorError),
    #[error("embedded proto descriptors lack message {0}")]
    MissingMessage(&'static str),
}

/// Message descriptors for protojson transcoding, resolved once at start.
#[derive(Debug, Clone)]
pub struct Transcoder {
    request: MessageDescriptor,
    response: MessageDescriptor,
}

impl Transcoder {
    pub fn new() -> Result<Self, TranscodeSetupError> {
        let pool = DescriptorPool::decode(crate::proto::FILE_DESCRIPTOR_SET)?;
        let get = |name: &'static str| {
            pool.get_message_by_name(name)
                .ok_or(TranscodeSetupError::MissingMessage(name))
        };
        Ok(Self {
            request: get(REQUEST_TYPE)?,
            response: get(RESPONSE_TYPE)?,
        })
    }

    /// protojson (lowerCamel or original field names, as protobuf's JSON mapping requires) to a
    /// `RateLimitRequest`, by way of the binary encoding.
    pub fn decode_request(&self, body: &[u8]) -> Result<RateLimitRequest, String> {
        let mut de = serde_json::Deserializer::from_slice(body);
        let msg = DynamicMessage::deserialize(self.request.clone(), &mut de)
            .map_err(|e| e.to_string())?;
        de.end().map_err(|e| e.to_string())?;
        RateLimitRequest::decode(msg.encode_to_vec().as_slice()).map_err(|e| e.to_string())
    }

    /// A `RateLimitResponse` as protojson with protojson.Marshal's defaults (lowerCamel names,
    /// enum names, default values omitted), as envoyproxy/ratelimit writes it.
    pub fn encode_response(&self, response: &RateLimitResponse) -> Result<Vec<u8>, String> {
        let msg =
            DynamicMessage::decode(self.response.clone(), response.encode_to_vec().as_slice())
                .map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        let mut ser = serde_json::Serializer::new(&mut out);
        msg.serialize_with_options(&mut ser, &SerializeOptions::new())
            .map_err(|e| e.to_string())?;
        Ok(out)
    }
}

/// What `/json` takes (`JSON_ENDPOINT`, `JSON_ALLOW_NEGATIVE_HITS`; both off by default when
/// gRPC is served with TLS: the HTTP port is plaintext and has no client certificate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct JsonPolicy {
    pub serve: bool,
    pub negative_hits: bool,
}

#[derive(Debug, Clone)]
struct AdminState {
    limiter: Arc<RateLimiter>,
    transcoder: Transcoder,
    json: JsonPolicy,
    shutdown: ShutdownWatch,
    /// `RLQS_DEBUG_SHOW_VALUES`: `/debug/rlqs` shows bucket values.
    show_bucket_values: bool,
}

/// The admin routes.
pub(crate) fn router(
    limiter: Arc<RateLimiter>,
    (transcoder, policy): (Transcoder, JsonPolicy),
    shutdown: ShutdownWatch,
    show_bucket_values: bool,
) -> Router {
    Router::new()
        .route("/healthcheck", get(healthcheck))
        .route("/livez", get(livez))
        .route("/rlconfig", get(rlconfig))
        .route("/json", post(json))
        .route("/metrics", get(metrics))
        .route("/config/status", get(config_status))
        .route("/debug/offenders", get(offenders))
        .route("/debug/rlqs", get(rlqs_assignments))
        .with_state(AdminState {
            limiter,
            transcoder,
            json: policy,
            shutdown,
            show_bucket_values,
        })
}

/// Liveness: the process answers HTTP. Never depends on Redis (readiness, `/healthcheck`, does),
/// and stays OK while draining, so an orchestrator never kills a pod for a store outage or in
/// the middle of its graceful shutdown.
async fn livez() -> Response {
    (StatusCode::OK, "OK").into_response()
}

async fn healthcheck(State(s): State<AdminState>) -> Response {
    // Failing while draining takes the instance out of a load balancer before it closes.
    if s.shutdown.is_shutting_down() {
        return (StatusCode::INTERNAL_SERVER_ERROR, "shutting down\n").into_response();
    }
    if !s.limiter.config_ready() {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            "no rate limit configuration loaded yet\n",
        )
            .into_response();
    }
    if !s.limiter.ready() {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            "counter store unhealthy\n",
        )
            .into_response();
    }
    (StatusCode::OK, "OK").into_response()
}

async fn rlconfig(State(s): State<AdminState>) -> Response {
    rlconfig_text(&s.limiter)
}

/// The loaded limits, one per line (`/rlconfig` on the admin and the debug listener).
fn rlconfig_text(limiter: &RateLimiter) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        limiter.rules().dump_with(limiter.options().counting),
    )
        .into_response()
}

/// When the rules in force were loaded and how the last reload went (JSON).
async fn config_status(State(s): State<AdminState>) -> Response {
    json_ok(&s.limiter.config_status())
}

/// 200 with `value` as JSON.
fn json_ok(value: &impl serde::Serialize) -> Response {
    match serde_json::to_string(value) {
        Ok(body) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response(),
        Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    }
}

async fn metrics(State(s): State<AdminState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            crate::telemetry::metrics::CONTENT_TYPE,
        )],
        s.limiter.render_metrics(),
    )
        .into_response()
}

#[derive(Debug, serde::Deserialize)]
struct OffendersQuery {
    domain: Option<String>,
    /// How many to list (default 10, at most the tracker's capacity).
    limit: Option<usize>,
}

/// `GET /debug/offenders?domain=D[&limit=N]`: the descriptors most often denied in `D` over the
/// last minutes; without `domain`, the domains that have denials.
async fn offenders(
    State(s): State<AdminState>,
    query: Result<Query<OffendersQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(q)) = query else {
        return json_error(
            StatusCode::BAD_REQUEST,
            "query must be ?domain=<domain>[&limit=<n>]",
        );
    };
    let tracker = &s.limiter.telemetry().offenders;
    let Some(domain) = q.domain else {
        return json_ok(&serde_json::json!({ "domains": tracker.domains() }));
    };
    let limit = q.limit.unwrap_or(10);
    let report = tracker.top(&domain, limit).unwrap_or_else(|| {
        crate::telemetry::offenders::OffenderReport {
            domain: domain.clone(),
            window_seconds: tracker.settings().window_seconds(),
            offenders: Vec::new(),
        }
    });
    json_ok(&report)
}

#[derive(Debug, serde::Deserialize)]
struct RlqsQuery {
    domain: Option<String>,
    /// How many buckets to list in all (default 100, at most 10 000).
    limit: Option<usize>,
}

/// `GET /debug/rlqs[?domain=D][&limit=N]`: the quota service's current assignments per open
/// stream and bucket (token rate, TTL, reservation, measured demand), bucket values shown as
/// their length unless `RLQS_DEBUG_SHOW_VALUES` is on (they are often API keys).
async fn rlqs_assignments(
    State(s): State<AdminState>,
    query: Result<Query<RlqsQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(q)) = query else {
        return json_error(
            StatusCode::BAD_REQUEST,
            "query must be [?domain=<domain>][&limit=<n>]",
        );
    };
    let limit = q.limit.unwrap_or(100).min(10_000);
    let report =
        s.limiter
            .telemetry()
            .assignments
            .report(q.domain.as_deref(), limit, s.show_bucket_values);
    json_ok(&report)
}

async fn json(State(s): State<AdminState>, headers: HeaderMap, body: Bytes) -> Response {
    if !s.json.serve {
        let why = "/json is off: gRPC is served with TLS and this port is plaintext \
                   (JSON_ENDPOINT=true serves it anyway)";
        return json_error(StatusCode::FORBIDDEN, why);
    }
    let request = match s.transcoder.decode_request(&body) {
        Ok(r) => r,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, &format!("malformed request: {e}")),
    };
    if !s.json.negative_hits && request.descriptors.iter().any(|d| d.is_negative_hits) {
        let why = "is_negative_hits is refused on /json (JSON_ALLOW_NEGATIVE_HITS)";
        return json_error(StatusCode::FORBIDDEN, why);
    }
    let parent = crate::telemetry::trace::parent_from_headers(&headers);
    let response = match s
        .limiter
        .should_rate_limit_in(request, &parent, Edge::Http, None)
        .await
    {
        Ok(r) => r,
        Err(e) => {
            // The same split as the gRPC edge: the caller's fault is 400, a decision that could
            // not be made (no config yet, store down) is 503.
            let (code, message) = match e {
                RequestError::Invalid(m) => (StatusCode::BAD_REQUEST, m),
                e @ (RequestError::NoConfig | RequestError::Store(_)) => {
                    (StatusCode::SERVICE_UNAVAILABLE, e.to_string())
                }
            };
            return json_error(code, &message);
        }
    };
    let body = match s.transcoder.encode_response(&response) {
        Ok(b) => b,
        Err(e) => {
            tracing::error!(error = %e, "cannot encode /json response");
            return json_error(StatusCode::INTERNAL_SERVER_ERROR, "cannot encode response");
        }
    };
    let code = if response.overall_code == crate::proto::rate_limit_response::Code::OverLimit as i32
    {
        StatusCode::TOO_MANY_REQUESTS
    } else {
        StatusCode::OK
    };
    let mut reply = (code, [(header::CONTENT_TYPE, "application/json")], body).into_response();
    // The rate-limit headers Envoy would add, for callers of /json.
    for h in &response.response_headers_to_add {
        if let (Ok(name), Ok(value)) = (
            HeaderName::try_from(h.key.as_str()),
            HeaderValue::try_from(h.value.as_str()),
        ) {
            reply.headers_mut().append(name, value);
        }
    }
    reply
}

fn json_error(code: StatusCode, message: &str) -> Response {
    let body = serde_json::json!({ "code": code.as_u16(), "message": message }).to_string();
    (code, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// What the `USE_PROMETHEUS` listener serves from: sluice's metrics and `EXTRA_TAGS`.
#[derive(Clone)]
struct EnvoyMetrics {
    metrics: crate::telemetry::metrics::Metrics,
    tags: Arc<Vec<(String, String)>>,
}

/// The `USE_PROMETHEUS` listener: envoyproxy's series at `path`, nothing else.
pub(crate) fn envoy_metrics_router(
    metrics: crate::telemetry::metrics::Metrics,
    tags: Vec<(String, String)>,
    path: &str,
) -> Router {
    let state = EnvoyMetrics {
        metrics,
        tags: Arc::new(tags),
    };
    Router::new()
        .route(path, get(envoy_metrics))
        .with_state(state)
}

async fn envoy_metrics(State(s): State<EnvoyMetrics>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            crate::telemetry::metrics::CONTENT_TYPE,
        )],
        crate::telemetry::envoy_stats::render_prometheus(&s.metrics, &s.tags),
    )
        .into_response()
}

/// The debug listener's endpoints (`DEBUG_HOST:DEBUG_PORT`), as `path: help` for its index.
const DEBUG_ENDPOINTS: [(&str, &str); 2] = [
    (
        "/rlconfig",
        "print out the currently loaded configuration for debugging",
    ),
    ("/stats", "print out stats"),
];

/// envoyproxy's debug listener: an index of its endpoints at `/`, the loaded limits at
/// `/rlconfig` and envoyproxy's counters as `name: value` lines at `/stats`. (envoyproxy's Go
/// pprof endpoints have no equivalent; `perf` profiles sluice.)
pub(crate) fn debug_router(limiter: Arc<RateLimiter>) -> Router {
    Router::new()
        .route("/", get(debug_index))
        .route("/rlconfig", get(debug_rlconfig))
        .route("/stats", get(debug_stats))
        .with_state(limiter)
}

async fn debug_index() -> Response {
    let mut body = String::new();
    for (path, help) in DEBUG_ENDPOINTS {
        body.push_str(&format!("{path}: {help}\n"));
    }
    ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], body).into_response()
}

async fn debug_rlconfig(State(limiter): State<Arc<RateLimiter>>) -> Response {
    rlconfig_text(&limiter)
}

async fn debug_stats(State(limiter): State<Arc<RateLimiter>>) -> Response {
    let stats = crate::telemetry::envoy_stats::stats(&limiter.telemetry().metrics.gather());
    let mut body = String::new();
    for s in stats {
        body.push_str(&format!("{}: {}\n", s.name, s.value));
    }
    ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::rate_limit_response::{Code, DescriptorStatus};

    #[test]
    fn request_accepts_both_field_name_styles() {
        let t = Transcoder::new().unwrap();
        let camel = br#"{"domain":"d","hitsAddend":3,"descriptors":[{"entries":[{"key":"k","value":"v"}]}]}"#;
        let snake = br#"{"domain":"d","hits_addend":3,"descriptors":[{"entries":[{"key":"k","value":"v"}]}]}"#;
        for body in [&camel[..], &snake[..]] {
            let r = t.decode_request(body).unwrap();
            assert_eq!(r.domain, "d");
            assert_eq!(r.hits_addend, 3);
            assert_eq!(r.descriptors[0].entries[0].key, "k");
            assert_eq!(r.descriptors[0].entries[0].value, "v");
        }
        assert!(t.decode_request(b"{").is_err());
        assert!(t.decode_request(br#"{"domain":"d"} x"#).is_err());
        assert!(t.decode_request(br#"{"nope":1}"#).is_err());
    }

    #[test]
    fn response_is_protojson() {
        let t = Transcoder::new().unwrap();
        let resp = RateLimitResponse {
            overall_code: Code::OverLimit as i32,
            statuses: vec![DescriptorStatus {
                code: Code::OverLimit as i32,
                limit_remaining: 0,
                ..Default::default()
            }],
            ..Default::default()
        };
        let v: serde_json::Value =
            serde_json::from_slice(&t.encode_response(&resp).unwrap()).unwrap();
        assert_eq!(v["overallCode"], "OVER_LIMIT");
        assert_eq!(v["statuses"][0]["code"], "OVER_LIMIT");
    }
}
