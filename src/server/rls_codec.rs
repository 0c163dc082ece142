//! The RLS route as served: tonic's generated `RateLimitService` server, but with a decoder that
//! checks the descriptor and entry caps on the wire before decoding (`validate_wire`). An empty
//! descriptor is 2 bytes sent and about 80 decoded, so a 4 MiB request of them would cost some
//! 170 MB before the decoded request could be counted; refused on the wire it costs its own
//! bytes, with the same INVALID_ARGUMENT message and the same `invalid_argument` metric. A
//! message larger than the caps can admit (`RequestCaps::max_message_bytes`) is refused from
//! its length prefix, unread, and one whose top level cannot be walked (a group) as its bytes
//! arrive (`service::early`).

use super::grpc::RlsService;
use crate::proto::rate_limit_service_server::RateLimitService;
use crate::proto::{RateLimitRequest, RateLimitResponse};
use crate::service::RateLimiter;
use crate::telemetry::metrics::RequestOutcome;
use bytes::Buf;
use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::codegen::{http, Body, BoxFuture, Service, StdError};
use tonic::server::NamedService;
use tonic::Status;
use tonic_prost::{ProstDecoder, ProstEncoder};

const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// The RLS route with its requests' caps checked before decoding.
#[derive(Debug, Clone)]
pub struct RlsServer {
    inner: Arc<RlsService>,
    limiter: Arc<RateLimiter>,
}

impl RlsServer {
    pub(super) fn new(limiter: Arc<RateLimiter>) -> Self {
        Self {
            inner: Arc::new(RlsService::new(Arc::clone(&limiter))),
            limiter,
        }
    }
}

impl NamedService for RlsServer {
    const NAME: &'static str = crate::proto::RLS_SERVICE_NAME;
}

impl<B> Service<http::Request<B>> for RlsServer
where
    B: Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != PATH {
            return Box::pin(async { Ok(Status::unimplemented("").into_http()) });
        }
        let method = Method(Arc::clone(&self.inner));
        let codec = RlsCodec(Arc::clone(&self.limiter));
        let max_bytes = self.limiter.options().caps.max_message_bytes();
        // A request the walk cannot count (a group, say) is refused as its bytes arrive, not
        // after the whole message is read (service/early.rs); the caps are counted whole by
        // `validate_wire` below.
        let spec = crate::service::early::Spec {
            message: "a rate-limit request",
            count: None,
        };
        let limiter = Arc::clone(&self.limiter);
        let req = crate::service::early::walked(req, max_bytes, spec, move || {
            let metrics = &limiter.telemetry().metrics;
            metrics.request(RequestOutcome::Invalid, std::time::Duration::ZERO);
        });
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(codec)
                .apply_max_message_size_config(Some(max_bytes), None);
            Ok(grpc.unary(method, req).await)
        })
    }
}

/// The RPC handler, as the generated server wraps it.
struct Method(Arc<RlsService>);

impl tonic::server::UnaryService<RateLimitRequest> for Method {
    type Response = RateLimitResponse;
    type Future = BoxFuture<tonic::Response<RateLimitResponse>, Status>;

    fn call(&mut self, request: tonic::Request<RateLimitRequest>) -> Self::Future {
        let inner = Arc::clone(&self.0);
        Box::pin(async move { inner.should_rate_limit(request).await })
    }
}

/// prost's codec, with the caps checked on the wire first.
#[derive(Debug, Clone)]
struct RlsCodec(Arc<RateLimiter>);

impl Codec for RlsCodec {
    type Encode = RateLimitResponse;
    type Decode = RateLimitRequest;
    type Encoder = ProstEncoder<RateLimitResponse>;
    type Decoder = RlsDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        RlsDecoder {
            limiter: Arc::clone(&self.0),
            inner: ProstDecoder::new(BufferSettings::default()),
        }
    }
}

#[derive(Debug)]
struct RlsDecoder {
    limiter: Arc<RateLimiter>,
    inner: ProstDecoder<RateLimitRequest>,
}

impl Decoder for RlsDecoder {
    type Item = RateLimitRequest;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Status> {
        // tonic hands a whole message in one contiguous buffer.
        if buf.chunk().len() == buf.remaining() {
            let caps = &self.limiter.options().caps;
            if let Err(e) = crate::service::validate_wire(buf.chunk(), caps) {
                let metrics = &self.limiter.telemetry().metrics;
                metrics.request(RequestOutcome::Invalid, std::time::Duration::ZERO);
                return Err(Status::from(e));
            }
        }
        self.inner.decode(buf)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.inner.buffer_settings()
    }
}
