//! Which checks of a request admit it and which are written: the one rule every store, the
//! script and the response apply. Candidate checks (`CANDIDATE_CONFIG`) are a request of their
//! own here, so trying a limit never changes what the enforced ones admit or charge.

use super::LimitCheck;

/// The charging rule every store applies (the script mirrors it): which checks of a request
/// are written, given each check's verdict and whether [`Admission`] admitted the request.
/// - a recording check (`record`) is always charged;
/// - any other check is charged only if the request is admitted and it allowed it (a shadow or
///   quota limit that would deny is not);
/// - with `stop_over`, if some recording check would exceed its limit, only those are (and
///   recording refunds, which give quota back whatever the others say, and `in_flight` frees).
pub fn charged(checks: &[LimitCheck], allowed: &[bool], admitted: bool) -> Vec<bool> {
    if !checks.iter().any(|c| c.candidate) {
        return charged_group(checks, allowed, admitted, |_| true);
    }
    // The candidate checks are a request of their own: admitted by their own verdicts, and
    // charged by the same rule, apart from the enforced ones.
    let beside = Admission::candidates(checks, allowed).admitted();
    let enforced = charged_group(checks, allowed, admitted, |c| !c.candidate);
    let candidate = charged_group(checks, allowed, beside, |c| c.candidate);
    checks
        .iter()
        .zip(enforced.into_iter().zip(candidate))
        .map(|(c, (e, k))| if c.candidate { k } else { e })
        .collect()
}

/// [`charged`] over the checks `ours` selects (the others' entries are meaningless).
fn charged_group(
    checks: &[LimitCheck],
    allowed: &[bool],
    admitted: bool,
    ours: impl Fn(&LimitCheck) -> bool,
) -> Vec<bool> {
    let stop = checks.iter().any(|c| ours(c) && c.stop_over)
        && checks
            .iter()
            .zip(allowed)
            .any(|(c, &ok)| ours(c) && c.record && !ok);
    checks
        .iter()
        .zip(allowed)
        .map(|(c, &ok)| {
            if stop {
                // A stream-done call frees its `in_flight` slot or settles its reservation
                // whatever else is over.
                (c.record && (!ok || c.refund)) || c.lease.as_ref().is_some_and(|l| l.release)
            } else {
                c.record || (admitted && ok)
            }
        })
        .collect()
}

/// The rule that admits a request, from its checks' verdicts (envoyproxy/ratelimit #1045/#1059):
/// denied if any enforced limit denies, or if it has quota-mode limits and every one of them
/// denies. Shadow limits and refunds never deny. Every store and the response apply this one
/// rule; feed it each check with whether that check alone allowed the request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Admission {
    enforced_denied: bool,
    quota: u32,
    quota_allowed: u32,
}

impl Admission {
    pub fn add(&mut self, check: &LimitCheck, allowed: bool) {
        if check.candidate {
            return;
        }
        self.add_any(check, allowed);
    }

    /// The candidate checks' own admission (`CANDIDATE_CONFIG`): the verdict the request
    /// would get if they were the config in force.
    pub fn candidates(checks: &[LimitCheck], allowed: &[bool]) -> Self {
        let mut a = Admission::default();
        for (c, &ok) in checks.iter().zip(allowed) {
            if c.candidate {
                a.add_any(c, ok);
            }
        }
        a
    }

    fn add_any(&mut self, check: &LimitCheck, allowed: bool) {
        if check.shadow || check.refund {
            return;
        }
        if check.quota {
            self.quota += 1;
            self.quota_allowed += u32::from(allowed);
        } else if !allowed {
            self.enforced_denied = true;
        }
    }

    pub fn admitted(&self) -> bool {
        !self.enforced_denied && (self.quota == 0 || self.quota_allowed > 0)
    }
}

/// How many of `checks` are enforced: the candidate checks (`CANDIDATE_CONFIG`) come last in a
/// request's list, after every enforced one (the service appends them).
pub fn enforced_len(checks: &[LimitCheck]) -> usize {
    checks
        .iter()
        .position(|c| c.candidate)
        .unwrap_or(checks.len())
}
