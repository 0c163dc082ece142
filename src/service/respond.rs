//! The last step: fold the store's outcomes (or a failure mode's answer) into the
//! `RateLimitResponse` Envoy reads, in one step from the plan's rows: statuses, the overall
//! code, the rate-limit headers (`headers.rs` formats them) and the dynamic metadata
//! (`dynamic_metadata.rs`). Pure: the same plan and verdict give the same response.

use super::plan::{Plan, PlannedLimit, Resolution};
use super::{dynamic_metadata, headers, FailureMode, ServiceOptions};
use crate::config::{Limit, Unit};
use crate::proto::envoy::config::core::v3::HeaderValue;
use crate::proto::rate_limit_response::{self, rate_limit, Code, DescriptorStatus};
use crate::proto::RateLimitRequest;
use crate::proto::RateLimitResponse;
use crate::store::{Admission, Decision, Outcome};
use std::time::Duration;

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
/// configured count and unit UNKNOWN, as is an `in_flight` limit (slots, not a rate).
pub fn describe_limit(name: &str, limit: &Limit) -> rate_limit_response::RateLimit {
    let period = limit.period;
    if limit.algorithm == crate::config::Algorithm::InFlight {
        // Not a rate: `max` requests at once, unit UNKNOWN, named after what it is.
        return rate_limit_response::RateLimit {
            name: if name.is_empty() {
                format!("{} in flight, lease {period}", limit.requests_per_unit)
            } else {
                name.to_string()
            },
            requests_per_unit: limit.requests_per_unit,
            unit: rate_limit::Unit::Unknown as i32,
        };
    }
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
pub(super) enum Verdict<'a> {
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
pub(super) struct Judged {
    /// Index of the limit that speaks for the descriptor (into `Plan::limits`).
    pub(super) index: usize,
    pub(super) outcome: Option<Outcome>,
    /// Some limit of the descriptor (enforced or shadow) denied it.
    pub(super) over_limit: bool,
    /// ... but only shadow limits did, so its status says OK.
    pub(super) shadow: bool,
}

/// The response to `request` for `plan` under `verdict`, and how each limited descriptor was
/// judged (for metrics).
pub(super) fn respond(
    request: &RateLimitRequest,
    plan: &Plan,
    verdict: Verdict<'_>,
    options: &ServiceOptions,
) -> (RateLimitResponse, Vec<Option<Judged>>) {
    let (statuses, judgements): (Vec<DescriptorStatus>, _) = plan
        .descriptors
        .iter()
        .map(|d| match &d.resolution {
            Resolution::NoLimit => (ok_status(0), None),
            Resolution::Unlimited => (ok_status(u32::MAX), None),
            Resolution::Limited(indexes) => limited_status(plan, indexes, verdict),
        })
        .unzip();
    let over = !admitted(plan, verdict) && !options.global_shadow_mode;
    let overall = if over { Code::OverLimit } else { Code::Ok };
    let response_headers_to_add = match (&options.headers, verdict) {
        (Some(opts), Verdict::Decided(d)) => rate_limit_headers(opts, &plan.limits, d, over),
        _ => Vec::new(),
    };
    // Passed: answered OK under a limit (envoyproxy's "passed descriptors").
    let dynamic_metadata = options.response_dynamic_metadata.then(|| {
        let passed = statuses
            .iter()
            .zip(&plan.descriptors)
            .filter(|(st, _)| st.code == Code::Ok as i32 && st.current_limit.is_some())
            .filter_map(|(_, d)| d.metadata.as_deref());
        dynamic_metadata::build(request, passed)
    });
    let response = RateLimitResponse {
        overall_code: overall as i32,
        statuses,
        response_headers_to_add,
        dynamic_metadata,
        ..Default::default()
    };
    (response, judgements)
}

/// The rate-limit headers of a decided request, from its enforced limits (shadow limits and
/// refunds say nothing about what the caller may send).
fn rate_limit_headers(
    opts: &headers::HeaderOptions,
    limits: &[PlannedLimit],
    decision: &Decision,
    over: bool,
) -> Vec<HeaderValue> {
    let states: Vec<headers::LimitState<'_>> = limits
        .iter()
        .zip(&decision.outcomes)
        .filter(|(l, _)| !l.check.shadow && !l.check.refund)
        .map(|(l, o)| headers::LimitState {
            name: &l.name,
            limit: &l.shown,
            remaining: o.remaining,
            reset: o.reset,
            denied_retry_after: (!o.allowed).then_some(o.retry_after),
        })
        .collect();
    headers::headers(opts, &states, over)
        .into_iter()
        .map(|(key, value)| HeaderValue {
            key,
            value,
            ..Default::default()
        })
        .collect()
}

/// OK with no limit attached (`remaining` is `u32::MAX` for an `unlimited` limit).
fn ok_status(remaining: u32) -> DescriptorStatus {
    DescriptorStatus {
        code: Code::Ok as i32,
        limit_remaining: remaining,
        ..Default::default()
    }
}

/// The status of a descriptor with counted limits: the most restrictive of them speaks.
fn limited_status(
    plan: &Plan,
    indexes: &[usize],
    verdict: Verdict<'_>,
) -> (DescriptorStatus, Option<Judged>) {
    // Each limit's verdict: (index, allowed, shadow, outcome).
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
    let over_limit =
        matches!(verdict, Verdict::Decided(_)) && judged.clone().any(|(_, allowed, _, _)| !allowed);
    let chosen = judged.min_by_key(|&(_, allowed, shadow, outcome)| {
        headers::restrictiveness(!(allowed || shadow), outcome.map_or(0, |o| o.remaining))
    });
    let Some((i, allowed, shadow, outcome)) = chosen else {
        return (ok_status(0), None);
    };
    // A shadow-mode limit reports OK even when it would deny (a quota-mode limit reports its
    // denial, as envoyproxy does, though the request may pass).
    let code = if allowed || shadow {
        Code::Ok
    } else {
        Code::OverLimit
    };
    let judged = Judged {
        index: i,
        outcome,
        over_limit,
        shadow: over_limit && code == Code::Ok,
    };
    let reported = &plan.limits[i];
    let status = DescriptorStatus {
        code: code as i32,
        current_limit: Some(describe_limit(&reported.name, &reported.shown)),
        limit_remaining: outcome.map_or(0, |o| o.remaining),
        duration_until_reset: outcome.map(|o| to_proto_duration(o.reset)),
        quota: None,
    };
    (status, Some(judged))
}

/// The verdict on the whole request: the store's (enforced limits, then the quota-mode rule),
/// or a failure mode's answer for every limit.
fn admitted(plan: &Plan, verdict: Verdict<'_>) -> bool {
    match verdict {
        Verdict::Decided(d) => d.admitted,
        Verdict::NoChecks => true,
        Verdict::StoreFailed(mode) => {
            let mut admission = Admission::default();
            for l in &plan.limits {
                admission.add(&l.check, mode == FailureMode::Allow);
            }
            admission.admitted()
        }
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
