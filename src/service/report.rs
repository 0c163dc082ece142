//! What a finished decision feeds besides the response: per-descriptor metrics, the offenders
//! view, the rate-limit headers and the response's dynamic metadata. Runs after [`super::respond`]
//! built the statuses, so the decision itself never waits on any of it.

use super::plan::Plan;
use super::respond::{build_response, Judged, Verdict};
use super::{dynamic_metadata, headers, RateLimiter};
use crate::proto::rate_limit_response::Code;
use crate::proto::{RateLimitRequest, RateLimitResponse};
use crate::store::Decision;
use crate::telemetry::metrics::DescriptorHits;

impl RateLimiter {
    /// Builds the response, and feeds metrics and the offenders view from it.
    pub(super) fn answer(
        &self,
        request: &RateLimitRequest,
        plan: &Plan,
        verdict: Verdict<'_>,
    ) -> RateLimitResponse {
        let (mut response, judged) = build_response(plan, verdict, &self.options);
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
