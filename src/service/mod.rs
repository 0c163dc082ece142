//! The rate-limit decision: validate a `RateLimitRequest`, resolve each descriptor to its limit on
//! one config snapshot, let the store decide all of them at once, and fold the outcomes into a
//! `RateLimitResponse`.

use crate::config::{Quota, RuleSet, Unit};
use crate::proto::envoy::r#type::v3::RateLimitUnit;
use crate::proto::rate_limit_response::{self, rate_limit, Code, DescriptorStatus};
use crate::proto::{RateLimitRequest, RateLimitResponse};
use crate::rules;
use crate::store::{CounterKey, CounterStore, Decision, LimitCheck, StoreError};
use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// Service-wide switches.
#[derive(Debug, Clone, Default)]
pub struct ServiceOptions {
    /// `SHADOW_MODE`: decide and count as usual, but always answer OK overall.
    pub global_shadow_mode: bool,
}

/// Why a request got no decision.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<RequestError> for tonic::Status {
    fn from(e: RequestError) -> Self {
        match e {
            RequestError::Invalid(m) => tonic::Status::invalid_argument(m),
            // Transient store failures are UNAVAILABLE so Envoy's failure_mode_deny decides;
            // permanent ones are INTERNAL: retrying the same request will not help.
            RequestError::Store(StoreError::Transient(m)) => tonic::Status::unavailable(m),
            RequestError::Store(StoreError::Permanent(m)) => tonic::Status::internal(m),
        }
    }
}

/// The decision engine shared by the gRPC and HTTP front ends.
#[derive(Debug)]
pub struct RateLimiter {
    rules: RwLock<Arc<RuleSet>>,
    store: Arc<dyn CounterStore>,
    options: ServiceOptions,
}

impl RateLimiter {
    pub fn new(rules: RuleSet, store: Arc<dyn CounterStore>, options: ServiceOptions) -> Self {
        Self {
            rules: RwLock::new(Arc::new(rules)),
            store,
            options,
        }
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
        let new = Arc::new(rules);
        match self.rules.write() {
            Ok(mut g) => *g = new,
            Err(e) => *e.into_inner() = new,
        }
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
        validate(&request)?;
        let snapshot = self.rules();
        let plan = plan(&snapshot, &request, &self.options)?;
        let decision = if plan.checks.is_empty() {
            None
        } else {
            Some(self.store.decide(&plan.checks).await?)
        };
        Ok(respond(&plan, decision.as_ref(), &self.options))
    }
}

/// Rejects what Envoy's own proto validation forbids and what no limit could be found for.
fn validate(request: &RateLimitRequest) -> Result<(), RequestError> {
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
    Unlimited,
    /// A counted limit; `check` indexes `Plan::checks`.
    Limited {
        check: usize,
        name: String,
        requests_per_unit: u32,
        unit: Unit,
        shadow: bool,
    },
}

#[derive(Debug)]
struct Plan {
    resolutions: Vec<Resolution>,
    checks: Vec<LimitCheck>,
}

/// A limit before `replaces` is applied.
struct Candidate<'a> {
    name: Option<&'a str>,
    replaces: &'a [String],
    requests_per_unit: u32,
    unit: Unit,
    shadow: bool,
    overridden: bool,
    counter_entries: Vec<(String, String)>,
    unlimited: bool,
}

fn plan(
    rules: &RuleSet,
    request: &RateLimitRequest,
    options: &ServiceOptions,
) -> Result<Plan, RequestError> {
    let Some(domain) = rules.domains.get(&request.domain) else {
        // Unknown domain: every descriptor is OK with no limit, as envoyproxy/ratelimit answers.
        return Ok(Plan {
            resolutions: request
                .descriptors
                .iter()
                .map(|_| Resolution::NoLimit)
                .collect(),
            checks: Vec::new(),
        });
    };
    let domain_name: Arc<str> = Arc::from(request.domain.as_str());
    // The request's hits_addend: 0 (unset) means 1.
    let request_hits = u64::from(request.hits_addend.max(1));

    let mut candidates: Vec<Option<Candidate<'_>>> = Vec::with_capacity(request.descriptors.len());
    for (i, d) in request.descriptors.iter().enumerate() {
        if let Some(o) = &d.limit {
            // Envoy's per-descriptor override replaces the configured limit (and is never shadow).
            let unit = override_unit(o.unit).ok_or_else(|| {
                RequestError::Invalid(format!(
                    "descriptors[{i}].limit.unit {} is not a valid rate limit unit",
                    o.unit
                ))
            })?;
            candidates.push(Some(Candidate {
                name: None,
                replaces: &[],
                requests_per_unit: o.requests_per_unit,
                unit,
                shadow: false,
                overridden: true,
                counter_entries: d
                    .entries
                    .iter()
                    .map(|e| (e.key.clone(), e.value.clone()))
                    .collect(),
                unlimited: false,
            }));
            continue;
        }
        let found = rules::find_limit(
            domain,
            d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str())),
        );
        candidates.push(found.map(|m| {
            let (requests_per_unit, unit, unlimited) = match m.rule.quota {
                Quota::Unlimited => (0, Unit::Second, true),
                Quota::Limited {
                    requests_per_unit,
                    unit,
                } => (requests_per_unit, unit, false),
            };
            Candidate {
                name: m.rule.name.as_deref(),
                replaces: &m.rule.replaces,
                requests_per_unit,
                unit,
                shadow: m.rule.shadow_mode,
                overridden: false,
                counter_entries: m.counter_entries,
                unlimited,
            }
        }));
    }

    // `replaces`: a matched limit named in another matched limit's `replaces` is dropped.
    let replaced: HashSet<&str> = candidates
        .iter()
        .flatten()
        .flat_map(|c| c.replaces.iter().map(String::as_str))
        .collect();

    let mut resolutions = Vec::with_capacity(candidates.len());
    let mut checks = Vec::new();
    for (c, d) in candidates.into_iter().zip(&request.descriptors) {
        let Some(c) = c else {
            resolutions.push(Resolution::NoLimit);
            continue;
        };
        if c.name.is_some_and(|n| replaced.contains(n)) {
            resolutions.push(Resolution::NoLimit);
            continue;
        }
        if c.unlimited {
            resolutions.push(Resolution::Unlimited);
            continue;
        }
        let hits = d.hits_addend.unwrap_or(request_hits);
        resolutions.push(Resolution::Limited {
            check: checks.len(),
            name: c.name.unwrap_or_default().to_string(),
            requests_per_unit: c.requests_per_unit,
            unit: c.unit,
            shadow: c.shadow,
        });
        checks.push(LimitCheck {
            key: CounterKey {
                domain: Arc::clone(&domain_name),
                entries: c.counter_entries,
                requests_per_unit: c.requests_per_unit,
                unit: c.unit,
                overridden: c.overridden,
            },
            hits,
            refund: d.is_negative_hits,
            shadow: c.shadow || options.global_shadow_mode,
        });
    }
    Ok(Plan {
        resolutions,
        checks,
    })
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

fn respond(
    plan: &Plan,
    decision: Option<&Decision>,
    options: &ServiceOptions,
) -> RateLimitResponse {
    let mut any_over = false;
    let statuses = plan
        .resolutions
        .iter()
        .map(|r| match r {
            Resolution::NoLimit => DescriptorStatus {
                code: Code::Ok as i32,
                ..Default::default()
            },
            Resolution::Unlimited => DescriptorStatus {
                code: Code::Ok as i32,
                limit_remaining: u32::MAX,
                ..Default::default()
            },
            Resolution::Limited {
                check,
                name,
                requests_per_unit,
                unit,
                shadow,
            } => {
                let outcome = decision.and_then(|d| d.outcomes.get(*check));
                let allowed = outcome.is_some_and(|o| o.allowed);
                // A shadow-mode limit reports OK even when it would deny.
                let code = if allowed || *shadow {
                    Code::Ok
                } else {
                    any_over = true;
                    Code::OverLimit
                };
                DescriptorStatus {
                    code: code as i32,
                    current_limit: Some(rate_limit_response::RateLimit {
                        name: name.clone(),
                        requests_per_unit: *requests_per_unit,
                        unit: response_unit(*unit) as i32,
                    }),
                    limit_remaining: outcome.map_or(0, |o| o.remaining),
                    duration_until_reset: outcome.map(|o| to_proto_duration(o.reset)),
                    quota: None,
                }
            }
        })
        .collect();
    // Global shadow mode: decide and count as usual, but never deny overall.
    let overall = if any_over && !options.global_shadow_mode {
        Code::OverLimit
    } else {
        Code::Ok
    };
    RateLimitResponse {
        overall_code: overall as i32,
        statuses,
        ..Default::default()
    }
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
