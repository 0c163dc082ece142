//! The RLQS gRPC service as served: tonic's generated server, but with a decoder that counts a
//! report's usages on the wire before decoding it. An empty usage is 2 bytes on the wire and
//! about 88 decoded, so a report of nothing but empty usages would cost 44 times its size (a
//! 16 MiB report, about a gigabyte); counted first, a report of more than
//! `RLQS_MAX_USAGES_PER_REPORT` ends its stream with INVALID_ARGUMENT having cost only its own
//! bytes, and a message over `RLQS_MAX_REPORT_BYTES` is refused by tonic from its length prefix,
//! before it is read.

use super::QuotaService;
use crate::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use crate::proto::envoy::service::rate_limit_quota::v3::{
    RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use bytes::Buf;
use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::codegen::{http, Body, BoxFuture, Service, StdError};
use tonic::server::NamedService;
use tonic::Status;
use tonic_prost::{ProstDecoder, ProstEncoder};

const PATH: &str = "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas";

/// The RLQS route: reports of at most `max_bytes`, with at most `max_usages` usages each.
#[derive(Debug, Clone)]
pub struct QuotaServer {
    inner: Arc<QuotaService>,
    max_bytes: usize,
    max_usages: usize,
}

impl QuotaServer {
    pub(super) fn new(inner: QuotaService, max_bytes: usize, max_usages: usize) -> Self {
        Self {
            inner: Arc::new(inner),
            max_bytes,
            max_usages,
        }
    }
}

impl NamedService for QuotaServer {
    const NAME: &'static str = "envoy.service.rate_limit_quota.v3.RateLimitQuotaService";
}

impl<B> Service<http::Request<B>> for QuotaServer
where
    B: Body + Send + 'static,
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
        let codec = ReportCodec {
            max_usages: self.max_usages,
        };
        let max_bytes = self.max_bytes;
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(codec)
                .apply_max_message_size_config(Some(max_bytes), None);
            Ok(grpc.streaming(method, req).await)
        })
    }
}

/// The stream handler, as the generated server wraps it.
struct Method(Arc<QuotaService>);

impl tonic::server::StreamingService<RateLimitQuotaUsageReports> for Method {
    type Response = RateLimitQuotaResponse;
    type ResponseStream = <QuotaService as RateLimitQuotaService>::StreamRateLimitQuotasStream;
    type Future = BoxFuture<tonic::Response<Self::ResponseStream>, Status>;

    fn call(
        &mut self,
        request: tonic::Request<tonic::Streaming<RateLimitQuotaUsageReports>>,
    ) -> Self::Future {
        let inner = Arc::clone(&self.0);
        Box::pin(async move { inner.stream_rate_limit_quotas(request).await })
    }
}

/// prost's codec, with the usages counted before a report is decoded.
#[derive(Debug, Clone, Copy)]
struct ReportCodec {
    max_usages: usize,
}

impl Codec for ReportCodec {
    type Encode = RateLimitQuotaResponse;
    type Decode = RateLimitQuotaUsageReports;
    type Encoder = ProstEncoder<RateLimitQuotaResponse>;
    type Decoder = ReportDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ReportDecoder {
            max_usages: self.max_usages,
            inner: ProstDecoder::new(BufferSettings::default()),
        }
    }
}

#[derive(Debug)]
struct ReportDecoder {
    max_usages: usize,
    inner: ProstDecoder<RateLimitQuotaUsageReports>,
}

impl Decoder for ReportDecoder {
    type Item = RateLimitQuotaUsageReports;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Status> {
        // tonic hands a whole message in one contiguous buffer.
        if buf.chunk().len() == buf.remaining() {
            let usages = count_usages(buf.chunk(), self.max_usages);
            if usages > self.max_usages {
                return Err(Status::invalid_argument(format!(
                    "a usage report of more than {} bucket usages (RLQS_MAX_USAGES_PER_REPORT)",
                    self.max_usages
                )));
            }
        }
        self.inner.decode(buf)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.inner.buffer_settings()
    }
}

/// The `bucket_quota_usages` (field 2) a `RateLimitQuotaUsageReports` holds, counted from its
/// wire form up to one past `stop`; a malformed message stops the count (prost then refuses it).
fn count_usages(mut wire: &[u8], stop: usize) -> usize {
    let mut n = 0;
    while !wire.is_empty() && n <= stop {
        let Ok(tag) = prost::encoding::decode_varint(&mut wire) else {
            break;
        };
        let skip = match tag & 7 {
            0 => match prost::encoding::decode_varint(&mut wire) {
                Ok(_) => 0,
                Err(_) => break,
            },
            1 => 8,
            2 => match prost::encoding::decode_varint(&mut wire) {
                Ok(len) => usize::try_from(len).unwrap_or(usize::MAX),
                Err(_) => break,
            },
            5 => 4,
            _ => break,
        };
        if skip > wire.len() {
            break;
        }
        wire = &wire[skip..];
        if tag >> 3 == 2 && tag & 7 == 2 {
            n += 1;
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
    use prost::Message;

    #[test]
    fn usages_are_counted_on_the_wire_as_prost_decodes_them() {
        for n in [0usize, 1, 7, 300] {
            let report = RateLimitQuotaUsageReports {
                domain: "d".repeat(200),
                bucket_quota_usages: vec![
                    BucketQuotaUsage {
                        num_requests_allowed: 3,
                        ..Default::default()
                    };
                    n
                ],
            };
            let wire = report.encode_to_vec();
            assert_eq!(count_usages(&wire, usize::MAX), n);
            assert_eq!(count_usages(&wire, 5), n.min(6), "stops one past the cap");
        }
        // Truncated or malformed: the count stops, prost refuses the message.
        assert_eq!(count_usages(&[0x12, 0xff], 10), 0);
        assert_eq!(count_usages(&[0x17], 10), 0);
    }
}
