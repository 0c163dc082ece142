//! The Rate Limit Quota Service (`envoy.service.rate_limit_quota.v3`, RLQS): Envoy's
//! `rate_limit_quota` filter keeps one stream per domain, reports per-bucket usage every 5 s and
//! enforces the assignments it gets locally, so the decision leaves the request path. A bucket
//! names the same limit and counter as the RLS descriptor with the same pairs (`bucket.rs`);
//! every reported `num_requests_allowed` is recorded on that counter through the store (always,
//! whatever the domain's counting), and each stream is assigned its max-min fair share of what
//! the window still has, paced over the time left (`allocate.rs`).
//!
//! Per stream (`stream.rs`): reports are answered with one action per bucket; the tokens an
//! assignment grants until the next report are reserved on the counter and reconciled with the
//! use the next report brings; demand per stream is posted on the counter's demand board in
//! the store (`store::demand`), so streams through several replicas share a limit fairly; a
//! bucket idle for [`QuotaSettings::idle_reports`] reports is abandoned; at the end of the
//! window of a bucket's tightest limit the stream is pushed fresh assignments.

mod allocate;
pub mod bucket;
mod peers;
mod server;
mod stream;
mod work;

use crate::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use crate::proto::envoy::service::rate_limit_quota::v3::{
    RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use crate::service::RateLimiter;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use stream::QuotaStream;
use tokio::sync::watch;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// Bounds of the quota service (`RLQS_MAX_*`), so no client can grow its memory without limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaSettings {
    /// Buckets one stream may hold; a new limited bucket past it is denied until its next
    /// report and is not tracked (a bucket no limit names is never tracked).
    pub max_buckets_per_stream: usize,
    /// Buckets all streams together may hold; past it the same.
    pub max_buckets: usize,
    /// Open streams; one past it is refused with RESOURCE_EXHAUSTED.
    pub max_streams: usize,
    /// Open streams from one peer (IP address; the Unix socket is one peer); one past it is
    /// refused with RESOURCE_EXHAUSTED, so no client holds the whole of `max_streams`.
    pub max_streams_per_peer: usize,
    /// Consecutive reports without usage after which a bucket is abandoned.
    pub idle_reports: u32,
    /// `/debug/rlqs` shows bucket values (else only their length).
    pub show_values: bool,
    /// A bucket not reported for this long is abandoned (its peer is gone, or holds it only to
    /// fill the caps).
    pub bucket_timeout: Duration,
    /// A stream that sends no first report within this is ended (an Envoy sends its first
    /// report as it opens the stream).
    pub first_report_timeout: Duration,
    /// A stream that holds no tracked bucket (one naming a limit) for this long is ended: it
    /// holds a place under `max_streams` and has nothing to be assigned.
    pub idle_stream_timeout: Duration,
    /// The largest usage report taken, in bytes (refused from its length prefix, unread).
    pub max_report_bytes: usize,
    /// Usages one report may carry, counted before it is decoded.
    pub max_usages_per_report: usize,
    /// Reports of one stream are taken at most this often: one sent sooner waits, merged with
    /// any others sent meanwhile, so a peer cannot make sluice do a report's store work more
    /// often than this (Envoy's `reporting_interval` is 5 s in its examples).
    pub min_report_interval: Duration,
    /// Store calls the RLQS streams of this process make at once, all streams together: a
    /// flood of reports queues here instead of on the store every RLS request needs.
    pub max_store_calls: usize,
    /// A stream is ended (its assignments sent again with a reconnect TTL, then OK) once it is
    /// this old, 0.9-1.1x jittered per stream: `GRPC_MAX_CONNECTION_AGE`, so a connection that
    /// holds an RLQS stream is recycled too (Envoy opens a new stream, and a new connection).
    pub max_stream_age: Option<Duration>,
}

impl Default for QuotaSettings {
    fn default() -> Self {
        Self {
            max_buckets_per_stream: 10_000,
            max_buckets: 20_000,
            max_streams: 10_000,
            max_streams_per_peer: 1_000,
            idle_reports: 3,
            show_values: false,
            bucket_timeout: Duration::from_secs(300),
            first_report_timeout: Duration::from_secs(30),
            idle_stream_timeout: Duration::from_secs(60),
            max_report_bytes: MAX_REPORT_BYTES,
            max_usages_per_report: 100_000,
            min_report_interval: Duration::from_secs(1),
            max_store_calls: 64,
            max_stream_age: None,
        }
    }
}

/// The default largest usage report (`RLQS_MAX_REPORT_BYTES`): Envoy reports every bucket it
/// holds in one message, about 80 bytes each, so 8 MiB is about 100 000 buckets (the default
/// `RLQS_MAX_USAGES_PER_REPORT`); an Envoy holding more has its stream ended and reconnects to
/// the same refusal, so both are settings. One message per stream is in memory at a time.
pub const MAX_REPORT_BYTES: usize = 8 << 20;

/// The RLQS gRPC service around the one `RateLimiter` (its rules and store).
#[derive(Debug, Clone)]
pub struct QuotaService {
    limiter: Arc<RateLimiter>,
    shared: Arc<Shared>,
    /// Turns true when the server drains: every stream re-sends its assignments with a
    /// reconnect-covering TTL and ends, so the drain does not wait on streams that never end.
    closing: watch::Receiver<bool>,
}

/// What the streams of this process share.
#[derive(Debug)]
struct Shared {
    settings: QuotaSettings,
    /// Names this process's streams on the demand boards other replicas read too.
    nonce: String,
    next_stream: AtomicU64,
    streams: AtomicUsize,
    /// Buckets held by all streams (against [`QuotaSettings::max_buckets`]).
    buckets: AtomicUsize,
    /// Streams and buckets per domain: each stream's fair share of the bucket cap.
    census: stream::Census,
    /// Open streams per peer (against [`QuotaSettings::max_streams_per_peer`]).
    peers: peers::Peers,
    /// [`QuotaSettings::max_store_calls`].
    store_calls: Arc<tokio::sync::Semaphore>,
}

impl QuotaService {
    pub fn new(
        limiter: Arc<RateLimiter>,
        settings: QuotaSettings,
        closing: watch::Receiver<bool>,
    ) -> Self {
        Self {
            limiter,
            closing,
            shared: Arc::new(Shared {
                settings,
                nonce: process_nonce(),
                next_stream: AtomicU64::new(1),
                streams: AtomicUsize::new(0),
                buckets: AtomicUsize::new(0),
                census: stream::Census::default(),
                peers: peers::Peers::default(),
                store_calls: Arc::new(tokio::sync::Semaphore::new(settings.max_store_calls.max(1))),
            }),
        }
    }

    /// The gRPC service, taking reports of the settings' bytes and usages at most.
    pub fn into_server(self) -> server::QuotaServer {
        let s = self.shared.settings;
        server::QuotaServer::new(self, s.max_report_bytes, s.max_usages_per_report)
    }
}

impl QuotaService {
    fn refuse(&self, reason: &str) {
        let m = &self.limiter.telemetry().metrics.quota;
        m.refused.with_label_values(&[reason]).inc();
    }
}

/// A value no other process picks (std's hasher keys are random per process), so stream ids
/// of two replicas never meet on a board.
fn process_nonce() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!("{:016x}", h.finish())
}

#[tonic::async_trait]
impl RateLimitQuotaService for QuotaService {
    type StreamRateLimitQuotasStream = ReceiverStream<Result<RateLimitQuotaResponse, Status>>;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        let s = &self.shared.settings;
        let peer = request.remote_addr().map(|a| a.ip().to_canonical());
        if !self.shared.peers.enter(peer, s.max_streams_per_peer) {
            self.refuse("over_peer_stream_cap");
            return Err(Status::resource_exhausted(format!(
                "this peer holds its maximum of {} RLQS streams (RLQS_MAX_STREAMS_PER_PEER)",
                s.max_streams_per_peer
            )));
        }
        let open = self.shared.streams.fetch_add(1, Ordering::AcqRel);
        if open >= s.max_streams {
            self.shared.streams.fetch_sub(1, Ordering::AcqRel);
            self.shared.peers.leave(peer);
            self.refuse("over_stream_cap");
            return Err(Status::resource_exhausted(format!(
                "this sluice holds its maximum of {} RLQS streams (RLQS_MAX_STREAMS)",
                s.max_streams
            )));
        }
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let number = self.shared.next_stream.fetch_add(1, Ordering::Relaxed);
        let shared = Arc::clone(&self.shared);
        let stream = QuotaStream::new(number, Arc::clone(&self.limiter), shared, peer);
        tokio::spawn(stream.run(request.into_inner(), tx, self.closing.clone()));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}
