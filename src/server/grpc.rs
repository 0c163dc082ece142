//! The gRPC front end: Envoy's `RateLimitService` delegating to the shared [`RateLimiter`], plus
//! the health and reflection services that probes and grpcurl expect next to it.

use crate::proto::rate_limit_service_server::{RateLimitService, RateLimitServiceServer};
use crate::proto::{RateLimitRequest, RateLimitResponse};
use crate::service::{Edge, RateLimiter, RequestError};
use std::sync::Arc;
use tonic::{Request, Response, Status};

pub use crate::proto::RLS_SERVICE_NAME;

/// `envoy.service.ratelimit.v3.RateLimitService` over one [`RateLimiter`].
#[derive(Debug, Clone)]
pub struct RlsService {
    limiter: Arc<RateLimiter>,
}

impl RlsService {
    pub fn new(limiter: Arc<RateLimiter>) -> Self {
        Self { limiter }
    }

    pub fn into_server(self) -> RateLimitServiceServer<Self> {
        RateLimitServiceServer::new(self)
    }
}

#[tonic::async_trait]
impl RateLimitService for RlsService {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        // The caller's trace context is read only when spans are exported.
        let parent = if self.limiter.telemetry().tracer.is_some() {
            crate::telemetry::trace::parent_from_metadata(request.metadata())
        } else {
            opentelemetry::Context::new()
        };
        let deadline = grpc_timeout(request.metadata()).map(|t| tokio::time::Instant::now() + t);
        self.limiter
            .should_rate_limit_in(request.into_inner(), &parent, Edge::Grpc, deadline)
            .await
            .map(Response::new)
            .map_err(Status::from)
    }
}

/// The caller's `grpc-timeout` (Envoy sends its rate-limit timeout, 20 ms by default): at most
/// 8 digits and a unit (H, M, S, m, u, n). A malformed value is ignored, as tonic does.
fn grpc_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<std::time::Duration> {
    let raw = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = raw.split_at(raw.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => std::time::Duration::from_secs(n.saturating_mul(3600)),
        "M" => std::time::Duration::from_secs(n.saturating_mul(60)),
        "S" => std::time::Duration::from_secs(n),
        "m" => std::time::Duration::from_millis(n),
        "u" => std::time::Duration::from_micros(n),
        "n" => std::time::Duration::from_nanos(n),
        _ => return None,
    })
}

/// The one place a decision's error becomes a gRPC status.
impl From<RequestError> for Status {
    fn from(e: RequestError) -> Self {
        match e {
            RequestError::Invalid(m) => Status::invalid_argument(m),
            // Envoy's `failure_mode_deny` decides, as for a store that cannot answer.
            e @ RequestError::NoConfig => Status::unavailable(e.to_string()),
            // Every store failure is UNAVAILABLE, permanent ones (a script error, a missing ACL
            // permission) included: Envoy treats any error from the rate-limit service the same
            // way, through `failure_mode_deny`, so a finer code would change nothing for it,
            // while UNAVAILABLE is what operators and dashboards expect for "the backend could
            // not decide". The message says which kind of failure it was.
            RequestError::Store(e) => Status::unavailable(e.to_string()),
        }
    }
}

/// Reflection over the RLS and RLQS protos and grpc.health.v1 (see [`crate::proto::reflection`]).
pub fn reflection_services() -> Result<
    (
        tonic_reflection::server::v1::ServerReflectionServer<
            impl tonic_reflection::server::v1::ServerReflection,
        >,
        tonic_reflection::server::v1alpha::ServerReflectionServer<
            impl tonic_reflection::server::v1alpha::ServerReflection,
        >,
    ),
    tonic_reflection::server::Error,
> {
    crate::proto::reflection(&[
        crate::proto::FILE_DESCRIPTOR_SET,
        tonic_health::pb::FILE_DESCRIPTOR_SET,
    ])
}

#[cfg(test)]
mod tests {
    use super::grpc_timeout;
    use std::time::Duration;

    #[test]
    fn grpc_timeouts_parse_as_the_spec_says() {
        let t = |v: &str| {
            let mut m = tonic::metadata::MetadataMap::new();
            m.insert("grpc-timeout", v.parse().unwrap());
            grpc_timeout(&m)
        };
        assert_eq!(t("20m"), Some(Duration::from_millis(20)));
        assert_eq!(t("1S"), Some(Duration::from_secs(1)));
        assert_eq!(t("5000u"), Some(Duration::from_micros(5000)));
        assert_eq!(t("2M"), Some(Duration::from_secs(120)));
        assert_eq!(t("123456789m"), None);
        assert_eq!(t("m"), None);
        assert_eq!(t("20x"), None);
        assert_eq!(grpc_timeout(&tonic::metadata::MetadataMap::new()), None);
    }
}
