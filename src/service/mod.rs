//! The rate-limit decision. A request goes through three small pure steps, each in its own file:
//! [`validate`] (caps and Envoy's proto rules), [`plan`] (descriptors to limits on one config
//! snapshot) and [`respond`] (the store's outcomes to a `RateLimitResponse`). The
//! [`RateLimiter`] here is the thin part that owns the rule snapshot and the store and runs the
//! steps; [`report`] feeds metrics, offenders and headers from the finished decision, and the
//! spans around it live in `telemetry::spans`. Errors become gRPC or HTTP statuses at the edges
//! (`server::grpc`, `server::http`), not here.

mod beside;
mod dynamic_metadata;
pub mod early;
mod error;
mod error_log;
pub mod headers;
#[cfg(test)]
mod identity_props;
mod inspect;
mod options;
mod overrides;
mod plan;
mod report;
mod resets;
mod respond;
mod status;
mod usage;
mod validate;

pub use crate::telemetry::spans::Edge;
pub use error::RequestError;
pub use inspect::Inspected;
pub use options::{FailureMode, RequestCaps, ServiceOptions, DEFAULT_NEAR_LIMIT_RATIO};
pub use overrides::Overrides;
pub use respond::{describe_limit, response_unit};
pub use status::{ConfigStatus, ReloadOutcome};
pub use usage::Recorded;

use crate::config::RuleSet;
use crate::proto::rate_limit_response::Code;
use crate::proto::{RateLimitRequest, RateLimitResponse};
use crate::store::{CounterStore, StoreSignals, StoreStack};
use crate::telemetry::metrics::RequestOutcome;
use crate::telemetry::spans::{RequestSpan, StoreSpan};
use crate::telemetry::Telemetry;
use error_log::ErrorLog;
use opentelemetry::Context;
use plan::plan;
use respond::Verdict;
use status::{describe_rules, unix_now};
#[cfg(test)]
pub(crate) use validate::arbitrary;
use validate::validate;
pub use validate::{validate_wire, walk, walk_typed, Unwalkable};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

/// The decision engine shared by the gRPC and HTTP front ends.
#[derive(Debug)]
pub struct RateLimiter {
    rules: RwLock<Arc<RuleSet>>,
    store: Arc<dyn CounterStore>,
    /// How a request is decided (the store, or `FAILURE_MODE=local`'s layer over it).
    decider: Arc<dyn crate::store::Decider>,
    /// The quota service's demand boards (beside the counters).
    demand: Arc<dyn crate::store::demand::DemandBoard>,
    /// Readiness and the store's metrics (see [`StoreSignals`]).
    signals: StoreSignals,
    options: ServiceOptions,
    store_errors: ErrorLog,
    telemetry: Telemetry,
    config_status: std::sync::Mutex<ConfigStatus>,
    /// The admin overrides in force (see `overrides.rs`).
    overrides: Overrides,
    /// The admin side of the store (resets, overrides).
    admin: Arc<dyn crate::store::admin::CounterAdmin>,
    /// The stack's deny cache, dropped after admin writes.
    forget: Option<Arc<dyn crate::store::admin::Forget>>,
    /// This replica's slices of leased limits, given back when it stops.
    slices: Option<Arc<crate::store::slices::Slices>>,
    /// Global limits' grants (the region's pools), given back home when it stops.
    global: Option<Arc<crate::store::global::GlobalGrants>>,
    /// Set by [`RateLimiter::awaiting_config`], cleared by the first
    /// [`RateLimiter::replace_rules`]: meanwhile requests get [`RequestError::NoConfig`].
    awaiting_config: AtomicBool,
    /// The candidate limits (`CANDIDATE_CONFIG`) and what they would have done.
    candidates: Arc<crate::candidates::Candidates>,
    /// Candidate calls made apart from the answer ([`beside::Apart`]) and still running.
    apart: Arc<tokio::sync::Semaphore>,
}

impl RateLimiter {
    pub fn new(
        rules: RuleSet,
        store: StoreStack,
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
        store: StoreStack,
        options: ServiceOptions,
        telemetry: Telemetry,
    ) -> Self {
        Self::build(RuleSet::empty(), store, options, telemetry, true)
    }

    fn build(
        rules: RuleSet,
        store: StoreStack,
        options: ServiceOptions,
        telemetry: Telemetry,
        awaiting: bool,
    ) -> Self {
        let (loaded_at, domains) = describe_rules(&rules);
        Self {
            rules: RwLock::new(Arc::new(rules)),
            store: store.store,
            overrides: Overrides::new(),
            admin: store.admin,
            forget: store.forget,
            slices: store.slices,
            global: store.global,
            decider: store.decider,
            demand: store.demand,
            signals: store.signals,
            options,
            store_errors: ErrorLog::new(),
            telemetry,
            config_status: std::sync::Mutex::new(ConfigStatus {
                loaded_at,
                domains,
                ..ConfigStatus::default()
            }),
            awaiting_config: AtomicBool::new(awaiting),
            candidates: Arc::default(),
            apart: Arc::new(tokio::sync::Semaphore::new(beside::MAX_APART_CALLS)),
        }
    }

    /// The candidate limits and their counts.
    pub fn candidates(&self) -> &crate::candidates::Candidates {
        &self.candidates
    }

    /// Swaps in a new candidate config (`CANDIDATE_CONFIG`); its counts start over.
    pub fn replace_candidates(&self, rules: RuleSet) {
        self.candidates.replace(rules, self.now_ms() / 1000);
    }

    /// Gives this replica's unspent slices back to the store (it stops): the other replicas
    /// can spend them; then, with global limits, the region's pools it took from back home.
    /// Bounded by `within` in all; returns the units given back to the store or the pools.
    pub async fn give_back_slices(&self, within: std::time::Duration) -> u64 {
        let Some(slices) = &self.slices else {
            return 0;
        };
        let until = tokio::time::Instant::now() + within;
        let n = tokio::time::timeout_at(until, slices.give_back_all())
            .await
            .unwrap_or(0);
        if n > 0 {
            tracing::info!(
                units = n,
                "gave unspent slices of leased limits back to the store"
            );
        }
        if let Some(global) = &self.global {
            // Not cut at `until` from outside: a pool drained must be refunded (it starts none
            // too close to `until`, and a refund started is bounded by the home store's timeout).
            let home = global.give_back_pools(until).await;
            if home > 0 {
                tracing::info!(
                    units = home,
                    "gave the region's pools back to the home store"
                );
            }
        }
        n
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
        let mut out = self.telemetry.metrics.render(
            &self.signals,
            self.telemetry.offenders.dropped(),
            self.telemetry.clock.now(),
        );
        if self.candidates.rules().is_some() {
            self.candidates.render_metrics(&mut out);
        }
        out
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
        if let Some(slices) = &self.slices {
            slices.sweep_once_idle();
        }
    }

    pub fn options(&self) -> &ServiceOptions {
        &self.options
    }

    /// Readiness: the store can decide, or `FAILURE_MODE` answers for it (then sluice keeps
    /// answering every request during a store outage and stays ready); and a config is in
    /// when [`ServiceOptions::ready_needs_config`] asks for one.
    pub fn ready(&self) -> bool {
        self.config_ready() && (self.options.failure_mode.is_some() || self.signals.healthy())
    }

    /// The config part of [`RateLimiter::ready`].
    pub fn config_ready(&self) -> bool {
        !(self.options.ready_needs_config && self.has_no_config())
    }

    pub fn store(&self) -> &Arc<dyn CounterStore> {
        &self.store
    }

    /// Which backend decides (`memory`, `redis`, `redis-cluster`, `redis-sentinel`).
    pub fn store_backend(&self) -> &'static str {
        self.signals.backend
    }

    /// The admin overrides in force.
    pub fn overrides(&self) -> &Overrides {
        &self.overrides
    }

    /// The admin side of the store.
    pub fn counter_admin(&self) -> &Arc<dyn crate::store::admin::CounterAdmin> {
        &self.admin
    }

    /// Drops the deny cache's entries (after an admin write that may have given room).
    pub fn forget_denials(&self) {
        if let Some(f) = &self.forget {
            f.forget_all();
        }
    }

    /// The service clock, in Unix microseconds.
    pub fn now_us(&self) -> u64 {
        u64::try_from(self.telemetry.clock.now().as_micros()).unwrap_or(u64::MAX)
    }

    /// The service clock, in Unix milliseconds.
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.telemetry.clock.now().as_millis()).unwrap_or(u64::MAX)
    }

    pub fn demand_board(&self) -> &Arc<dyn crate::store::demand::DemandBoard> {
        &self.demand
    }

    /// Probes the store (the health task's periodic contact) and records the answer as the
    /// store's health, which readiness reads.
    pub async fn probe_store(&self) -> bool {
        let ok = self.store.probe().await;
        self.signals.set_health(ok);
        ok
    }

    /// Decides one request: validate, resolve every descriptor on one config snapshot, let the
    /// store decide all limits at once (all or nothing), and build the response.
    pub async fn should_rate_limit(
        &self,
        request: RateLimitRequest,
    ) -> Result<RateLimitResponse, RequestError> {
        self.should_rate_limit_in(request, &Context::new(), Edge::Grpc, None)
            .await
    }

    /// [`RateLimiter::should_rate_limit`] as a child of `parent` (the caller's W3C trace
    /// context), called through `edge` by a caller that gives up at `deadline` (its gRPC
    /// deadline, which `FAILURE_MODE=local` answers before): the decision wrapped in its
    /// telemetry (the request span and the request metrics).
    pub async fn should_rate_limit_in(
        &self,
        request: RateLimitRequest,
        parent: &Context,
        edge: Edge,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<RateLimitResponse, RequestError> {
        let started = Instant::now();
        let span = RequestSpan::start(
            self.telemetry.tracer.as_ref(),
            parent,
            edge,
            &request.domain,
            request.descriptors.len(),
        );
        let mut at = Decided::default();
        let result = self
            .decide(&request, span.context(), deadline, &mut at)
            .await;
        let outcome = match &result {
            Ok(r) if r.overall_code == Code::OverLimit as i32 => RequestOutcome::OverLimit,
            Ok(_) => RequestOutcome::Ok,
            Err(RequestError::Invalid(_)) => RequestOutcome::Invalid,
            Err(RequestError::Store(_) | RequestError::NoConfig) => RequestOutcome::Error,
        };
        self.telemetry.metrics.request(outcome, started.elapsed());
        span.finish(match &result {
            Ok(r) => Ok(r.overall_code == Code::OverLimit as i32),
            Err(e) => Err(e),
        });
        if let (Some(log), Ok(response)) = (&self.options.decision_log, &result) {
            self.log_decision(log, request, response, at);
        }
        result
    }

    /// The decided request to the decision log (sampled by consumer; never waits).
    fn log_decision(
        &self,
        log: &crate::decision_log::DecisionLog,
        request: RateLimitRequest,
        response: &RateLimitResponse,
        at: Decided,
    ) {
        if !log.wants(&request) {
            return;
        }
        let over: Vec<bool> = response
            .statuses
            .iter()
            .map(|s| s.code == Code::OverLimit as i32)
            .collect();
        let ok = response.overall_code != Code::OverLimit as i32;
        let (t, seq, fallback) = match at.at {
            crate::store::DecidedAt::Store { us, seq } => (us, seq, false),
            crate::store::DecidedAt::Fallback => (self.now_us(), 0, true),
            crate::store::DecidedAt::Unknown => (self.now_us(), 0, at.fallback),
        };
        let mut line = crate::decision_log::line::Line::of(request, t, ok, &over);
        line.seq = seq;
        line.fallback = fallback;
        log.record(line);
    }

    /// validate -> plan -> store -> respond, with the store call wrapped in its span and
    /// latency metric.
    async fn decide(
        &self,
        request: &RateLimitRequest,
        cx: Option<&Context>,
        deadline: Option<tokio::time::Instant>,
        at: &mut Decided,
    ) -> Result<RateLimitResponse, RequestError> {
        validate(request, &self.options.caps)?;
        if self.has_no_config() {
            return Err(RequestError::NoConfig);
        }
        let snapshot = self.rules();
        let mut plan = plan(&snapshot, request, &self.options)?;
        plan.calendar_windows(|| self.now_us());
        if self.overrides.is_active() {
            self.overrides.apply(&mut plan, self.now_ms());
        }
        let mut beside = self.candidates.rules().and_then(|rules| {
            beside::plan_beside(&rules, request, &self.options, || self.now_us())
        });
        if plan.limits.is_empty() {
            let response = self.answer(request, &plan, Verdict::NoChecks);
            if let Some(b) = beside {
                self.decide_apart(b, &request.domain, true);
            }
            return Ok(response);
        }
        let started = Instant::now();
        let span = StoreSpan::start(
            self.telemetry.tracer.as_ref(),
            cx,
            self.signals.backend,
            plan.limits.len(),
        );
        let mut checks = plan.checks();
        let enforced = checks.len();
        if let Some(b) = &mut beside {
            b.judge_on(&checks);
            checks.extend(b.checks());
        }
        let result = self.decider.decide_by(checks, deadline).await;
        self.telemetry
            .metrics
            .store_call(started.elapsed(), result.as_ref().err());
        span.finish(match &result {
            Ok(d) => Ok(d),
            Err(e) => Err(e),
        });
        match result {
            Ok(mut decision) => {
                at.at = decision.at;
                let tried = decision
                    .outcomes
                    .split_off(enforced.min(decision.outcomes.len()));
                decision.leases.truncate(enforced);
                let response = self.answer(request, &plan, Verdict::Decided(&decision));
                let admitted = response.overall_code != Code::OverLimit as i32;
                if let Some(b) = beside {
                    self.count_beside(b, &tried, &decision, admitted, &request.domain);
                }
                Ok(response)
            }
            Err(e) => {
                if let Some(b) = &beside {
                    self.candidates.record_over_budget(b.over_budget);
                    self.candidates.record_lost();
                }
                at.fallback = true;
                self.store_errors.log(&e, self.options.failure_mode);
                match self.options.failure_mode {
                    Some(mode) => Ok(self.answer(request, &plan, Verdict::StoreFailed(mode))),
                    None => Err(e.into()),
                }
            }
        }
    }

    /// What the request's candidate limits would have done, beside what was answered
    /// (`admitted`: whether the enforced config admitted it).
    /// Those the store left apart are decided in a call of their own ([`beside::Apart`]).
    fn count_beside(
        &self,
        mut beside: beside::Beside,
        tried: &[crate::store::Outcome],
        decision: &crate::store::Decision,
        admitted: bool,
        domain: &str,
    ) {
        let fallback = decision.at == crate::store::DecidedAt::Fallback;
        beside.judge(&decision.outcomes, fallback);
        if decision.beside_apart && beside.needs_call() && beside.judged() {
            return self.decide_apart(beside, domain, admitted);
        }
        if beside.over_budget > 0 {
            self.candidates.record_over_budget(beside.over_budget);
        }
        if decision.beside_apart && beside.needs_call() {
            return self.candidates.record_lost();
        }
        match beside.seen(tried, domain) {
            Some(seen) if !decision.beside_lost => self.candidates.record(&seen, admitted),
            _ => self.candidates.record_lost(),
        }
    }

    /// Decides the request's candidate checks in a call of their own, spawned: the answer is
    /// given without waiting on it (see [`beside::Apart`]).
    fn decide_apart(&self, beside: beside::Beside, domain: &str, admitted: bool) {
        beside::Apart {
            decider: Arc::clone(&self.decider),
            candidates: Arc::clone(&self.candidates),
            running: Arc::clone(&self.apart),
        }
        .spawn(beside, domain, admitted);
    }
}

/// How a request was decided, for the decision log.
#[derive(Debug, Clone, Copy, Default)]
struct Decided {
    /// When, as the store says (not known: the service clock is taken).
    at: crate::store::DecidedAt,
    /// Answered by `FAILURE_MODE`, the store having failed.
    fallback: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::rate_limit_response::rate_limit;
    use crate::proto::{rate_limit_descriptor::Entry, RateLimitDescriptor};
    use crate::store::fake::FakeStore;
    use crate::store::StoreError;

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
            StoreStack::new(
                Arc::new(FakeStore::failing(StoreError::Transient(
                    "Redis: connection refused".into(),
                ))),
                StoreSignals::new("redis"),
            ),
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
