//! The rate-limit decision: validate a `RateLimitRequest`, resolve each descriptor to its limit on
//! one config snapshot, let the store decide all of them at once, and fold the outcomes into a
//! `RateLimitResponse`. Metrics, the offenders view, traces and response headers are fed here,
//! from the one place that sees both the plan and the store's outcomes.

mod dynamic_metadata;
pub mod headers;

use crate::config::{Limit, Quota, RuleSet, Unit};
use crate::proto::envoy::r#type::v3::RateLimitUnit;
use crate::proto::rate_limit_response::{self, rate_limit, Code, DescriptorStatus};
use crate::proto::{RateLimitRequest, RateLimitResponse};
use crate::rules;
use crate::store::{
    Admission, CounterKey, CounterStore, Decision, LimitCheck, Outcome, StoreError,
};
use crate::telemetry::metrics::{DescriptorHits, RequestOutcome};
use crate::telemetry::Telemetry;
use opentelemetry::trace::{Span as _, SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue};

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// Service-wide switches.
#[derive(Debug, Clone)]
pub struct ServiceOptions {
    /// `SHADOW_MODE`: decide and count as usual, but always answer OK overall.
    pub global_shadow_mode: bool,
    /// `QUOTA_MODE`: every limit is a quota-mode limit, as if each descriptor set
    /// `quota_mode: true` (see [`crate::store::Admission`]).
    pub global_quota_mode: bool,
    /// `FAILURE_MODE`: what to answer when the counter store fails. `None` (the default)
    /// answers gRPC UNAVAILABLE, leaving the choice to Envoy's `failure_mode_deny`.
    pub failure_mode: Option<FailureMode>,
    /// `NEAR_LIMIT_RATIO`: allowed hits past this share of a limit count as `near_limit`.
    pub near_limit_ratio: f64,
    /// `LIMIT_RESPONSE_HEADERS_ENABLED`: the headers to add; `None` adds none.
    pub headers: Option<headers::HeaderOptions>,
    /// Bounds on what one request may ask for.
    pub caps: RequestCaps,
    /// Not ready (gRPC health NOT_SERVING, `/healthcheck` 500) until a first config is in:
    /// `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED`, or config over xDS without
    /// `FORCE_START_WITHOUT_INITIAL_CONFIG`. Only a limiter started by
    /// [`RateLimiter::awaiting_config`] ever lacks a config.
    pub ready_needs_config: bool,
    /// `RESPONSE_DYNAMIC_METADATA`: fill the response's `dynamic_metadata` as envoyproxy does.
    pub response_dynamic_metadata: bool,
}

/// Bounds on one request, checked before any rule or store work, so no request a client
/// controls can make a script run long, hold the memory store's locks, or allocate without
/// limit. The defaults leave room for what Envoy really sends (a few descriptors of a few
/// entries; values such as paths and header values) and keep the worst accepted request at a
/// few hundred counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestCaps {
    /// `MAX_DESCRIPTORS_PER_REQUEST`.
    pub descriptors: u32,
    /// `MAX_ENTRIES_PER_DESCRIPTOR`.
    pub entries: u32,
    /// `MAX_DESCRIPTOR_KEY_BYTES`.
    pub key_bytes: u32,
    /// `MAX_DESCRIPTOR_VALUE_BYTES`.
    pub value_bytes: u32,
}

impl Default for RequestCaps {
    fn default() -> Self {
        Self {
            descriptors: 64,
            entries: 16,
            key_bytes: 256,
            value_bytes: 4096,
        }
    }
}

/// envoyproxy/ratelimit's default `NEAR_LIMIT_RATIO`.
pub const DEFAULT_NEAR_LIMIT_RATIO: f64 = 0.8;

impl Default for ServiceOptions {
    fn default() -> Self {
        Self {
            global_shadow_mode: false,
            global_quota_mode: false,
            failure_mode: None,
            near_limit_ratio: DEFAULT_NEAR_LIMIT_RATIO,
            headers: None,
            caps: RequestCaps::default(),
            ready_needs_config: false,
            response_dynamic_metadata: false,
        }
    }
}

/// What sluice answers itself when the counter store cannot decide (`FAILURE_MODE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureMode {
    /// Overall OK; every limited descriptor OK with its `current_limit` and 0 remaining.
    Allow,
    /// Overall OVER_LIMIT; every limited descriptor OVER_LIMIT (shadow limits and global
    /// shadow mode still answer OK, as for a real denial).
    Deny,
}

impl std::str::FromStr for FailureMode {
    type Err = String;
    /// `allow` or `deny`, case-insensitive.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "allow" => Ok(FailureMode::Allow),
            "deny" => Ok(FailureMode::Deny),
            _ => Err(format!("invalid failure mode {s:?} (use allow or deny)")),
        }
    }
}

/// Why a request got no decision.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Config comes over xDS and none has been accepted yet.
    #[error("no rate limit configuration loaded yet (waiting for the xDS server)")]
    NoConfig,
}

impl From<RequestError> for tonic::Status {
    fn from(e: RequestError) -> Self {
        match e {
            RequestError::Invalid(m) => tonic::Status::invalid_argument(m),
            // Envoy's `failure_mode_deny` decides, as for a store that cannot answer.
            e @ RequestError::NoConfig => tonic::Status::unavailable(e.to_string()),
            // Every store failure is UNAVAILABLE, permanent ones (a script error, a missing ACL
            // permission) included: Envoy treats any error from the rate-limit service the same
            // way, through `failure_mode_deny`, so a finer code would change nothing for it,
            // while UNAVAILABLE is what operators and dashboards expect for "the backend could
            // not decide". The message says which kind of failure it was.
            RequestError::Store(e @ StoreError::Transient(_))
            | RequestError::Store(e @ StoreError::Permanent(_)) => {
                tonic::Status::unavailable(e.to_string())
            }
        }
    }
}

/// The decision engine shared by the gRPC and HTTP front ends.
#[derive(Debug)]
pub struct RateLimiter {
    rules: RwLock<Arc<RuleSet>>,
    store: Arc<dyn CounterStore>,
    options: ServiceOptions,
    store_errors: ErrorLog,
    telemetry: Telemetry,
    config_status: std::sync::Mutex<ConfigStatus>,
    /// Set by [`RateLimiter::awaiting_config`], cleared by the first
    /// [`RateLimiter::replace_rules`]: meanwhile requests get [`RequestError::NoConfig`].
    awaiting_config: AtomicBool,
}

/// The state of the config for operators (`GET /config/status`): when the rules in force were
/// loaded, and how the last reload went.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ConfigStatus {
    /// Unix seconds the rules in force were loaded.
    pub loaded_at: u64,
    /// Domains in the rules in force.
    pub domains: Vec<String>,
    /// Reloads that took effect, and that failed, since start.
    pub reloads_ok: u64,
    pub reloads_failed: u64,
    /// The last reload attempt, if any.
    pub last_reload: Option<ReloadOutcome>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct ReloadOutcome {
    /// Unix seconds of the attempt.
    pub at: u64,
    pub ok: bool,
    /// Every error of a failed reload (file:line: path: message, one per line).
    pub error: Option<String>,
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn describe_rules(rules: &RuleSet) -> (u64, Vec<String>) {
    let at = rules
        .loaded_at
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut domains: Vec<String> = rules.domains.keys().cloned().collect();
    domains.sort();
    (at, domains)
}

/// Logs store errors at most once per [`ErrorLog::EVERY`], with the number left out in between,
/// so a dead Redis under load writes one line a second, not one per request.
#[derive(Debug)]
struct ErrorLog {
    start: std::time::Instant,
    /// Milliseconds since `start` of the last line written, plus one (0 = never).
    last: AtomicU64,
    suppressed: AtomicU64,
}

impl ErrorLog {
    const EVERY: Duration = Duration::from_secs(1);

    fn new() -> Self {
        Self {
            start: std::time::Instant::now(),
            last: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Whether a line may be written at `now_ms` (milliseconds since `start`): `Some(n)` with
    /// the number of errors left out since the last line, or `None` (this one is counted).
    fn due(&self, now_ms: u64) -> Option<u64> {
        let now = now_ms.saturating_add(1);
        let last = self.last.load(Ordering::Relaxed);
        let due = last == 0 || now.saturating_sub(last) >= Self::EVERY.as_millis() as u64;
        if !due
            || self
                .last
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(self.suppressed.swap(0, Ordering::Relaxed))
    }

    fn log(&self, error: &StoreError, failure_mode: Option<FailureMode>) {
        let now = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        let Some(suppressed) = self.due(now) else {
            return;
        };
        let answer = match failure_mode {
            None => "UNAVAILABLE",
            Some(FailureMode::Allow) => "OK (FAILURE_MODE=allow)",
            Some(FailureMode::Deny) => "OVER_LIMIT (FAILURE_MODE=deny)",
        };
        // Store errors carry no credentials (URLs are redacted where they are built).
        tracing::warn!(
            error = %error,
            answer,
            suppressed_since_last = suppressed,
            "counter store could not decide"
        );
    }
}

impl RateLimiter {
    pub fn new(
        rules: RuleSet,
        store: Arc<dyn CounterStore>,
        options: ServiceOptions,
        telemetry: Telemetry,
    ) -> Self {
        telemetry.metrics.config_loaded(&rules);
        Self::build(rules, store, options, telemetry, false)
    }

    /// A limiter with no config yet (config over xDS, before the first push): requests get
    /// UNAVAILABLE until [`RateLimiter::replace_rules`] brings the first config, and nothing is
    /// counted as loaded meanwhile.
    pub fn awaiting_config(
        store: Arc<dyn CounterStore>,
        options: ServiceOptions,
        telemetry: Telemetry,
    ) -> Self {
        Self::build(RuleSet::empty(), store, options, telemetry, true)
    }

    fn build(
        rules: RuleSet,
        store: Arc<dyn CounterStore>,
        options: ServiceOptions,
        telemetry: Telemetry,
        awaiting: bool,
    ) -> Self {
        let (loaded_at, domains) = describe_rules(&rules);
        Self {
            rules: RwLock::new(Arc::new(rules)),
            store,
            options,
            store_errors: ErrorLog::new(),
            telemetry,
            config_status: std::sync::Mutex::new(ConfigStatus {
                loaded_at,
                domains,
                ..ConfigStatus::default()
            }),
            awaiting_config: AtomicBool::new(awaiting),
        }
    }

    /// No config has been loaded yet (see [`RateLimiter::awaiting_config`]).
    pub fn has_no_config(&self) -> bool {
        self.awaiting_config.load(Ordering::Acquire)
    }

    /// When the rules in force were loaded and how the last reload went.
    pub fn config_status(&self) -> ConfigStatus {
        self.config_status
            .lock()
            .map(|s| s.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    fn update_status(&self, f: impl FnOnce(&mut ConfigStatus)) {
        match self.config_status.lock() {
            Ok(mut s) => f(&mut s),
            Err(e) => f(&mut e.into_inner()),
        }
    }

    pub fn telemetry(&self) -> &Telemetry {
        &self.telemetry
    }

    /// The Prometheus text exposition, with the store gauges read now.
    pub fn render_metrics(&self) -> String {
        self.telemetry.metrics.render(
            self.store.breaker_state(),
            self.store.healthy(),
            self.telemetry.offenders.dropped(),
            self.store.stats(),
        )
    }

    /// Records a config reload that failed (`error` says why); the rules in force stay.
    pub fn config_load_failed(&self, error: &str) {
        self.telemetry.metrics.config_failed();
        self.update_status(|s| {
            s.reloads_failed += 1;
            s.last_reload = Some(ReloadOutcome {
                at: unix_now(),
                ok: false,
                error: Some(error.to_string()),
            });
        });
    }

    /// The current config snapshot.
    pub fn rules(&self) -> Arc<RuleSet> {
        self.rules
            .read()
            .map(|g| Arc::clone(&g))
            .unwrap_or_else(|e| Arc::clone(&e.into_inner()))
    }

    /// Swaps in a new config; requests already running keep the snapshot they started with.
    pub fn replace_rules(&self, rules: RuleSet) {
        self.telemetry.metrics.config_loaded(&rules);
        let (loaded_at, domains) = describe_rules(&rules);
        self.update_status(|s| {
            s.loaded_at = loaded_at;
            s.domains = domains;
            s.reloads_ok += 1;
            s.last_reload = Some(ReloadOutcome {
                at: unix_now(),
                ok: true,
                error: None,
            });
        });
        let new = Arc::new(rules);
        match self.rules.write() {
            Ok(mut g) => *g = new,
            Err(e) => *e.into_inner() = new,
        }
        self.awaiting_config.store(false, Ordering::Release);
    }

    pub fn options(&self) -> &ServiceOptions {
        &self.options
    }

    /// Readiness: the store can decide, or `FAILURE_MODE` answers for it (then sluice keeps
    /// answering every request during a store outage and stays ready); and a config is in
    /// when [`ServiceOptions::ready_needs_config`] asks for one.
    pub fn ready(&self) -> bool {
        self.config_ready() && (self.options.failure_mode.is_some() || self.store.healthy())
    }

    /// The config part of [`RateLimiter::ready`].
    pub fn config_ready(&self) -> bool {
        !(self.options.ready_needs_config && self.has_no_config())
    }

    pub fn store(&self) -> &Arc<dyn CounterStore> {
        &self.store
    }

    /// Decides one request: validate, resolve every descriptor on one config snapshot, let the
    /// store decide all limits at once (all or nothing), and build the response.
    pub async fn should_rate_limit(
        &self,
        request: RateLimitRequest,
    ) -> Result<RateLimitResponse, RequestError> {
        self.should_rate_limit_in(request, &Context::new()).await
    }

    /// [`RateLimiter::should_rate_limit`] as a child of `parent` (the caller's W3C trace
    /// context): with tracing on, a `ShouldRateLimit` span and a `store.decide` span below it.
    pub async fn should_rate_limit_in(
        &self,
        request: RateLimitRequest,
        parent: &Context,
    ) -> Result<RateLimitResponse, RequestError> {
        let started = Instant::now();
        let cx = self.telemetry.tracer.as_ref().map(|tracer| {
            let span = tracer
                .span_builder("ShouldRateLimit")
                .with_kind(SpanKind::Server)
                .with_attributes([
                    KeyValue::new("rpc.system", "grpc"),
                    KeyValue::new("rpc.service", crate::proto::RLS_SERVICE_NAME),
                    KeyValue::new("rpc.method", "ShouldRateLimit"),
                    KeyValue::new("ratelimit.domain", request.domain.clone()),
                    KeyValue::new(
                        "ratelimit.descriptors",
                        i64::try_from(request.descriptors.len()).unwrap_or(i64::MAX),
                    ),
                ])
                .start_with_context(tracer, parent);
            parent.with_span(span)
        });
        let result = self.decide(&request, cx.as_ref()).await;
        let outcome = match &result {
            Ok(r) if r.overall_code == Code::OverLimit as i32 => RequestOutcome::OverLimit,
            Ok(_) => RequestOutcome::Ok,
            Err(RequestError::Invalid(_)) => RequestOutcome::Invalid,
            Err(RequestError::Store(_) | RequestError::NoConfig) => RequestOutcome::Error,
        };
        self.telemetry.metrics.request(outcome, started.elapsed());
        if let Some(cx) = cx {
            let span = cx.span();
            match &result {
                Ok(r) => span.set_attribute(KeyValue::new(
                    "ratelimit.overall_code",
                    if r.overall_code == Code::OverLimit as i32 {
                        "OVER_LIMIT"
                    } else {
                        "OK"
                    },
                )),
                Err(e) => span.set_status(Status::error(e.to_string())),
            }
            span.end();
        }
        result
    }

    async fn decide(
        &self,
        request: &RateLimitRequest,
        cx: Option<&Context>,
    ) -> Result<RateLimitResponse, RequestError> {
        validate(request, &self.options.caps)?;
        if self.has_no_config() {
            return Err(RequestError::NoConfig);
        }
        let snapshot = self.rules();
        let plan = plan(&snapshot, request, &self.options)?;
        if plan.checks.is_empty() {
            return Ok(self.respond(request, &plan, Verdict::NoChecks));
        }
        let started = Instant::now();
        let mut span = cx.zip(self.telemetry.tracer.as_ref()).map(|(cx, tracer)| {
            let shape = self.store.call_shape(&plan.checks);
            let kind = if shape.store == "memory" {
                SpanKind::Internal
            } else {
                SpanKind::Client
            };
            tracer
                .span_builder("store.decide")
                .with_kind(kind)
                .with_attributes([
                    KeyValue::new("sluice.store", shape.store),
                    KeyValue::new(
                        "sluice.store.groups",
                        i64::try_from(shape.groups).unwrap_or(i64::MAX),
                    ),
                    KeyValue::new(
                        "sluice.store.keys",
                        i64::try_from(shape.keys).unwrap_or(i64::MAX),
                    ),
                ])
                .start_with_context(tracer, cx)
        });
        let result = self.store.decide(&plan.checks).await;
        self.telemetry
            .metrics
            .store_call(started.elapsed(), result.as_ref().err());
        if let Some(span) = span.as_mut() {
            match &result {
                Ok(d) => {
                    let script = if d.admitted { "admitted" } else { "denied" };
                    span.set_attribute(KeyValue::new("sluice.store.script", script));
                    span.set_attribute(KeyValue::new("sluice.store.local_cache", d.local));
                }
                Err(e) => {
                    span.set_attribute(KeyValue::new("sluice.store.script", "error"));
                    span.set_status(Status::error(e.to_string()));
                }
            }
            span.end();
        }
        match result {
            Ok(decision) => Ok(self.respond(request, &plan, Verdict::Decided(&decision))),
            Err(e) => {
                self.store_errors.log(&e, self.options.failure_mode);
                match self.options.failure_mode {
                    Some(mode) => Ok(self.respond(request, &plan, Verdict::StoreFailed(mode))),
                    None => Err(e.into()),
                }
            }
        }
    }

    /// Builds the response, and feeds metrics and the offenders view from it.
    fn respond(
        &self,
        request: &RateLimitRequest,
        plan: &Plan,
        verdict: Verdict<'_>,
    ) -> RateLimitResponse {
        let (mut response, judged) = respond(plan, verdict, &self.options);
        let decided = match verdict {
            Verdict::Decided(d) => Some(d),
            Verdict::NoChecks | Verdict::StoreFailed(_) => None,
        };
        if let Some(decision) = decided {
            self.count(request, plan, decision, &judged);
        }
        if let (Some(opts), Some(decision)) = (&self.options.headers, decided) {
            let states: Vec<headers::LimitState<'_>> = plan
                .limits
                .iter()
                .zip(&plan.checks)
                .zip(&decision.outcomes)
                .filter(|((_, c), _)| !c.shadow && !c.refund)
                .map(|((r, _), o)| headers::LimitState {
                    name: &r.name,
                    limit: &r.limit,
                    remaining: o.remaining,
                    reset: o.reset,
                    denied_retry_after: (!o.allowed).then_some(o.retry_after),
                })
                .collect();
            let over = response.overall_code == Code::OverLimit as i32;
            response.response_headers_to_add = headers::headers(opts, &states, over)
                .into_iter()
                .map(
                    |(key, value)| crate::proto::envoy::config::core::v3::HeaderValue {
                        key,
                        value,
                        ..Default::default()
                    },
                )
                .collect();
        }
        if self.options.response_dynamic_metadata {
            // Passed: answered OK under a limit (envoyproxy's "passed descriptors").
            let passed = response
                .statuses
                .iter()
                .zip(&plan.descriptors)
                .filter(|(st, _)| st.code == Code::Ok as i32 && st.current_limit.is_some())
                .filter_map(|(_, info)| info.metadata.as_deref());
            response.dynamic_metadata = Some(dynamic_metadata::build(request, passed));
        }
        response
    }

    /// Per-descriptor metrics and the offenders view, for a decision the store made.
    fn count(
        &self,
        request: &RateLimitRequest,
        plan: &Plan,
        decision: &Decision,
        judged: &[Option<Judged>],
    ) {
        for (i, j) in judged.iter().enumerate() {
            let (Some(j), Some(info)) = (j, plan.descriptors.get(i)) else {
                continue;
            };
            if info.refund {
                continue;
            }
            let reported = &plan.limits[j.index];
            let near = !j.over_limit
                && j.outcome.is_some_and(|o| {
                    let limit = u64::from(reported.limit.requests_per_unit);
                    let used = limit.saturating_sub(u64::from(o.remaining));
                    // As envoyproxy/ratelimit: past floor(limit * ratio), strictly.
                    used as f64 > (limit as f64 * self.options.near_limit_ratio).floor()
                });
            self.telemetry.metrics.descriptor(
                &request.domain,
                &info.stat_key,
                DescriptorHits {
                    hits: info.hits,
                    over_limit: j.over_limit,
                    local_cache: decision.local,
                    shadow: j.over_limit && (j.shadow || self.options.global_shadow_mode),
                    near_limit: near,
                },
            );
            // Offenders are denied requests (a quota-mode denial in an admitted one is not).
            if j.over_limit && !j.shadow && !self.options.global_shadow_mode && !decision.admitted {
                if let Some(d) = request.descriptors.get(i) {
                    let rendered = d
                        .entries
                        .iter()
                        .map(|e| format!("{}={}", e.key, e.value))
                        .collect::<Vec<_>>()
                        .join(",");
                    self.telemetry
                        .offenders
                        .record(&request.domain, &rendered, 1);
                }
            }
        }
    }
}

/// Rejects what Envoy's own proto validation forbids, what no limit could be found for, and
/// what is over the request caps (naming the cap and its setting).
fn validate(request: &RateLimitRequest, caps: &RequestCaps) -> Result<(), RequestError> {
    let over = |what: String, n: usize, cap: u32, setting: &str| {
        RequestError::Invalid(format!("{what} is {n}, over the cap of {cap} ({setting})"))
    };
    if request.descriptors.len() > caps.descriptors as usize {
        return Err(over(
            "the number of descriptors".into(),
            request.descriptors.len(),
            caps.descriptors,
            "MAX_DESCRIPTORS_PER_REQUEST",
        ));
    }
    for (i, d) in request.descriptors.iter().enumerate() {
        if d.entries.len() > caps.entries as usize {
            return Err(over(
                format!("the number of entries of descriptors[{i}]"),
                d.entries.len(),
                caps.entries,
                "MAX_ENTRIES_PER_DESCRIPTOR",
            ));
        }
        for (j, e) in d.entries.iter().enumerate() {
            if e.key.len() > caps.key_bytes as usize {
                return Err(over(
                    format!("the key of descriptors[{i}].entries[{j}] in bytes"),
                    e.key.len(),
                    caps.key_bytes,
                    "MAX_DESCRIPTOR_KEY_BYTES",
                ));
            }
            if e.value.len() > caps.value_bytes as usize {
                return Err(over(
                    format!("the value of descriptors[{i}].entries[{j}] in bytes"),
                    e.value.len(),
                    caps.value_bytes,
                    "MAX_DESCRIPTOR_VALUE_BYTES",
                ));
            }
        }
    }
    if request.domain.is_empty() {
        return Err(RequestError::Invalid(
            "rate limit domain must not be empty".into(),
        ));
    }
    if request.descriptors.is_empty() {
        return Err(RequestError::Invalid(
            "rate limit descriptor list must not be empty".into(),
        ));
    }
    for (i, d) in request.descriptors.iter().enumerate() {
        if d.entries.is_empty() {
            return Err(RequestError::Invalid(format!(
                "descriptors[{i}] has no entries"
            )));
        }
        if let Some(j) = d.entries.iter().position(|e| e.key.is_empty()) {
            return Err(RequestError::Invalid(format!(
                "descriptors[{i}].entries[{j}] has an empty key"
            )));
        }
    }
    Ok(())
}

/// What one descriptor resolved to.
#[derive(Debug)]
enum Resolution {
    /// No limit applies (unknown domain, no match, or replaced by another limit).
    NoLimit,
    /// Only `unlimited` limits apply.
    Unlimited,
    /// Counted limits apply: indexes into `Plan::checks` and `Plan::limits`.
    Limited(Vec<usize>),
}

/// How a planned check is reported in a status.
#[derive(Debug)]
struct Reported {
    name: String,
    limit: Limit,
    shadow: bool,
}

/// What metrics need of one descriptor.
#[derive(Debug)]
struct DescriptorInfo {
    /// See [`rules::Matched::stat_key`].
    stat_key: String,
    hits: u64,
    refund: bool,
    /// The matched node's config `metadata` (for `RESPONSE_DYNAMIC_METADATA`).
    metadata: Option<Arc<prost_types::Struct>>,
}

#[derive(Debug)]
struct Plan {
    resolutions: Vec<Resolution>,
    /// Parallel to `resolutions` when the domain is known; empty otherwise.
    descriptors: Vec<DescriptorInfo>,
    checks: Vec<LimitCheck>,
    /// Parallel to `checks`.
    limits: Vec<Reported>,
}

/// The `(key, value)` pairs that key a descriptor's counters.
type CounterEntries = Vec<(String, String)>;

/// What one descriptor matched: its counter entries, candidate limits, stat key and the node's
/// config metadata.
type Matching<'a> = (
    CounterEntries,
    Vec<Candidate<'a>>,
    String,
    Option<Arc<prost_types::Struct>>,
);

/// A limit before `replaces` is applied.
struct Candidate<'a> {
    name: Option<&'a str>,
    replaces: &'a [String],
    quota: Quota,
    shadow: bool,
    quota_mode: bool,
    overridden: bool,
    /// How many leading counter entries key the counter (all of them, except for a resource
    /// limit above the descriptor's last node).
    depth: usize,
    /// Resource limits are charged once per request however many descriptors pass below them.
    resource: bool,
}

fn plan(
    rules: &RuleSet,
    request: &RateLimitRequest,
    options: &ServiceOptions,
) -> Result<Plan, RequestError> {
    let mut plan = Plan {
        resolutions: Vec::with_capacity(request.descriptors.len()),
        descriptors: Vec::with_capacity(request.descriptors.len()),
        checks: Vec::new(),
        limits: Vec::new(),
    };
    let Some(domain) = rules.domains.get(&request.domain) else {
        // Unknown domain: every descriptor is OK with no limit, as envoyproxy/ratelimit answers.
        plan.resolutions
            .extend(request.descriptors.iter().map(|_| Resolution::NoLimit));
        return Ok(plan);
    };
    // The request's hits_addend: 0 (unset) means 1.
    let request_hits = u64::from(request.hits_addend.max(1));

    // Per descriptor: its counter entries and its candidate limits.
    let mut per_descriptor: Vec<Matching<'_>> = Vec::with_capacity(request.descriptors.len());
    for (i, d) in request.descriptors.iter().enumerate() {
        if let Some(o) = &d.limit {
            let entries: Vec<(String, String)> = d
                .entries
                .iter()
                .map(|e| (e.key.clone(), e.value.clone()))
                .collect();
            // Envoy's per-descriptor override replaces the configured limit (and is never shadow).
            let unit = override_unit(o.unit).ok_or_else(|| {
                RequestError::Invalid(format!(
                    "descriptors[{i}].limit.unit {} is not a valid rate limit unit",
                    o.unit
                ))
            })?;
            let depth = entries.len();
            // The override keeps the stat key of the config node it matches, if any, so its
            // metrics stay as bounded as the config's.
            let stat_key = rules::find_limit(
                domain,
                d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str())),
            )
            .map(|m| m.stat_key)
            .unwrap_or_else(|| {
                d.entries
                    .iter()
                    .map(|e| e.key.as_str())
                    .collect::<Vec<_>>()
                    .join(".")
            });
            per_descriptor.push((
                entries,
                vec![Candidate {
                    name: None,
                    replaces: &[],
                    quota: Quota::Limited(Limit::fixed(o.requests_per_unit, unit)),
                    shadow: false,
                    quota_mode: false,
                    overridden: true,
                    depth,
                    resource: false,
                }],
                stat_key,
                None,
            ));
            continue;
        }
        let Some(m) = rules::find_limit(
            domain,
            d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str())),
        ) else {
            per_descriptor.push((Vec::new(), Vec::new(), String::new(), None));
            continue;
        };
        let depth = m.counter_entries.len();
        let own = m.node.rate_limits.iter().map(|r| (r, depth, false));
        let above = m.ancestors.iter().map(|&(r, d)| (r, d, true));
        let candidates = own
            .chain(above)
            .map(|(r, depth, resource)| Candidate {
                name: r.name.as_deref(),
                replaces: &r.replaces,
                quota: r.quota,
                shadow: r.shadow_mode,
                quota_mode: r.quota_mode,
                overridden: false,
                depth,
                resource,
            })
            .collect();
        per_descriptor.push((
            m.counter_entries,
            candidates,
            m.stat_key,
            m.node.metadata.clone(),
        ));
    }

    // `replaces`: a matched limit named in another matched limit's `replaces` is dropped.
    let replaced: Vec<&str> = per_descriptor
        .iter()
        .flat_map(|(_, cs, _, _)| cs.iter())
        .flat_map(|c| c.replaces.iter().map(String::as_str))
        .collect();

    // Resource limits already planned (a resource shared by several descriptors of one request
    // is checked once): a short list searched in place, no per-request map.
    let mut resource_checks: Vec<usize> = Vec::new();
    for ((mut entries, candidates, stat_key, metadata), d) in
        per_descriptor.into_iter().zip(&request.descriptors)
    {
        let hits = d.hits_addend.unwrap_or(request_hits);
        plan.descriptors.push(DescriptorInfo {
            stat_key,
            hits,
            refund: d.is_negative_hits,
            metadata,
        });
        let live: Vec<&Candidate<'_>> = candidates
            .iter()
            .filter(|c| !c.name.is_some_and(|n| replaced.contains(&n)))
            .collect();
        if live.is_empty() {
            plan.resolutions.push(Resolution::NoLimit);
            continue;
        }
        let mut indexes = Vec::new();
        // The last limited candidate takes the entries instead of a copy.
        let last = live
            .iter()
            .rposition(|c| matches!(c.quota, Quota::Limited(_)));
        for (n, c) in live.iter().enumerate() {
            let Quota::Limited(limit) = c.quota else {
                continue;
            };
            let depth = c.depth.min(entries.len());
            let key_entries = if Some(n) == last && depth == entries.len() {
                std::mem::take(&mut entries)
            } else {
                entries[..depth].to_vec()
            };
            let key = CounterKey {
                domain: Arc::clone(&domain.name),
                entries: key_entries,
                limit,
                overridden: c.overridden,
                domain_tag: domain.domain_tag,
            };
            if c.resource {
                if let Some(&existing) =
                    resource_checks.iter().find(|&&i| plan.checks[i].key == key)
                {
                    indexes.push(existing);
                    continue;
                }
                resource_checks.push(plan.checks.len());
            }
            indexes.push(plan.checks.len());
            plan.limits.push(Reported {
                name: c.name.unwrap_or_default().to_string(),
                limit,
                shadow: c.shadow,
            });
            plan.checks.push(LimitCheck {
                key,
                hits,
                refund: d.is_negative_hits,
                shadow: c.shadow || options.global_shadow_mode,
                quota: c.quota_mode || options.global_quota_mode,
            });
        }
        plan.resolutions.push(if indexes.is_empty() {
            Resolution::Unlimited
        } else {
            Resolution::Limited(indexes)
        });
    }
    Ok(plan)
}

/// Maps the override's `envoy.type.v3.RateLimitUnit` (which has no WEEK) to a unit.
fn override_unit(unit: i32) -> Option<Unit> {
    match RateLimitUnit::try_from(unit).ok()? {
        RateLimitUnit::Unknown => None,
        RateLimitUnit::Second => Some(Unit::Second),
        RateLimitUnit::Minute => Some(Unit::Minute),
        RateLimitUnit::Hour => Some(Unit::Hour),
        RateLimitUnit::Day => Some(Unit::Day),
        RateLimitUnit::Month => Some(Unit::Month),
        RateLimitUnit::Year => Some(Unit::Year),
    }
}

/// The response enum for a unit.
pub fn response_unit(unit: Unit) -> rate_limit::Unit {
    match unit {
        Unit::Second => rate_limit::Unit::Second,
        Unit::Minute => rate_limit::Unit::Minute,
        Unit::Hour => rate_limit::Unit::Hour,
        Unit::Day => rate_limit::Unit::Day,
        Unit::Week => rate_limit::Unit::Week,
        Unit::Month => rate_limit::Unit::Month,
        Unit::Year => rate_limit::Unit::Year,
    }
}

/// How the response describes a limit. A period that is a unit is reported as is. Any other
/// period is reported at its average rate in the smallest unit it divides evenly (5 per 10 s
/// is 30 per MINUTE; 100 per 500 ms is 200 per SECOND) and, when unnamed, named after its real
/// shape ("5/10s"), so Envoy's headers stay truthful about the rate while the exact window is
/// visible. A period that divides no unit (or a scaled count beyond u32) is reported with its
/// configured count and unit UNKNOWN.
pub fn describe_limit(name: &str, limit: &Limit) -> rate_limit_response::RateLimit {
    let period = limit.period;
    if let Some(unit) = period.unit() {
        return rate_limit_response::RateLimit {
            name: name.to_string(),
            requests_per_unit: limit.requests_per_unit,
            unit: response_unit(unit) as i32,
        };
    }
    let name = if name.is_empty() {
        format!("{}/{}", limit.requests_per_unit, period)
    } else {
        name.to_string()
    };
    let scaled = Unit::ALL.into_iter().find_map(|u| {
        let unit_ms = u.seconds() * 1000;
        (unit_ms > period.millis() && unit_ms % period.millis() == 0)
            .then(|| u64::from(limit.requests_per_unit) * (unit_ms / period.millis()))
            .and_then(|n| u32::try_from(n).ok())
            .map(|n| (u, n))
    });
    match scaled {
        Some((unit, n)) => rate_limit_response::RateLimit {
            name,
            requests_per_unit: n,
            unit: response_unit(unit) as i32,
        },
        None => rate_limit_response::RateLimit {
            name,
            requests_per_unit: limit.requests_per_unit,
            unit: rate_limit::Unit::Unknown as i32,
        },
    }
}

#[derive(Debug, Clone, Copy)]
enum Verdict<'a> {
    /// The store decided.
    Decided(&'a Decision),
    /// Nothing to decide (no descriptor has a counted limit).
    NoChecks,
    /// The store failed and a failure mode answers instead: every limited descriptor is
    /// allowed (`Allow`) or denied (`Deny`), with 0 remaining and no reset time.
    StoreFailed(FailureMode),
}

/// How a limited descriptor was judged, for metrics.
#[derive(Debug, Clone, Copy)]
struct Judged {
    /// Index of the limit that speaks for the descriptor (into `Plan::checks`).
    index: usize,
    outcome: Option<Outcome>,
    /// Some limit of the descriptor (enforced or shadow) denied it.
    over_limit: bool,
    /// ... but only shadow limits did, so its status says OK.
    shadow: bool,
}

fn respond(
    plan: &Plan,
    verdict: Verdict<'_>,
    options: &ServiceOptions,
) -> (RateLimitResponse, Vec<Option<Judged>>) {
    let mut judgements = Vec::with_capacity(plan.resolutions.len());
    let statuses = plan
        .resolutions
        .iter()
        .map(|r| match r {
            Resolution::NoLimit => {
                judgements.push(None);
                DescriptorStatus {
                    code: Code::Ok as i32,
                    ..Default::default()
                }
            }
            Resolution::Unlimited => {
                judgements.push(None);
                DescriptorStatus {
                    code: Code::Ok as i32,
                    limit_remaining: u32::MAX,
                    ..Default::default()
                }
            }
            Resolution::Limited(indexes) => {
                // Each limit's verdict: (allowed, shadow, outcome).
                let judged = indexes.iter().map(|&i| {
                    let outcome = match verdict {
                        Verdict::Decided(d) => d.outcomes.get(i).copied(),
                        Verdict::NoChecks | Verdict::StoreFailed(_) => None,
                    };
                    let allowed = match verdict {
                        Verdict::StoreFailed(mode) => mode == FailureMode::Allow,
                        _ => outcome.is_some_and(|o| o.allowed),
                    };
                    (i, allowed, plan.limits[i].shadow, outcome)
                });
                let over_limit = matches!(verdict, Verdict::Decided(_))
                    && judged.clone().any(|(_, allowed, _, _)| !allowed);
                // The most restrictive limit speaks for the descriptor: an enforced denial
                // first, then the fewest hits remaining (the first such in config order).
                let chosen = judged.min_by_key(|&(_, allowed, shadow, outcome)| {
                    (allowed || shadow, outcome.map_or(0, |o| o.remaining))
                });
                let Some((i, allowed, shadow, outcome)) = chosen else {
                    judgements.push(None);
                    return DescriptorStatus {
                        code: Code::Ok as i32,
                        ..Default::default()
                    };
                };
                // A shadow-mode limit reports OK even when it would deny (a quota-mode limit
                // reports its denial, as envoyproxy does, though the request may pass).
                let code = if allowed || shadow {
                    Code::Ok
                } else {
                    Code::OverLimit
                };
                judgements.push(Some(Judged {
                    index: i,
                    outcome,
                    over_limit,
                    shadow: over_limit && code == Code::Ok,
                }));
                let reported = &plan.limits[i];
                DescriptorStatus {
                    code: code as i32,
                    current_limit: Some(describe_limit(&reported.name, &reported.limit)),
                    limit_remaining: outcome.map_or(0, |o| o.remaining),
                    duration_until_reset: outcome.map(|o| to_proto_duration(o.reset)),
                    quota: None,
                }
            }
        })
        .collect();
    // The store's verdict on the whole request (enforced limits, then the quota-mode rule); a
    // failure mode answers for every limit. Global shadow mode: never deny overall.
    let admitted = match verdict {
        Verdict::Decided(d) => d.admitted,
        Verdict::NoChecks => true,
        Verdict::StoreFailed(mode) => {
            let mut admission = Admission::default();
            for c in &plan.checks {
                admission.add(c, mode == FailureMode::Allow);
            }
            admission.admitted()
        }
    };
    let overall = if !admitted && !options.global_shadow_mode {
        Code::OverLimit
    } else {
        Code::Ok
    };
    let response = RateLimitResponse {
        overall_code: overall as i32,
        statuses,
        ..Default::default()
    };
    (response, judgements)
}

/// Whole seconds, rounded up, as envoyproxy/ratelimit reports it: never 0 while the window still
/// runs, and no sub-second noise in Envoy's headers.
fn to_proto_duration(d: Duration) -> prost_types::Duration {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    prost_types::Duration {
        seconds: i64::try_from(secs).unwrap_or(i64::MAX),
        nanos: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{rate_limit_descriptor::Entry, RateLimitDescriptor};
    use crate::store::BoxFuture;

    /// A store that always fails.
    #[derive(Debug)]
    struct Failing(fn() -> StoreError);

    impl CounterStore for Failing {
        fn decide<'a>(
            &'a self,
            _: &'a [LimitCheck],
        ) -> BoxFuture<'a, Result<Decision, StoreError>> {
            let e = (self.0)();
            Box::pin(async move { Err(e) })
        }
    }

    const RULES: &str = concat!(
        "domain: d\n",
        "descriptors:\n",
        "  - key: k\n",
        "    rate_limit: {name: kl, unit: minute, requests_per_unit: 5}\n",
        "  - key: s\n",
        "    shadow_mode: true\n",
        "    rate_limit: {unit: hour, requests_per_unit: 7}\n",
        "  - key: u\n",
        "    rate_limit: {unlimited: true}\n",
    );

    fn limiter(failure_mode: Option<FailureMode>, shadow: bool) -> RateLimiter {
        let rules = crate::config::load_sources(&[("t.yaml".into(), RULES.into())])
            .unwrap_or_else(|e| panic!("{e}"));
        RateLimiter::new(
            rules,
            Arc::new(Failing(|| {
                StoreError::Transient("Redis: connection refused".into())
            })),
            ServiceOptions {
                global_shadow_mode: shadow,
                failure_mode,
                ..ServiceOptions::default()
            },
            Telemetry::new(Arc::new(crate::clock::ManualClock::default())).unwrap(),
        )
    }

    fn desc(key: &str) -> RateLimitDescriptor {
        RateLimitDescriptor {
            entries: vec![Entry {
                key: key.into(),
                value: "v".into(),
            }],
            ..Default::default()
        }
    }

    fn request(keys: &[&str]) -> RateLimitRequest {
        RateLimitRequest {
            domain: "d".into(),
            descriptors: keys.iter().map(|k| desc(k)).collect(),
            hits_addend: 0,
        }
    }

    #[tokio::test]
    async fn without_a_failure_mode_a_store_error_is_unavailable() {
        let l = limiter(None, false);
        let e = l.should_rate_limit(request(&["k"])).await.unwrap_err();
        let status = tonic::Status::from(e);
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(status.message().contains("connection refused"));
        // A request with nothing to count never reaches the store.
        let r = l.should_rate_limit(request(&["nothing"])).await.unwrap();
        assert_eq!(r.overall_code, Code::Ok as i32);
    }

    #[test]
    fn permanent_store_errors_are_unavailable_too() {
        let s = tonic::Status::from(RequestError::Store(StoreError::Permanent(
            "Redis: NOPERM".into(),
        )));
        assert_eq!(s.code(), tonic::Code::Unavailable);
        assert!(
            s.message().contains("counter store error"),
            "{}",
            s.message()
        );
        assert!(s.message().contains("NOPERM"));
        let s = tonic::Status::from(RequestError::Store(StoreError::Transient("t".into())));
        assert_eq!(s.code(), tonic::Code::Unavailable);
        assert!(s.message().contains("unavailable"), "{}", s.message());
        let s = tonic::Status::from(RequestError::Invalid("x".into()));
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
    }

    #[tokio::test]
    async fn failure_mode_allow_answers_ok() {
        let l = limiter(Some(FailureMode::Allow), false);
        let r = l
            .should_rate_limit(request(&["k", "u", "nothing"]))
            .await
            .unwrap();
        assert_eq!(r.overall_code, Code::Ok as i32);
        let k = &r.statuses[0];
        assert_eq!(k.code, Code::Ok as i32);
        let limit = k.current_limit.as_ref().unwrap();
        assert_eq!((limit.name.as_str(), limit.requests_per_unit), ("kl", 5));
        assert_eq!(limit.unit, rate_limit::Unit::Minute as i32);
        assert_eq!(k.limit_remaining, 0);
        assert_eq!(k.duration_until_reset, None);
        assert_eq!(r.statuses[1].limit_remaining, u32::MAX, "unlimited as ever");
        assert_eq!(r.statuses[2].current_limit, None);
    }

    #[tokio::test]
    async fn failure_mode_deny_answers_over_limit() {
        let l = limiter(Some(FailureMode::Deny), false);
        let r = l
            .should_rate_limit(request(&["k", "s", "u", "nothing"]))
            .await
            .unwrap();
        assert_eq!(r.overall_code, Code::OverLimit as i32);
        let codes: Vec<i32> = r.statuses.iter().map(|s| s.code).collect();
        assert_eq!(
            codes,
            [
                Code::OverLimit as i32,
                Code::Ok as i32, // a shadow limit never denies
                Code::Ok as i32,
                Code::Ok as i32
            ]
        );
        assert_eq!(r.statuses[0].limit_remaining, 0);
        assert_eq!(
            r.statuses[1]
                .current_limit
                .as_ref()
                .unwrap()
                .requests_per_unit,
            7
        );
        // Global shadow mode still answers OK overall.
        let l = limiter(Some(FailureMode::Deny), true);
        let r = l.should_rate_limit(request(&["k"])).await.unwrap();
        assert_eq!(r.overall_code, Code::Ok as i32);
        // Invalid requests are still invalid.
        assert!(matches!(
            l.should_rate_limit(request(&[])).await,
            Err(RequestError::Invalid(_))
        ));
    }

    #[test]
    fn failure_modes_parse_case_insensitively() {
        assert_eq!("allow".parse(), Ok(FailureMode::Allow));
        assert_eq!("DENY".parse(), Ok(FailureMode::Deny));
        assert_eq!(" Deny ".parse(), Ok(FailureMode::Deny));
        assert!("open".parse::<FailureMode>().is_err());
    }

    #[test]
    fn store_errors_are_logged_at_most_once_a_second() {
        let log = ErrorLog::new();
        assert_eq!(log.due(5_000), Some(0), "the first error is logged");
        for t in 5_001..5_100 {
            assert_eq!(log.due(t), None);
        }
        assert_eq!(log.due(5_999), None);
        assert_eq!(
            log.due(6_000),
            Some(100),
            "a second later, with the count left out"
        );
        assert_eq!(log.due(6_001), None);
        assert_eq!(log.due(60_000), Some(1));
        // Logging itself never fails (and never panics on a fresh log).
        ErrorLog::new().log(&StoreError::Transient("down".into()), None);
    }
}
