//! A request's candidate limits (`CANDIDATE_CONFIG`): planned on the candidate rules as the
//! enforced ones are on theirs, then marked candidate, so the store decides them in the same
//! call as a request of their own and on counters of their own, and the answer is the enforced
//! config's alone. What a candidate cannot be: a lease (`in_flight`, `reservations`: a slot or
//! a reservation taken for real), a slice of a leased or global limit (decided as a plain
//! counter on the region's store), or Envoy's per-descriptor `limit` override (the candidate's
//! own limit is what is being tried).

use super::plan::{plan, Plan, Resolution};
use super::ServiceOptions;
use crate::candidates::{Candidates, Seen};
use crate::config::RuleSet;
use crate::proto::RateLimitRequest;
use crate::store::{Decider, LimitCheck, Outcome};
use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// Candidate checks one request carries at most: the budget on the work candidates add to a
/// store call (each is a counter read and written in the request's script call, as an enforced
/// limit is). A request matching more candidate limits than this has the first ones decided
/// and the rest counted as untracked (`reason="budget"`).
pub(super) const MAX_CANDIDATE_CHECKS: usize = 8;

/// Candidate calls made apart from the answer ([`Apart`]) running at once, at most: past it a
/// request's candidates are not decided (counted `reason="lost"`), so a slow store never piles
/// up tasks.
pub(super) const MAX_APART_CALLS: usize = 256;

/// How long a call apart may take before its candidates count as lost.
const APART_BUDGET: Duration = Duration::from_secs(1);

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
        // A refund (Envoy's `is_negative_hits`, a stream's usage given back) is no decision.
        .filter(|(_, l)| l.check.lease.is_none() && !l.check.leased && !l.check.refund)
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

/// A request's candidate checks whose enforced answer made no store call to ride in: a request
/// only candidates match, one the deny cache or leased slices answered, or any request under
/// `FAILURE_MODE=local` (whose local decisions and write-backs are for enforced limits alone).
/// They are decided in a call of their own on a spawned task, so the answer neither waits on
/// it nor depends on it: a failure, a call past [`APART_BUDGET`] or past [`MAX_APART_CALLS`]
/// only counts them lost.
pub(super) struct Apart {
    pub(super) decider: Arc<dyn Decider>,
    pub(super) candidates: Arc<Candidates>,
    pub(super) running: Arc<Semaphore>,
}

impl Apart {
    /// Decides `beside` for a request of `domain` the enforced config answered (`admitted`).
    pub(super) fn spawn(self, beside: Beside, domain: &str, admitted: bool) {
        if beside.over_budget > 0 {
            self.candidates.record_over_budget(beside.over_budget);
        }
        let Ok(permit) = Arc::clone(&self.running).try_acquire_owned() else {
            self.candidates.record_lost();
            return;
        };
        let domain = domain.to_owned();
        tokio::spawn(async move {
            let checks: Vec<LimitCheck> = beside.checks().collect();
            let call = self.decider.decide_by(checks, None);
            match tokio::time::timeout(APART_BUDGET, call).await {
                Ok(Ok(d)) if !d.beside_lost && d.outcomes.len() == beside.kept.len() => {
                    self.candidates
                        .record(&beside.seen(&d.outcomes, &domain), admitted);
                }
                _ => self.candidates.record_lost(),
            }
            drop(permit);
        });
    }
}
