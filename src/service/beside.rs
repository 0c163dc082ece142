//! A request's candidate limits (`CANDIDATE_CONFIG`): planned on the candidate rules as the
//! enforced ones are on theirs, then marked candidate, so the store decides them in the same
//! call as a request of their own and on counters of their own, and the answer is the enforced
//! config's alone. What a candidate cannot be: a lease (`in_flight`, `reservations`: a slot or
//! a reservation taken for real), a slice of a leased or global limit (decided as a plain
//! counter on the region's store), or Envoy's per-descriptor `limit` override (the candidate's
//! own limit is what is being tried).

use super::plan::{plan, Plan, Resolution};
use super::ServiceOptions;
use crate::candidates::Seen;
use crate::config::RuleSet;
use crate::proto::RateLimitRequest;
use crate::store::{LimitCheck, Outcome};
use std::borrow::Cow;

/// Candidate checks one request carries at most: the budget on the work candidates add to a
/// store call (each is a counter read and written in the request's script call, as an enforced
/// limit is). A request matching more candidate limits than this has the first ones decided
/// and the rest counted as untracked (`reason="budget"`).
pub(super) const MAX_CANDIDATE_CHECKS: usize = 8;

/// The candidate checks of one request.
#[derive(Debug)]
pub(super) struct Beside {
    plan: Plan,
    /// Per candidate check sent: its limit in `plan` and the stat key of the first descriptor
    /// it serves.
    kept: Vec<(usize, usize)>,
    /// Candidate limits matched past [`MAX_CANDIDATE_CHECKS`].
    pub(super) over_budget: usize,
}

/// The candidate checks `rules` give `request`, if any: `now_us` gives calendar windows.
pub(super) fn plan_beside(
    rules: &RuleSet,
    request: &RateLimitRequest,
    options: &ServiceOptions,
    now_us: impl Fn() -> u64,
) -> Option<Beside> {
    if !rules.domains.contains_key(&request.domain) {
        return None;
    }
    let request: Cow<'_, RateLimitRequest> =
        match request.descriptors.iter().any(|d| d.limit.is_some()) {
            false => Cow::Borrowed(request),
            true => {
                let mut r = request.clone();
                for d in &mut r.descriptors {
                    d.limit = None;
                }
                Cow::Owned(r)
            }
        };
    let mut plan = plan(rules, &request, options).ok()?;
    for l in &mut plan.limits {
        l.check.slice = None;
    }
    plan.calendar_windows(now_us);
    let kept: Vec<(usize, usize)> = plan
        .limits
        .iter()
        .enumerate()
        .filter(|(_, l)| l.check.lease.is_none() && !l.check.leased)
        .filter_map(|(j, _)| {
            let d = plan.descriptors.iter().position(|d| match &d.resolution {
                Resolution::Limited(ix) => ix.contains(&j),
                _ => false,
            })?;
            Some((j, d))
        })
        .collect();
    let over_budget = kept.len().saturating_sub(MAX_CANDIDATE_CHECKS);
    let mut kept = kept;
    kept.truncate(MAX_CANDIDATE_CHECKS);
    (!kept.is_empty()).then_some(Beside {
        plan,
        kept,
        over_budget,
    })
}

impl Beside {
    /// The checks to decide beside the enforced ones (in [`Beside::seen`]'s order).
    pub(super) fn checks(&self) -> impl Iterator<Item = LimitCheck> + '_ {
        self.kept.iter().map(|&(j, _)| {
            let l = &self.plan.limits[j];
            let mut c = l.check.clone();
            c.candidate = true;
            c.key.candidate = true;
            // The rule's own shadow_mode, not the global SHADOW_MODE: what is tried is the
            // candidate as it would be enforced.
            c.shadow = l.shadow;
            c
        })
    }

    /// What each candidate limit did, from the outcomes of [`Beside::checks`].
    pub(super) fn seen<'a>(&'a self, outcomes: &[Outcome], domain: &'a str) -> Vec<Seen<'a>> {
        self.kept
            .iter()
            .zip(outcomes)
            .map(|(&(j, d), o)| {
                let l = &self.plan.limits[j];
                Seen {
                    domain,
                    key: &self.plan.descriptors[d].stat_key,
                    name: &l.name,
                    limit: &l.check.key.limit,
                    entries: &l.check.key.entries,
                    hits: l.check.hits,
                    allowed: o.allowed,
                }
            })
            .collect()
    }
}
