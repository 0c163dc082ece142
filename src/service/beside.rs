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

/// The candidate checks of one request.
#[derive(Debug)]
pub(super) struct Beside {
    plan: Plan,
    /// Per candidate check sent: its limit in `plan` and the stat key of the first descriptor
    /// it serves.
    kept: Vec<(usize, usize)>,
    /// Candidate limits matched past [`MAX_CANDIDATE_CHECKS`].
    pub(super) over_budget: usize,
    /// Per kept candidate: the enforced count it is judged on instead of a counter of its own
    /// ([`Beside::judge_on`]), and once the enforced decision is known, its verdict.
    on: Vec<Option<On>>,
}

/// A candidate judged on an enforced check's count: a fixed window no looser than the enforced
/// one (as configured), on the same descriptor and window, both recording every hit
/// (envoyproxy counting). Both counters would hold the same count, so the enforced one's, read
/// from its outcome, is the candidate's: no key of its own, no work in the store (the common
/// case of trying a lower limit costs nothing there).
#[derive(Debug, Clone, Copy)]
struct On {
    /// The enforced check's index in the request; `None`: the request leaves the enforced
    /// count unknowable for this candidate (Envoy's `limit` override moved its hits to another
    /// counter, two checks on one counter, a lease or a slice): counted lost, never on a
    /// counter of its own, which would then hold only some of the hits.
    enforced: Option<usize>,
    /// The limit the enforced check was decided against (an admin override's, if any).
    enforced_limit: u64,
    limit: u64,
    /// Its verdict, once judged; `None` before, or when the enforced outcome does not tell.
    verdict: Option<bool>,
}

impl On {
    /// The candidate's verdict on the enforced check's outcome `o`, if it tells.
    fn verdict_on(&self, o: &Outcome) -> Option<bool> {
        match o.allowed {
            // Recorded and admitted: the count after is the limit less `remaining`.
            true => Some(self.enforced_limit.saturating_sub(u64::from(o.remaining)) <= self.limit),
            // Denied: the count is past the enforced limit; past the candidate's if that is no
            // higher (an admin override may have made it lower: then unknown).
            false => (self.enforced_limit >= self.limit).then_some(false),
        }
    }
}

/// How candidate `c` is judged among the request's `enforced` checks: `None` on a counter of
/// its own (no enforced check keeps its descriptor's count in its window, or it is looser than
/// the enforced limit, or not a recording fixed window), else [`On`].
fn judged_on(c: &LimitCheck, enforced: &[LimitCheck]) -> Option<On> {
    use crate::config::Algorithm::FixedWindow;
    let fixed = |x: &LimitCheck| x.key.limit.algorithm == FixedWindow;
    if !(c.record && !c.stop_over && !c.refund && c.hits > 0 && fixed(c)) {
        return None;
    }
    let (mut mine, mut unknowable) = (None, false);
    for (i, e) in enforced.iter().enumerate() {
        if e.key.domain != c.key.domain || e.key.entries != c.key.entries {
            continue;
        }
        if e.key.overridden {
            unknowable = true;
            continue;
        }
        if !fixed(e) || e.key.limit.period != c.key.limit.period {
            continue;
        }
        // What the config decides (how the domain counts, a lease, a slice) is the same on
        // every request: such an enforced counter is never read, the candidate keeps its own.
        if !e.record || e.stop_over || e.lease.is_some() || e.leased || e.slice.is_some() {
            return None;
        }
        // What this request decides (its hits, a refund, a calendar window read at an edge, a
        // second check on the counter) makes the count unknowable for it alone.
        unknowable |= mine.is_some() || e.refund || e.hits != c.hits || e.window != c.window;
        mine = Some((i, e));
    }
    let (i, e) = mine?;
    let configured = e.key.limit.requests_per_unit;
    if !unknowable && c.key.limit.requests_per_unit > configured {
        return None;
    }
    Some(On {
        enforced: (!unknowable).then_some(i),
        enforced_limit: u64::from(e.admin_limit.unwrap_or(configured)),
        limit: u64::from(c.key.limit.requests_per_unit),
        verdict: None,
    })
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
        on: vec![None; kept.len()],
        plan,
        kept,
        over_budget,
    })
}

impl Beside {
    /// Marks the candidates that can be judged on one of the request's `enforced` checks'
    /// count ([`On`]): they are not sent to the store.
    pub(super) fn judge_on(&mut self, enforced: &[LimitCheck]) {
        // A request that stops charging when a key is over leaves some recording checks
        // undecided when the deny cache answers it: no count to read there.
        if enforced.iter().any(|e| e.stop_over) {
            return;
        }
        for (k, &(j, _)) in self.kept.iter().enumerate() {
            self.on[k] = judged_on(&self.plan.limits[j].check, enforced);
        }
    }

    /// Judges the candidates of [`Beside::judge_on`] on the enforced outcomes (`fallback`: they
    /// are not the store's counts, and judge nothing).
    pub(super) fn judge(&mut self, enforced: &[Outcome], fallback: bool) {
        for on in self.on.iter_mut().flatten() {
            let o = on
                .enforced
                .and_then(|i| enforced.get(i))
                .filter(|_| !fallback);
            on.verdict = o.and_then(|o| on.verdict_on(o));
        }
    }

    /// Whether the candidates can all be counted: none judged on an enforced count is left
    /// without a verdict.
    pub(super) fn judged(&self) -> bool {
        self.on.iter().flatten().all(|on| on.verdict.is_some())
    }

    /// Whether some candidate needs the store (is not judged on an enforced count).
    pub(super) fn needs_call(&self) -> bool {
        self.on.iter().any(Option::is_none)
    }

    /// The checks to decide beside the enforced ones (in [`Beside::seen`]'s order).
    pub(super) fn checks(&self) -> impl Iterator<Item = LimitCheck> + '_ {
        self.kept
            .iter()
            .zip(&self.on)
            .filter(|(_, on)| on.is_none())
            .map(|(&(j, _), _)| {
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

    /// What each candidate limit did, from the outcomes of [`Beside::checks`] and the
    /// verdicts [`Beside::judge`] gave; `None` if some candidate has neither.
    pub(super) fn seen<'a>(
        &'a self,
        outcomes: &[Outcome],
        domain: &'a str,
    ) -> Option<Vec<Seen<'a>>> {
        let mut sent = outcomes.iter();
        self.kept
            .iter()
            .zip(&self.on)
            .map(|(&(j, d), on)| {
                let allowed = match on {
                    Some(on) => on.verdict?,
                    None => sent.next()?.allowed,
                };
                let l = &self.plan.limits[j];
                Some(Seen {
                    domain,
                    key: &self.plan.descriptors[d].stat_key,
                    name: &l.name,
                    limit: &l.check.key.limit,
                    entries: &l.check.key.entries,
                    hits: l.check.hits,
                    allowed,
                })
            })
            .collect()
    }
}

/// A request's candidate checks whose enforced answer made no store call to ride in: a request
/// only candidates match, one the deny cache or leased slices answered, or any request under
/// `FAILURE_MODE=local` (whose local decisions and write-backs are for enforced limits alone).
/// They are decided in a call of their own on a spawned task, so the answer neither waits on
/// it nor depends on it: a failure, or a call past [`MAX_APART_CALLS`], only counts them
/// lost.
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
            // Bounded by the store's own timeout (`REDIS_TIMEOUT`; under `FAILURE_MODE=local`
            // its budget), as any call.
            match self.decider.decide_by(checks, None).await {
                Ok(d) if !d.beside_lost => match beside.seen(&d.outcomes, &domain) {
                    Some(seen) => self.candidates.record(&seen, admitted),
                    None => self.candidates.record_lost(),
                },
                _ => self.candidates.record_lost(),
            }
            drop(permit);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Limit, Unit};

    fn check(limit: u32, unit: Unit) -> LimitCheck {
        let mut c = LimitCheck::for_tests("d", "v", Limit::fixed(limit, unit), 1);
        c.record = true;
        c
    }

    fn on(c: &LimitCheck, enforced: &[LimitCheck]) -> Option<Option<usize>> {
        judged_on(c, enforced).map(|o| o.enforced)
    }

    #[test]
    fn a_lower_window_on_the_same_counter_is_judged_and_nothing_else() {
        let (c, e) = (check(50, Unit::Minute), check(100, Unit::Minute));
        assert_eq!(on(&c, &[check(7, Unit::Second), e.clone()]), Some(Some(1)));
        assert_eq!(
            on(&c, std::slice::from_ref(&c)),
            Some(Some(0)),
            "the same limit"
        );
        // Its own counter: looser, another window, a charging domain, a leased limit, or no
        // enforced limit on its descriptor.
        assert_eq!(
            on(&check(150, Unit::Minute), std::slice::from_ref(&e)),
            None
        );
        assert_eq!(on(&c, &[check(100, Unit::Hour)]), None);
        let mut charging = e.clone();
        charging.record = false;
        assert_eq!(
            on(&c, &[charging]),
            None,
            "all_or_nothing counts only the admitted"
        );
        let mut leased = e.clone();
        leased.leased = true;
        assert_eq!(on(&c, &[leased]), None);
        let mut other = e.clone();
        other.key.entries = Arc::from(vec![("k".to_string(), "w".to_string())]);
        assert_eq!(on(&c, &[other]), None);
        // This request leaves the count unknowable: lost, never its own counter.
        let mut overridden = e.clone();
        overridden.key.overridden = true;
        assert_eq!(on(&c, &[e.clone(), overridden]), Some(None));
        assert_eq!(
            on(&c, &[e.clone(), e.clone()]),
            Some(None),
            "two checks on it"
        );
        let mut more = e.clone();
        more.hits = 3;
        assert_eq!(on(&c, &[more]), Some(None));
    }

    #[test]
    fn the_verdict_is_the_count_after_against_the_candidate() {
        let outcome = |allowed, remaining| Outcome {
            allowed,
            remaining,
            reset: std::time::Duration::ZERO,
            retry_after: std::time::Duration::ZERO,
        };
        let verdict = |enforced_limit, o: Outcome| {
            let on = On {
                enforced: Some(0),
                enforced_limit,
                limit: 50,
                verdict: None,
            };
            on.verdict_on(&o)
        };
        assert_eq!(verdict(100, outcome(true, 50)), Some(true), "the 50th");
        assert_eq!(verdict(100, outcome(true, 49)), Some(false), "the 51st");
        assert_eq!(verdict(100, outcome(false, 0)), Some(false), "past 100");
        assert_eq!(
            verdict(20, outcome(false, 0)),
            None,
            "an override of 20 denied: unknown"
        );
    }
}
