//! What a finished decision feeds besides the response: the per-descriptor metrics and the
//! offenders view. Runs after [`super::respond`] built the response, so the decision itself
//! never waits on any of it.

use super::plan::{Plan, Resolution};
use super::respond::{respond, Judged, Verdict};
use super::RateLimiter;
use crate::config::Algorithm;
use crate::proto::{RateLimitRequest, RateLimitResponse};
use crate::store::Decision;
use crate::telemetry::leases::LeaseKind;
use crate::telemetry::metrics::DescriptorHits;

impl RateLimiter {
    /// Builds the response, and feeds metrics and the offenders view from it.
    pub(super) fn answer(
        &self,
        request: &RateLimitRequest,
        plan: &Plan,
        verdict: Verdict<'_>,
    ) -> RateLimitResponse {
        let (response, judged) = respond(request, plan, verdict, &self.options);
        if let Verdict::Decided(decision) = verdict {
            self.count(request, plan, decision, &judged);
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
                    let limit = u64::from(reported.shown.requests_per_unit);
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
                    // A descriptor naming a request (an in_flight take, a reservation) is shown
                    // without its id entry: the offender is the tenant, not one request.
                    let named = match &info.resolution {
                        Resolution::Limited(ix) => ix
                            .iter()
                            .any(|&k| plan.limits.get(k).is_some_and(|l| l.check.lease.is_some())),
                        _ => false,
                    };
                    let shown = d.entries.len().saturating_sub(usize::from(named));
                    let rendered = d.entries[..shown]
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
        self.book_leases(request, plan, decision);
        for (l, o) in plan.limits.iter().zip(&decision.outcomes) {
            let in_flight = l.check.key.limit.algorithm == Algorithm::InFlight;
            let call = match (&l.check.lease, in_flight) {
                (Some(c), true) if c.release => "free",
                (Some(_), true) => "take",
                (None, true) => "check",
                (Some(c), false) if c.reservations.is_some() && c.release => "settle",
                (Some(c), false) if c.reservations.is_some() => "reserve",
                _ => continue,
            };
            self.telemetry
                .metrics
                .lease_call(&request.domain, call, o.allowed);
        }
    }

    /// What the store did to lease entries, into the lease metrics.
    fn book_leases(&self, request: &RateLimitRequest, plan: &Plan, decision: &Decision) {
        if decision.leases.is_empty() {
            return;
        }
        let now = self.telemetry.clock.now();
        for (l, e) in plan.limits.iter().zip(&decision.leases) {
            if e.is_empty() {
                continue;
            }
            let limit = l.check.key.limit;
            let (kind, lease) = if limit.algorithm == Algorithm::InFlight {
                (LeaseKind::InFlight, limit.period)
            } else if let Some(r) = l.check.lease.as_ref().and_then(|c| c.reservations) {
                (LeaseKind::Reservation, r.lease)
            } else {
                continue;
            };
            let lease = std::time::Duration::from_millis(lease.millis());
            self.telemetry
                .metrics
                .leases
                .record(&request.domain, kind, *e, lease, now);
        }
    }
}
