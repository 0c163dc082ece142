//! The gRPC front end: Envoy's `RateLimitService` delegating to the shared [`RateLimiter`], plus
//! the health and reflection services that probes and grpcurl expect next to it.

use crate::proto::rate_limit_service_server::{RateLimitService, RateLimitServiceServer};
use crate::proto::{RateLimitRequest, RateLimitResponse};
use crate::service::{Edge, RateLimiter, RequestError};
use crate::store::StoreError;
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
        self.limiter
            .should_rate_limit_in(request.into_inner(), &parent, Edge::Grpc)
            .await
            .map(Response::new)
            .map_err(Status::from)
    }
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
            RequestError::Store(e @ StoreError::Transient(_))
            | RequestError::Store(e @ StoreError::Permanent(_)) => {
                Status::unavailable(e.to_string())
            }
        }
    }
}

/// Reflection v1 and v1alpha over the RLS protos, grpc.health.v1 and both reflection protos, so
/// `grpcurl list` shows every service whichever reflection version the client speaks.
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
    let builder = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(
                tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
            )
    };
    Ok((builder().build_v1()?, builder().build_v1alpha()?))
}
