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
use crate::service::{walk, walk_typed, Unwalkable};
use bytes::Buf;
use prost::Message;
use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::codegen::{http, Body, BoxFuture, Service, StdError};
use tonic::server::NamedService;
use tonic::Status;
use tonic_prost::{ProstDecoder, ProstEncoder};

const PATH: &str = "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas";

/// The RLQS route: reports of at most `max_bytes`, with at most `max_usages` usages each, and
/// [`ENTRIES_PER_USAGE`] times that many bucket id entries.
#[derive(Debug, Clone)]
pub struct QuotaServer {
    inner: Arc<QuotaService>,
    max_bytes: usize,
    max_usages: usize,
}

/// Bucket id entries a report may carry per usage it may carry: Envoy sends one id per bucket,
/// of as many entries as its `bucket_id_builder` has keys (one to three in practice), so a full
/// report of 4-key ids passes; at the default cap (400 000 entries) a report's maps decode to
/// some 50 MB at the most, where 8 MiB of 16-entry ids decoded to some 190 MB (issue 50). A
/// bucket id over `MAX_ENTRIES_PER_DESCRIPTOR` is still refused on its own, after decoding
/// (`too_large`: ALLOW_ALL, counted), not its report.
pub(super) const ENTRIES_PER_USAGE: usize = 4;

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
        let codec = ReportCodec {
            max_usages: self.max_usages,
        };
        let max_bytes = self.max_bytes;
        let spec = crate::service::early::Spec {
            message: "a usage report",
            count: Some((
                self.max_usages,
                "bucket usages",
                "RLQS_MAX_USAGES_PER_REPORT",
            )),
        };
        let req = crate::service::early::walked(req, max_bytes, spec, || {});
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

/// prost's codec, with the usages and their bucket ids' entries counted before a report is
/// decoded.
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

impl ReportDecoder {
    /// Refuses a report the walk cannot count, of more than `max_usages` usages, or of more
    /// than [`ENTRIES_PER_USAGE`] times that many bucket id entries.
    fn check(&self, wire: &[u8]) -> Result<(), Status> {
        let c = count(wire)
            .map_err(|e| Status::invalid_argument(format!("a usage report refused: {e}")))?;
        if c.usages > self.max_usages {
            return Err(Status::invalid_argument(format!(
                "a usage report of more than {} bucket usages (RLQS_MAX_USAGES_PER_REPORT)",
                self.max_usages
            )));
        }
        let max_entries = self.max_usages.saturating_mul(ENTRIES_PER_USAGE);
        if c.entries > max_entries {
            return Err(Status::invalid_argument(format!(
                "a usage report of {} bucket id entries, over the cap of {max_entries} \
                 ({ENTRIES_PER_USAGE} x RLQS_MAX_USAGES_PER_REPORT)",
                c.entries
            )));
        }
        Ok(())
    }
}

impl Decoder for ReportDecoder {
    type Item = RateLimitQuotaUsageReports;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Status> {
        // tonic hands a whole message in one contiguous buffer; were it ever in pieces, it is
        // copied whole first, so no report reaches prost uncounted.
        if buf.chunk().len() != buf.remaining() {
            let whole = buf.copy_to_bytes(buf.remaining());
            self.check(&whole)?;
            return RateLimitQuotaUsageReports::decode(whole)
                .map(Some)
                .map_err(|e| Status::internal(e.to_string()));
        }
        self.check(buf.chunk())?;
        self.inner.decode(buf)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.inner.buffer_settings()
    }
}

/// The `bucket_quota_usages` (field 2) a `RateLimitQuotaUsageReports` holds, counted on its
/// wire form. The report, its usages, their bucket ids (and map entries) and durations are
/// walked whole; what the walk cannot count (a group, which prost would skip and decode past,
/// an undefined wire type, a truncated field) is refused, never left to prost (issue 50).
#[cfg(test)]
pub(super) fn count_usages(wire: &[u8]) -> Result<usize, Unwalkable> {
    count(wire).map(|c| c.usages)
}

/// What a report's wire form holds, counted before it is decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Counted {
    /// Its `bucket_quota_usages`.
    pub usages: usize,
    /// The map entries of all their bucket ids. An entry is 2 bytes sent (two empty strings)
    /// and some 100 decoded, its map's slot included: counted here, so a report of ids of
    /// many entries is refused before prost builds their maps (issue 50).
    pub entries: usize,
}

/// Counts a report's usages and their bucket ids' entries on the wire.
pub(super) fn count(wire: &[u8]) -> Result<Counted, Unwalkable> {
    let mut c = Counted {
        usages: 0,
        entries: 0,
    };
    walk(wire, 0, &mut |field, usage, at| {
        if field != 2 {
            return Ok(());
        }
        c.usages += 1;
        // A usage: its bucket_id (1, of map entries, 1) and time_elapsed (2) are messages.
        walk(usage, at, &mut |f, body, at| match f {
            1 => walk_typed(
                body,
                at,
                &mut |f, wire_type, entry, at| match (f, wire_type) {
                    (1, 2) => {
                        c.entries += 1;
                        walk(entry, at, &mut |_, _, _| Ok(()))
                    }
                    // prost decodes a map entry whatever wire type its tag says: one sent as a
                    // varint or a fixed field would be an entry the count never saw.
                    (1, _) => Err(Unwalkable {
                        at,
                        what: "a map entry that is not length-delimited",
                    }),
                    _ => Ok(()),
                },
            ),
            2 => walk(body, at, &mut |_, _, _| Ok(())),
            _ => Ok(()),
        })
    })?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
    use crate::proto::envoy::service::rate_limit_quota::v3::BucketId;
    use crate::service::arbitrary;
    use proptest::prelude::*;

    /// A map entry sent under a fixed-size or varint tag: prost decodes it as an entry (its map
    /// merge never checks the wire type), so the count refuses it instead of skipping it.
    #[test]
    fn a_map_entry_under_another_wire_type_is_refused() {
        // usage { bucket_id { field 1, wire type 5: 07 0a 05 'c' 10 'x' 10 'y' } }
        let id = [0x0d, 0x07, 0x0a, 0x05, b'c', 0x10, b'x', 0x10, b'y'];
        let mut usage = vec![0x0a, id.len() as u8];
        usage.extend_from_slice(&id);
        let mut wire = vec![0x12, usage.len() as u8];
        wire.extend_from_slice(&usage);
        // What prost makes of it: one entry, key "c\x10x\x10y".
        let decoded = RateLimitQuotaUsageReports::decode(wire.as_slice()).expect("prost takes it");
        let id = decoded.bucket_quota_usages[0]
            .bucket_id
            .as_ref()
            .expect("an id");
        assert_eq!(id.bucket.len(), 1, "{id:?}");
        let e = count(&wire).expect_err("refused");
        assert_eq!(e.what, "a map entry that is not length-delimited");
        // Length-delimited, the same entry is counted.
        let mut ok = wire.clone();
        ok[4] = 0x0a;
        assert_eq!(
            count(&ok),
            Ok(Counted {
                usages: 1,
                entries: 1
            })
        );
        let decoder = ReportDecoder {
            max_usages: 1,
            inner: ProstDecoder::new(BufferSettings::default()),
        };
        // At one usage the cap is ENTRIES_PER_USAGE entries in all.
        let entries = |n: usize| {
            let mut id = Vec::new();
            for _ in 0..n {
                id.extend_from_slice(&[0x0a, 0x03, 0x0a, 0x01, b'k']);
            }
            let mut usage = vec![0x0a, id.len() as u8];
            usage.extend_from_slice(&id);
            let mut wire = vec![0x12, usage.len() as u8];
            wire.extend_from_slice(&usage);
            wire
        };
        assert!(decoder.check(&entries(ENTRIES_PER_USAGE)).is_ok());
        let e = decoder
            .check(&entries(ENTRIES_PER_USAGE + 1))
            .expect_err("over");
        assert!(e.message().contains("RLQS_MAX_USAGES_PER_REPORT"), "{e:?}");
    }

    #[test]
    fn usages_are_counted_on_the_wire_as_prost_decodes_them() {
        for n in [0usize, 1, 7, 300] {
            let report = RateLimitQuotaUsageReports {
                domain: "d".repeat(200),
                bucket_quota_usages: vec![
                    BucketQuotaUsage {
                        bucket_id: Some(BucketId {
                            bucket: [("k".to_string(), "v".to_string())].into(),
                        }),
                        time_elapsed: Some(prost_types::Duration {
                            seconds: 5,
                            nanos: 1,
                        }),
                        num_requests_allowed: 3,
                        ..Default::default()
                    };
                    n
                ],
            };
            let wire = report.encode_to_vec();
            assert_eq!(count_usages(&wire), Ok(n));
        }
    }

    #[test]
    fn what_the_walk_cannot_count_is_refused() {
        let refused = |wire: &[u8], what: &str| match count_usages(wire) {
            Err(e) => assert!(e.to_string().contains(what), "{wire:x?}: {e}"),
            Ok(n) => panic!("{wire:x?} admitted, {n} usages"),
        };
        let domain = [0x0a, 1, b'd'];
        let with = |parts: &[&[u8]]| -> Vec<u8> { [&domain[..], &parts.concat()].concat() };
        // The review's report: an empty group of field 99, then usages.
        refused(
            &with(&[&[0x9b, 0x06, 0x9c, 0x06], &[0x12, 0].repeat(100)]),
            "group",
        );
        // In a usage, its bucket id, a map entry, its duration.
        refused(&with(&[&[0x12, 2, 0x0b, 0x0c]]), "byte 5");
        refused(&with(&[&[0x12, 4, 0x0a, 2, 0x0b, 0x0c]]), "byte 7");
        refused(&with(&[&[0x12, 6, 0x0a, 4, 0x0a, 2, 0x13, 0x14]]), "byte 9");
        refused(&with(&[&[0x12, 4, 0x12, 2, 0x0b, 0x0c]]), "group");
        // Truncated, undefined wire types.
        refused(&[0x12, 0xff], "truncated or overlong length");
        refused(&[0x17], "wire type (6 or 7)");
        refused(&with(&[&[0x12, 1, 0x18]]), "truncated or overlong varint");
        // Map keys and values are strings: not walked.
        let ok = with(&[&[0x12, 7, 0x0a, 5, 0x0a, 3, 0x0a, 1, 0x0b]]);
        assert_eq!(count_usages(&ok), Ok(1));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        /// The walk as the bytes arrive (service/early.rs) never refuses a report that the
        /// whole-message count admits, whatever the pieces.
        #[test]
        fn the_early_walk_refuses_no_report_the_count_admits(
            wire in prop_oneof![arbitrary::wire(), arbitrary::tampered(arbitrary::rlqs)],
            piece in 1usize..16,
        ) {
            use crate::service::early::{fed, framed, Spec};
            if let Ok(n) = count_usages(&wire) {
                let spec = Spec {
                    message: "a usage report",
                    count: Some((n, "bucket usages", "RLQS_MAX_USAGES_PER_REPORT")),
                };
                let stream = [framed(&wire), framed(&wire)].concat();
                let got = fed(&stream, piece, spec);
                prop_assert!(got.is_ok(), "{:?}", got);
            }
        }


        /// Whenever the walk admits a report, prost decodes it within the usage cap and its
        /// bucket ids within the entry cap (or refuses it): the caps here are 3 and 12.
        #[test]
        fn an_admitted_report_decodes_within_the_cap(
            wire in prop_oneof![arbitrary::wire(), arbitrary::tampered(arbitrary::rlqs)],
        ) {
            let decoder = ReportDecoder {
                max_usages: 3,
                inner: ProstDecoder::new(BufferSettings::default()),
            };
            if decoder.check(&wire).is_ok() {
                if let Ok(r) = RateLimitQuotaUsageReports::decode(wire.as_slice()) {
                    let n = r.bucket_quota_usages.len();
                    prop_assert!(n <= 3, "{} usages", n);
                    let entries: usize = r
                        .bucket_quota_usages
                        .iter()
                        .map(|u| u.bucket_id.as_ref().map_or(0, |b| b.bucket.len()))
                        .sum();
                    prop_assert!(entries <= 3 * ENTRIES_PER_USAGE, "{} entries", entries);
                }
            }
        }
    }
}
