//! One RLQS stream: the buckets one Envoy reports on one domain, their reservations on the
//! counters and their assignments.
//!
//! For each bucket in a report: the allowed count is recorded on the bucket's counters, less
//! the tokens reserved for it at the previous report (so a report reconciles its reservation
//! with the use; a negative difference is given back); the stream's demand is posted on the
//! tightest counter's demand board and everyone's read back; the stream's max-min fair share
//! of `(remaining + what the others hold reserved) / time left` is sent as a token bucket; and
//! the tokens that bucket can hand out until the next report are reserved on the counter, so
//! RLS requests and other streams cannot spend them twice.
//!
//! A report straddling a window's end is split on sluice's clock: the part before the end was
//! used in the window that closed (and was reserved there) and is not charged to the new one.

use super::allocate::{blanket, token_rate, ALLOW_TTL, ASSIGNMENT_TTL};
use super::work::{Assigned, Reserve, Step, Worker};
use super::{bucket, Shared};
use actions::{abandon_action, assign, bucket_id};

mod actions;
mod admit;
mod caps;
mod expiry;
mod farewell;
mod pace;
mod rules;
use crate::proto::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use crate::proto::envoy::r#type::v3::RateLimitStrategy;
use crate::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use crate::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use crate::proto::envoy::service::rate_limit_quota::v3::{
    RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use crate::service::RateLimiter;
use crate::store::CounterKey;
use crate::telemetry::assignments::AssignmentView;
pub use caps::Census;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tonic::{Status, Streaming};

/// The TTL of the assignments re-sent when sluice drains: long enough for Envoy to reconnect
/// (to another replica) and get fresh ones, so its buckets stay limited meanwhile.
const RECONNECT_TTL: Duration = Duration::from_secs(60);

/// A bucket's pairs, sorted: its name in the stream (shared with the debug view, and with the
/// descriptor when the two are the same, so each bucket holds its strings once).
type Pairs = Arc<[(String, String)]>;

/// A bucket a stream reports.
#[derive(Debug)]
struct Bucket {
    /// The RLS descriptor it stands for; `None` when it names no limit.
    descriptor: Option<Pairs>,
    last_report: Option<Duration>,
    idle: u32,
    /// Requests per second this stream used, measured between its last two reports.
    demand: Option<f64>,
    /// The token rate it was last assigned (requests per second; 0 for a blanket rule).
    rate: f64,
    /// The counter its assignment was paced on, and when that counter's window ends.
    tightest: Option<(CounterKey, Duration)>,
    /// Tokens reserved on that counter until the next report, and the end of the window they
    /// were reserved in (a reservation in a window that has closed is not given back).
    reserved: Option<(u64, Duration)>,
    /// The last window end that passed (see [`QuotaStream::account`]).
    boundary: Option<Duration>,
}

pub(super) struct QuotaStream {
    number: u64,
    /// The stream's name on demand boards (unique across replicas).
    name: Arc<str>,
    limiter: Arc<RateLimiter>,
    shared: Arc<Shared>,
    domain: Option<String>,
    /// The domain as metrics label it (`unknown` for one the config does not have).
    label: Option<String>,
    /// The rules the buckets' descriptors were resolved on: a reload or an xDS push re-resolves
    /// them, so a changed tree (or a first config) applies to buckets already held.
    rules: Option<Arc<crate::config::RuleSet>>,
    buckets: HashMap<Pairs, Bucket>,
    /// When the stream opened, on sluice's clock (for the first-report deadline).
    opened: Duration,
    /// Reports waiting for the minimum interval (`pace.rs`).
    pending: pace::Pending,
    /// When the stream ends of old age (`RLQS_MAX_STREAM_AGE`: the connection's), if it does.
    age_due: Option<Duration>,
    /// The peer's address (`None` over the Unix socket), counted under its stream cap.
    peer: Option<std::net::IpAddr>,
    /// Since when the stream has held no tracked bucket, once it has a domain (`expiry.rs`).
    empty_since: Option<Duration>,
}

type Outbox = tokio::sync::mpsc::Sender<Result<RateLimitQuotaResponse, Status>>;

/// One bucket's place in a response: an action known now, or one its store work decides
/// (a forgotten bucket has both: its abandon, and its reservation to give back).
enum Slot {
    Ready(BucketAction),
    Work(Step),
    Forget(Step, BucketAction),
}

impl QuotaStream {
    pub(super) fn new(
        number: u64,
        limiter: Arc<RateLimiter>,
        shared: Arc<Shared>,
        peer: Option<std::net::IpAddr>,
    ) -> Self {
        Self {
            number,
            name: Arc::from(format!("{}-{number}", shared.nonce)),
            limiter,
            shared,
            domain: None,
            label: None,
            rules: None,
            buckets: HashMap::new(),
            opened: Duration::ZERO,
            pending: pace::Pending::default(),
            age_due: None,
            peer,
            empty_since: None,
        }
    }

    pub(super) async fn run(
        mut self,
        mut inbound: Streaming<RateLimitQuotaUsageReports>,
        tx: Outbox,
        mut closing: watch::Receiver<bool>,
    ) {
        self.opened = self.now();
        let s = self.shared.settings;
        self.age_due = s
            .max_stream_age
            .map(|age| self.opened.saturating_add(pace::jittered(age, self.number)));
        loop {
            let boundary = self.next_boundary();
            let expiry = self.next_expiry();
            let room = self
                .pending
                .has_room(s.max_usages_per_report, s.max_report_bytes);
            let waiting = self.pending.due(s.min_report_interval);
            let actions = tokio::select! {
                m = inbound.message(), if room => match m {
                    Ok(Some(report)) if self.domain.is_some() || !report.domain.is_empty() => {
                        if let Err(why) = self.admit(&report.domain) {
                            let _ = tx.send(Err(why)).await;
                            break;
                        }
                        match self.pending.offer(report, self.now(), s.min_report_interval) {
                            Some(report) => self.on_report(report).await,
                            None => Vec::new(),
                        }
                    }
                    m => {
                        if let Some(why) = actions::ending(m, self.number) {
                            let _ = tx.send(Err(why)).await;
                        }
                        break;
                    }
                },
                () = sleep_until(waiting, self.now()) => match self.pending.take(self.now()) {
                    Some(report) => self.on_report(report).await,
                    None => Vec::new(),
                },
                () = sleep_until(boundary, self.now()) => self.refresh().await,
                () = sleep_until(expiry, self.now()) => match self.expire().await {
                    Ok(actions) => actions,
                    Err(why) => {
                        let _ = tx.send(Err(why)).await;
                        break;
                    }
                },
                () = sleep_until(self.age_due, self.now()) => {
                    self.leave(&tx).await;
                    break;
                }
                () = closed(&mut closing) => {
                    self.leave(&tx).await;
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
        self.end().await;
    }

    /// The stream is over: its postings come off the boards, its gauges and views go. Its
    /// reservations stay on the counters until their windows end: the Envoy may have used them.
    async fn end(&mut self) {
        let withdrawals: Vec<Step> = self
            .buckets
            .values()
            .filter_map(|b| b.tightest.as_ref())
            .map(|(key, _)| Step::Forget {
                descriptor: None,
                tightest: Some(key.clone()),
                delta: 0,
            })
            .collect();
        let worker = self.worker();
        worker.run(&withdrawals).await;
        self.shared.streams.fetch_sub(1, Ordering::AcqRel);
        self.shared.peers.leave(self.peer);
        self.shared
            .buckets
            .fetch_sub(self.buckets.len(), Ordering::AcqRel);
        if let Some(d) = &self.domain {
            self.shared.census.leave(d, self.buckets.len());
        }
        self.limiter
            .telemetry()
            .assignments
            .remove_stream(self.number);
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

    /// What runs this stream's store work (see `work.rs`).
    fn worker(&self) -> Worker {
        Worker {
            limiter: Arc::clone(&self.limiter),
            name: Arc::clone(&self.name),
            domain: self.domain.clone(),
            calls: Arc::clone(&self.shared.store_calls),
        }
    }

    /// Now on the service's clock (injected: tests drive window ends with a manual clock).
    fn now(&self) -> Duration {
        self.limiter.telemetry().clock.now()
    }

    fn metrics(&self) -> &crate::telemetry::quota_metrics::QuotaMetrics {
        &self.limiter.telemetry().metrics.quota
    }

    fn label(&self) -> &str {
        self.label.as_deref().unwrap_or("unknown")
    }

    fn refuse(&self, reason: &str) {
        self.metrics().refused.with_label_values(&[reason]).inc();
    }

    /// The earliest end of a window an assignment of this stream was paced on.
    fn next_boundary(&self) -> Option<Duration> {
        self.buckets
            .values()
            .filter_map(|b| b.tightest.as_ref().map(|(_, at)| *at))
            .min()
    }

    async fn on_report(&mut self, report: RateLimitQuotaUsageReports) -> Vec<BucketAction> {
        self.follow_rules();
        // A window that ended since the last report (its timer may not have fired yet):
        // the report is split at its end, as after a refresh.
        let now = self.now();
        for b in self.buckets.values_mut() {
            if b.tightest.as_ref().is_some_and(|(_, end)| *end <= now) {
                b.boundary = b.tightest.take().map(|(_, end)| end);
                b.reserved = None;
            }
        }
        let caps = self.limiter.options().caps;
        let shed = self.to_shed();
        let mut slots = Vec::new();
        let mut seen = HashSet::new();
        for usage in report.bucket_quota_usages {
            let Some(id) = usage.bucket_id else {
                self.refuse("empty");
                continue;
            };
            if let Err(why) = bucket::check(&id.bucket, &caps) {
                self.refuse(why.label());
                continue;
            }
            if usage.num_requests_allowed > crate::algorithm::MAX_HITS
                || usage.num_requests_denied > crate::algorithm::MAX_HITS
            {
                self.refuse("absurd_count");
                continue;
            }
            let mut sorted: Vec<(String, String)> = id.bucket.into_iter().collect();
            sorted.sort();
            let pairs: Pairs = Arc::from(sorted);
            if !seen.insert(Arc::clone(&pairs)) {
                // Envoy sends a bucket once per report; a second one would double its reservation.
                self.refuse("duplicate");
                continue;
            }
            let label = self.label().to_string();
            self.metrics()
                .bucket_reports
                .with_label_values(&[&label])
                .inc();
            let reported = &self.metrics().reported;
            reported
                .with_label_values(&[&label, "allowed"])
                .inc_by(usage.num_requests_allowed);
            reported
                .with_label_values(&[&label, "denied"])
                .inc_by(usage.num_requests_denied);
            let used = usage
                .num_requests_allowed
                .saturating_add(usage.num_requests_denied);
            if !self.buckets.contains_key(&pairs) {
                if let Some(action) = self.untracked(&pairs, used) {
                    slots.push(Slot::Ready(action));
                    continue;
                }
                self.track(Arc::clone(&pairs));
            }
            let shedding = shed.contains(&pairs);
            if shedding {
                self.refuse("over_fair_share");
            }
            slots.extend(self.account(&pairs, usage.num_requests_allowed, used, shedding));
        }
        slots.extend(self.shed_unreported(&shed, &seen));
        self.answer(slots).await
    }

    fn track(&mut self, pairs: Pairs) {
        self.empty_since = None;
        if let Some(d) = &self.domain {
            self.shared.census.count(d, true);
        }
        let label = self.label().to_string();
        self.metrics().buckets.with_label_values(&[&label]).inc();
        let descriptor = self.resolve(&pairs);
        self.buckets.insert(
            pairs,
            Bucket {
                descriptor,
                last_report: None,
                idle: 0,
                demand: None,
                rate: 0.0,
                tightest: None,
                reserved: None,
                boundary: None,
            },
        );
    }

    /// Takes a bucket's report in: its demand, the use to record (reconciled with what was
    /// reserved for it), and whether it is abandoned (idle, or `shed`) or assigned.
    fn account(&mut self, pairs: &Pairs, allowed: u64, used: u64, shed: bool) -> Option<Slot> {
        let now = self.now();
        let idle_limit = self.shared.settings.idle_reports;
        let bucket = self.buckets.get_mut(pairs)?;
        // Demand on sluice's clock: `time_elapsed` is whole seconds and may be 0.
        if let Some(at) = bucket.last_report {
            let secs = now.saturating_sub(at).as_secs_f64();
            if secs >= 0.5 {
                bucket.demand = Some(used as f64 / secs);
            }
        }
        // The part of a report straddling a window's end that fell before it belongs to the
        // closed window.
        let allowed = match (bucket.boundary.take(), bucket.last_report) {
            (Some(end), Some(prev)) if prev < end && end <= now => {
                let after = now.saturating_sub(end).as_secs_f64();
                let span = now.saturating_sub(prev).as_secs_f64().max(f64::EPSILON);
                (allowed as f64 * (after / span).min(1.0)).round() as u64
            }
            _ => allowed,
        };
        // Reconciled with what was reserved for it in this window.
        let held = match bucket.reserved {
            Some((tokens, end)) if now < end => tokens,
            _ => 0,
        };
        let delta = i64::try_from(allowed).unwrap_or(i64::MAX) - i64::try_from(held).unwrap_or(0);
        bucket.last_report = Some(now);
        bucket.idle = if used == 0 { bucket.idle + 1 } else { 0 };
        if bucket.idle >= idle_limit || shed {
            return Some(self.abandon(pairs, delta));
        }
        self.step(pairs, delta, Reserve::Yes).map(Slot::Work)
    }

    /// The store work assigning a bucket, recording `delta` first.
    fn step(&self, pairs: &Pairs, delta: i64, reserve: Reserve) -> Option<Step> {
        let b = self.buckets.get(pairs)?;
        Some(Step::Assign {
            pairs: Arc::clone(pairs),
            descriptor: b.descriptor.clone(),
            demand: b.demand,
            // Posted as this stream's reservation while its new one is being made: the last
            // one is the best guess of it.
            posted: b.reserved.map_or(0, |(t, _)| t),
            delta,
            reserve,
        })
    }

    fn abandon(&mut self, pairs: &Pairs, delta: i64) -> Slot {
        self.set_rate(pairs, 0.0);
        let gone = self.buckets.remove(pairs);
        if self.buckets.is_empty() {
            self.empty_since = Some(self.now());
        }
        self.shared.buckets.fetch_sub(1, Ordering::AcqRel);
        if let Some(d) = &self.domain {
            self.shared.census.count(d, false);
        }
        let label = self.label().to_string();
        self.metrics().buckets.with_label_values(&[&label]).dec();
        self.limiter
            .telemetry()
            .assignments
            .remove_bucket(self.number, pairs);
        let forget = Step::Forget {
            descriptor: gone.as_ref().and_then(|b| b.descriptor.clone()),
            tightest: gone.and_then(|b| b.tightest.map(|(k, _)| k)),
            delta,
        };
        Slot::Forget(forget, abandon_action(bucket_id(pairs)))
    }

    /// Runs the store work of `slots` (concurrently) and returns the response's actions, in
    /// the slots' order.
    async fn answer(&mut self, slots: Vec<Slot>) -> Vec<BucketAction> {
        let mut steps = Vec::new();
        let mut order = Vec::with_capacity(slots.len());
        for slot in slots {
            match slot {
                Slot::Ready(a) => order.push(Ok(a)),
                Slot::Forget(step, a) => {
                    steps.push(step);
                    order.push(Ok(a));
                }
                Slot::Work(step) => {
                    order.push(Err(steps.len()));
                    steps.push(step);
                }
            }
        }
        let worker = self.worker();
        let mut results = worker.run(&steps).await;
        order
            .into_iter()
            .filter_map(|o| match o {
                Ok(a) => Some(a),
                Err(i) => {
                    let done = results.get_mut(i).and_then(Option::take);
                    self.apply(&steps[i], done)
                }
            })
            .collect()
    }

    /// Writes what a bucket's store work found into the stream and returns its action.
    fn apply(&mut self, step: &Step, done: Option<Assigned>) -> Option<BucketAction> {
        let Step::Assign { pairs, .. } = step else {
            return None;
        };
        match done? {
            Assigned::Unlimited => {
                Some(self.send(pairs, blanket(BlanketRule::AllowAll), ALLOW_TTL))
            }
            Assigned::Failed => None,
            Assigned::Paced {
                tightest,
                remaining,
                left,
                strategy,
                reserved,
                board_full,
            } => {
                if board_full {
                    self.refuse("board_full");
                }
                let ends = self.now() + left.max(Duration::from_millis(100));
                if let Some(b) = self.buckets.get_mut(pairs) {
                    b.tightest = Some((tightest, ends));
                    b.reserved = reserved.map(|t| (t, ends));
                }
                let ttl_for = if remaining == 0 { left } else { ASSIGNMENT_TTL };
                Some(self.send(pairs, strategy, ttl_for))
            }
        }
    }

    /// The action for a bucket, recorded in the gauges and the debug view.
    fn send(
        &mut self,
        pairs: &[(String, String)],
        strategy: RateLimitStrategy,
        ttl_for: Duration,
    ) -> BucketAction {
        let rate = token_rate(&strategy);
        self.set_rate(pairs, rate);
        if let (Some(domain), Some((key, b))) = (&self.domain, self.buckets.get_key_value(pairs)) {
            let action = match &strategy.strategy {
                Some(Strategy::TokenBucket(_)) => "token_bucket",
                Some(Strategy::BlanketRule(r)) if *r == BlanketRule::DenyAll as i32 => "deny_all",
                _ => "allow_all",
            };
            let view = AssignmentView {
                action,
                tokens_per_second: rate,
                ttl_seconds: ttl_for.as_secs().max(1),
                reserved: b.reserved.map_or(0, |(t, _)| t),
                demand: b.demand,
            };
            self.limiter
                .telemetry()
                .assignments
                .set(self.number, domain, key, view);
        }
        assign(bucket_id(pairs), strategy, ttl_for)
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

    /// At a window's end: every bucket that has a limit gets a fresh assignment (and a
    /// reservation in the new window).
    async fn refresh(&mut self) -> Vec<BucketAction> {
        let now = self.now();
        let due: Vec<Pairs> = self
            .buckets
            .iter()
            .filter(|(_, b)| b.tightest.as_ref().is_some_and(|(_, at)| *at <= now))
            .map(|(k, _)| Arc::clone(k))
            .collect();
        let mut slots = Vec::new();
        for pairs in due {
            if let Some(b) = self.buckets.get_mut(&pairs) {
                b.boundary = b.tightest.take().map(|(_, end)| end);
                b.reserved = None;
            }
            slots.extend(self.step(&pairs, 0, Reserve::Yes).map(Slot::Work));
        }
        self.answer(slots).await
    }
}

/// Resolves once the server drains (or nobody can tell any more).
async fn closed(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|c| *c).await;
}

/// Sleeps until `at` on the service's clock (`now` being its time at the call).
async fn sleep_until(at: Option<Duration>, now: Duration) {
    match at {
        Some(at) => tokio::time::sleep(at.saturating_sub(now)).await,
        None => std::future::pending().await,
    }
}
