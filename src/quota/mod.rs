//! The Rate Limit Quota Service (`envoy.service.rate_limit_quota.v3`, RLQS): Envoy's
//! `rate_limit_quota` filter keeps one stream per domain, reports per-bucket usage every 5 s and
//! enforces the assignments it gets locally, so the decision leaves the request path. A bucket
//! names the same limit and counter as the RLS descriptor with the same pairs (`bucket.rs`);
//! every reported `num_requests_allowed` is recorded on that counter through the store (always,
//! whatever the domain's counting), and each stream is assigned its max-min fair share of what
//! the window still has, paced over the time left (`allocate.rs`).
//!
//! Per stream: reports are answered with one action per bucket; a bucket idle for
//! [`QuotaSettings::idle_reports`] reports is abandoned; at the end of the window of a bucket's
//! tightest limit the stream is pushed fresh assignments. Demand per stream lives in this
//! process (`Demand`): streams of one counter through several replicas each see only their
//! own, which the README states.

mod allocate;
pub mod bucket;

use crate::proto::envoy::r#type::v3::rate_limit_strategy::BlanketRule;
use crate::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action, QuotaAssignmentAction,
};
use crate::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use crate::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
    RateLimitQuotaService, RateLimitQuotaServiceServer,
};
use crate::proto::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use crate::service::RateLimiter;
use crate::store::CounterKey;
use allocate::{available_rate, blanket, max_min_shares, strategy, ttl, ALLOW_TTL, ASSIGNMENT_TTL};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// Bounds of the quota service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaSettings {
    /// Buckets one stream may hold; a new bucket past it gets ALLOW_ALL and is not tracked.
    pub max_buckets_per_stream: usize,
    /// Consecutive reports without usage after which a bucket is abandoned.
    pub idle_reports: u32,
}

impl Default for QuotaSettings {
    fn default() -> Self {
        Self {
            max_buckets_per_stream: 1_000,
            idle_reports: 3,
        }
    }
}

/// How recent a stream's demand must be to count in another stream's share.
const DEMAND_FRESH: Duration = Duration::from_secs(15);

/// The TTL of the assignments re-sent when sluice drains: long enough for Envoy to reconnect
/// (to another replica) and get fresh ones, so its buckets stay limited meanwhile.
const RECONNECT_TTL: Duration = Duration::from_secs(60);

/// Per stream id: its demand (requests per second; `None` until measured) and when it came.
type StreamDemands = HashMap<u64, (Option<f64>, Instant)>;

/// The RLQS gRPC service around the one `RateLimiter` (its rules and store).
#[derive(Debug, Clone)]
pub struct QuotaService {
    limiter: Arc<RateLimiter>,
    shared: Arc<Shared>,
    /// Turns true when the server drains: every stream re-sends its assignments with
    /// [`RECONNECT_TTL`] and ends, so the drain does not wait on streams that never end.
    closing: watch::Receiver<bool>,
}

#[derive(Debug)]
struct Shared {
    settings: QuotaSettings,
    /// Per counter, per stream: the demand it measured (requests per second, `None` until a
    /// second report measures it) and when.
    demand: Mutex<HashMap<CounterKey, StreamDemands>>,
    next_stream: AtomicU64,
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
                demand: Mutex::new(HashMap::new()),
                next_stream: AtomicU64::new(1),
            }),
        }
    }

    pub fn into_server(self) -> RateLimitQuotaServiceServer<Self> {
        RateLimitQuotaServiceServer::new(self)
    }
}

impl Shared {
    /// Records `stream`'s demand on `key` and returns its share of `available`.
    fn share(&self, key: &CounterKey, stream: u64, demand: Option<f64>, available: f64) -> f64 {
        let now = Instant::now();
        let mut all = self.demand.lock().unwrap_or_else(|e| e.into_inner());
        let streams = all.entry(key.clone()).or_default();
        streams.insert(stream, (demand, now));
        streams.retain(|_, (_, at)| now.duration_since(*at) <= DEMAND_FRESH);
        let ids: Vec<u64> = streams.keys().copied().collect();
        let demands: Vec<Option<f64>> = ids.iter().map(|id| streams[id].0).collect();
        let shares = max_min_shares(&demands, available);
        ids.iter()
            .position(|&id| id == stream)
            .map_or(available, |i| shares[i])
    }

    /// Forgets `stream` (its end, or an abandoned bucket's counter).
    fn forget(&self, stream: u64, key: Option<&CounterKey>) {
        let mut all = self.demand.lock().unwrap_or_else(|e| e.into_inner());
        match key {
            Some(k) => {
                if let Some(s) = all.get_mut(k) {
                    s.remove(&stream);
                }
            }
            None => all.values_mut().for_each(|s| {
                s.remove(&stream);
            }),
        }
        all.retain(|_, s| !s.is_empty());
    }
}

#[tonic::async_trait]
impl RateLimitQuotaService for QuotaService {
    type StreamRateLimitQuotasStream = ReceiverStream<Result<RateLimitQuotaResponse, Status>>;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let stream = QuotaStream {
            id: self.shared.next_stream.fetch_add(1, Ordering::Relaxed),
            limiter: Arc::clone(&self.limiter),
            shared: Arc::clone(&self.shared),
            domain: None,
            label: None,
            buckets: HashMap::new(),
        };
        tokio::spawn(stream.run(request.into_inner(), tx, self.closing.clone()));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// A bucket a stream reports.
#[derive(Debug)]
struct Bucket {
    id: BucketId,
    /// The RLS descriptor it stands for; `None` when it names no limit.
    descriptor: Option<Vec<(String, String)>>,
    last_report: Option<Instant>,
    idle: u32,
    /// The token rate it was last assigned (requests per second; 0 for a blanket rule).
    rate: f64,
    /// The counter its assignment was paced on, and when that counter's window ends.
    tightest: Option<(CounterKey, Instant)>,
    /// The last window end that passed (see [`QuotaStream::account`]).
    boundary: Option<Instant>,
}

struct QuotaStream {
    id: u64,
    limiter: Arc<RateLimiter>,
    shared: Arc<Shared>,
    domain: Option<String>,
    /// The domain as metrics label it (`unknown` for one the config does not have).
    label: Option<String>,
    /// By the bucket's pairs, sorted.
    buckets: HashMap<Vec<(String, String)>, Bucket>,
}

type Outbox = tokio::sync::mpsc::Sender<Result<RateLimitQuotaResponse, Status>>;

impl QuotaStream {
    async fn run(
        mut self,
        mut inbound: Streaming<RateLimitQuotaUsageReports>,
        tx: Outbox,
        mut closing: watch::Receiver<bool>,
    ) {
        loop {
            let boundary = self.next_boundary();
            let actions = tokio::select! {
                m = inbound.message() => match m {
                    Ok(Some(report)) => self.on_report(report).await,
                    Ok(None) | Err(_) => break,
                },
                () = sleep_until(boundary) => self.refresh().await,
                () = closed(&mut closing) => {
                    let farewell = self.farewell().await;
                    if !farewell.is_empty() {
                        let _ = tx.send(Ok(RateLimitQuotaResponse { bucket_action: farewell })).await;
                    }
                    break;
                }
            };
            if !actions.is_empty() {
                let response = RateLimitQuotaResponse {
                    bucket_action: actions,
                };
                if tx.send(Ok(response)).await.is_err() {
                    break;
                }
            }
        }
        self.shared.forget(self.id, None);
        if let Some(label) = &self.label {
            let m = &self.limiter.telemetry().metrics.quota;
            m.streams.with_label_values(&[label]).dec();
            m.buckets
                .with_label_values(&[label])
                .sub(i64::try_from(self.buckets.len()).unwrap_or(i64::MAX));
            let rate: f64 = self.buckets.values().map(|b| b.rate).sum();
            m.assigned_rate.with_label_values(&[label]).sub(rate);
        }
    }

    fn metrics(&self) -> &crate::telemetry::metrics::QuotaMetrics {
        &self.limiter.telemetry().metrics.quota
    }

    fn label(&self) -> &str {
        self.label.as_deref().unwrap_or("unknown")
    }

    /// Moves the assigned-rate gauge by a bucket's change of rate.
    fn set_rate(&mut self, pairs: &[(String, String)], rate: f64) {
        let Some(old) = self
            .buckets
            .get_mut(pairs)
            .map(|b| std::mem::replace(&mut b.rate, rate))
        else {
            return;
        };
        let label = self.label().to_string();
        self.metrics()
            .assigned_rate
            .with_label_values(&[&label])
            .add(rate - old);
    }

    /// The earliest end of a window an assignment of this stream was paced on.
    fn next_boundary(&self) -> Option<Instant> {
        self.buckets
            .values()
            .filter_map(|b| b.tightest.as_ref().map(|(_, at)| *at))
            .min()
    }

    async fn on_report(&mut self, report: RateLimitQuotaUsageReports) -> Vec<BucketAction> {
        if self.domain.is_none() && !report.domain.is_empty() {
            let known = self.limiter.rules().domains.contains_key(&report.domain);
            let label = if known {
                report.domain.as_str()
            } else {
                "unknown"
            };
            self.metrics().streams.with_label_values(&[label]).inc();
            self.label = Some(label.to_string());
            self.domain = Some(report.domain.clone());
        }
        let caps = self.limiter.options().caps;
        let mut actions = Vec::new();
        for usage in report.bucket_quota_usages {
            let refused = &self.metrics().refused;
            let Some(id) = usage.bucket_id else {
                refused.with_label_values(&["empty"]).inc();
                continue;
            };
            if let Err(why) = bucket::check(&id.bucket, &caps) {
                refused.with_label_values(&[why.label()]).inc();
                continue;
            }
            let used = usage
                .num_requests_allowed
                .saturating_add(usage.num_requests_denied);
            if usage.num_requests_allowed > crate::algorithm::MAX_HITS {
                refused.with_label_values(&["absurd_count"]).inc();
                continue;
            }
            let label = self.label().to_string();
            let reported = &self.metrics().reported;
            reported
                .with_label_values(&[&label, "allowed"])
                .inc_by(usage.num_requests_allowed);
            reported
                .with_label_values(&[&label, "denied"])
                .inc_by(usage.num_requests_denied);
            let mut pairs: Vec<(String, String)> = id
                .bucket
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            pairs.sort();
            if !self.buckets.contains_key(&pairs) {
                if self.buckets.len() >= self.shared.settings.max_buckets_per_stream {
                    refused.with_label_values(&["over_bucket_cap"]).inc();
                    actions.push(assign(id, blanket(BlanketRule::AllowAll), ALLOW_TTL));
                    continue;
                }
                self.metrics().buckets.with_label_values(&[&label]).inc();
                let descriptor = self.descriptor_of(&id);
                self.buckets.insert(
                    pairs.clone(),
                    Bucket {
                        id: id.clone(),
                        descriptor,
                        last_report: None,
                        idle: 0,
                        rate: 0.0,
                        tightest: None,
                        boundary: None,
                    },
                );
            }
            let action = self.account(&pairs, usage.num_requests_allowed, used).await;
            actions.extend(action);
        }
        actions
    }

    fn descriptor_of(&self, id: &BucketId) -> Option<Vec<(String, String)>> {
        let rules = self.limiter.rules();
        let domain = rules.domains.get(self.domain.as_deref()?)?;
        bucket::descriptor_of(domain, &id.bucket)
    }

    /// Records a bucket's report and decides its next action (none when the store could not
    /// be asked: Envoy keeps the assignment it has until its TTL).
    async fn account(
        &mut self,
        pairs: &[(String, String)],
        allowed: u64,
        used: u64,
    ) -> Option<BucketAction> {
        let now = Instant::now();
        let idle_limit = self.shared.settings.idle_reports;
        let bucket = self.buckets.get_mut(pairs)?;
        // Demand on sluice's clock: `time_elapsed` is whole seconds and may be 0.
        let demand = bucket.last_report.and_then(|at| {
            let secs = now.duration_since(at).as_secs_f64();
            (secs >= 0.5).then(|| used as f64 / secs)
        });
        // A report straddling a window's end is split on sluice's clock: the part before the
        // end was used in the window that closed (its counter decides nothing any more) and is
        // not charged to the new one, which would otherwise start short by a report period.
        let allowed = match (bucket.boundary.take(), bucket.last_report) {
            (Some(end), Some(prev)) if prev < end && end <= now => {
                let after = now.duration_since(end).as_secs_f64();
                let span = now.duration_since(prev).as_secs_f64().max(f64::EPSILON);
                (allowed as f64 * (after / span).min(1.0)).round() as u64
            }
            _ => allowed,
        };
        bucket.last_report = Some(now);
        bucket.idle = if used == 0 { bucket.idle + 1 } else { 0 };
        if bucket.idle >= idle_limit {
            self.set_rate(pairs, 0.0);
            let gone = self.buckets.remove(pairs)?;
            let label = self.label().to_string();
            self.metrics().buckets.with_label_values(&[&label]).dec();
            self.shared
                .forget(self.id, gone.tightest.as_ref().map(|(k, _)| k));
            return Some(BucketAction {
                bucket_id: Some(gone.id),
                bucket_action: Some(Action::AbandonAction(AbandonAction {})),
            });
        }
        self.assignment(pairs, allowed, demand).await
    }

    /// Records `allowed` on the bucket's limits and assigns its share.
    async fn assignment(
        &mut self,
        pairs: &[(String, String)],
        allowed: u64,
        demand: Option<f64>,
    ) -> Option<BucketAction> {
        let (id, descriptor) = {
            let b = self.buckets.get(pairs)?;
            (b.id.clone(), b.descriptor.clone())
        };
        let (Some(domain), Some(descriptor)) = (self.domain.clone(), descriptor) else {
            return Some(assign(id, blanket(BlanketRule::AllowAll), ALLOW_TTL));
        };
        let recorded = self
            .limiter
            .record_usage(&domain, &descriptor, allowed)
            .await
            .ok()?;
        // The tightest limit: the lowest rate it can still afford.
        let Some(tightest) = recorded.into_iter().min_by(|a, b| {
            let rate = |r: &crate::service::Recorded| {
                available_rate(u64::from(r.outcome.remaining), r.outcome.reset)
            };
            rate(a).total_cmp(&rate(b))
        }) else {
            return Some(assign(id, blanket(BlanketRule::AllowAll), ALLOW_TTL));
        };
        let remaining = u64::from(tightest.outcome.remaining);
        let left = tightest.outcome.reset;
        let share = self.shared.share(
            &tightest.key,
            self.id,
            demand,
            available_rate(remaining, left),
        );
        if let Some(b) = self.buckets.get_mut(pairs) {
            let ends = Instant::now() + left.max(Duration::from_millis(100));
            b.tightest = Some((tightest.key, ends));
        }
        let ttl_for = if remaining == 0 { left } else { ASSIGNMENT_TTL };
        let strategy = strategy(share, remaining);
        self.set_rate(pairs, allocate::token_rate(&strategy));
        Some(assign(id, strategy, ttl_for))
    }

    /// When sluice drains: every bucket's assignment again, a token bucket's TTL stretched to
    /// [`RECONNECT_TTL`] (a DENY_ALL keeps its TTL: the window's end).
    async fn farewell(&mut self) -> Vec<BucketAction> {
        let all: Vec<Vec<(String, String)>> = self.buckets.keys().cloned().collect();
        let mut actions = Vec::new();
        for pairs in all {
            let Some(mut action) = self.assignment(&pairs, 0, None).await else {
                continue;
            };
            if let Some(Action::QuotaAssignmentAction(a)) = &mut action.bucket_action {
                let tokens = a
                    .rate_limit_strategy
                    .as_ref()
                    .is_some_and(|s| allocate::token_rate(s) > 0.0);
                if tokens {
                    a.assignment_time_to_live = Some(ttl(RECONNECT_TTL));
                }
            }
            actions.push(action);
        }
        actions
    }

    /// At a window's end: every bucket that has a limit gets a fresh assignment.
    async fn refresh(&mut self) -> Vec<BucketAction> {
        let now = Instant::now();
        let due: Vec<Vec<(String, String)>> = self
            .buckets
            .iter()
            .filter(|(_, b)| b.tightest.as_ref().is_some_and(|(_, at)| *at <= now))
            .map(|(k, _)| k.clone())
            .collect();
        let mut actions = Vec::new();
        for pairs in due {
            if let Some(b) = self.buckets.get_mut(&pairs) {
                b.boundary = b.tightest.take().map(|(_, end)| end);
            }
            actions.extend(self.assignment(&pairs, 0, None).await);
        }
        actions
    }
}

/// Resolves once the server drains (or nobody can tell any more).
async fn closed(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|c| *c).await;
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn assign(
    id: BucketId,
    strategy: crate::proto::envoy::r#type::v3::RateLimitStrategy,
    ttl_for: Duration,
) -> BucketAction {
    BucketAction {
        bucket_id: Some(id),
        bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(ttl(ttl_for)),
            rate_limit_strategy: Some(strategy),
        })),
    }
}
