//! The leased limits' decider: a request's sliced checks are taken from this replica's slices,
//! the rest go down to the stack's own decider in the one call the request makes, and the
//! request's verdict and charges follow the store's rules ([`Admission`], [`charged`]).

use super::{global_elsewhere, sliced, Slices, Take, Taken};
use crate::store::{
    charged, Admission, BoxFuture, Decider, Decision, LimitCheck, Outcome, StoreError,
};
use std::sync::Arc;
use std::time::Duration;

/// The decider with leased limits decided from slices, over the stack's own decider.
#[derive(Debug)]
pub struct SlicedDecider {
    slices: Arc<Slices>,
    inner: Arc<dyn Decider>,
}

impl SlicedDecider {
    pub fn new(slices: Arc<Slices>, inner: Arc<dyn Decider>) -> Self {
        Self { slices, inner }
    }

    async fn decide_sliced(
        &self,
        checks: Vec<LimitCheck>,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Decision, StoreError> {
        let now = self.slices.now_us();
        self.slices.sweep_if_due(now);
        let n = checks.len();
        let mut taken: Vec<Option<Taken>> = Vec::with_capacity(n);
        for c in &checks {
            taken.push(match sliced(c) {
                true => match self.slices.take(c, deadline, now).await {
                    Take::Done(t) => Some(t),
                    Take::Down => None,
                },
                false => None,
            });
        }
        let denied = checks
            .iter()
            .zip(&taken)
            .any(|(c, t)| t.as_ref().is_some_and(|t| !t.allowed) && !c.shadow);
        // Sent down: every check not decided from a slice; only the recording ones when the
        // slices deny the request (they are charged whatever the verdict). A global limit's go
        // to its home store, in a call of their own (ordinary checks on the one global counter).
        // Candidate checks (`CANDIDATE_CONFIG`) ride in the regional store's call if there is
        // one; never is a call made for them alone (the service decides them apart).
        let sent = |i: &usize| {
            let c = &checks[*i];
            !c.candidate && taken[*i].is_none() && (!denied || c.record)
        };
        let (home_idx, mut idx): (Vec<usize>, Vec<usize>) = (0..n)
            .filter(sent)
            .partition(|&i| global_elsewhere(&checks[i]));
        let beside_apart = idx.is_empty() && checks.iter().any(|c| c.candidate);
        if !idx.is_empty() {
            idx.extend((0..n).filter(|&i| checks[i].candidate));
        }
        let at_home = if home_idx.is_empty() {
            None
        } else {
            let rest: Vec<LimitCheck> = home_idx.iter().map(|&i| checks[i].clone()).collect();
            Some(self.at_home(&rest, deadline).await)
        };
        let below = if idx.is_empty() {
            None
        } else {
            let rest = idx.iter().map(|&i| checks[i].clone()).collect();
            match self.inner.decide_by(rest, deadline).await {
                Ok(d) => Some(d),
                Err(e) => {
                    self.untake_all(&checks, &taken, |_| true);
                    return Err(e.widened(&idx, n));
                }
            }
        };
        let mut d = self.assemble(&checks, taken, (&idx, below), (&home_idx, at_home), now);
        // Candidates left apart, here or below, have no outcome: none is left in their place.
        if beside_apart || d.beside_apart {
            d.outcomes.truncate(crate::store::enforced_len(&checks));
            d.beside_apart = true;
        }
        Ok(d)
    }

    /// A global limit's checks that no slice decides, on the home store within the request's
    /// deadline. Home not answering (a partition, a slow link, no home store) denies them: a
    /// request never gets past a global limit because home is away, whatever the failure mode
    /// says of the regional store (a fallback's answer, as the decision log marks it).
    async fn at_home(
        &self,
        checks: &[LimitCheck],
        deadline: Option<tokio::time::Instant>,
    ) -> Decision {
        let denied = || Decision {
            at: crate::store::DecidedAt::Fallback,
            admitted: false,
            outcomes: checks
                .iter()
                .map(|_| Outcome {
                    allowed: false,
                    remaining: 0,
                    reset: Duration::ZERO,
                    retry_after: Duration::from_secs(1),
                })
                .collect(),
            local: false,
            steps: 0,
            beside_lost: false,
            beside_apart: false,
            leases: Vec::new(),
        };
        let Some(home) = self.slices.home() else {
            return denied();
        };
        let call = home.decide(checks);
        let r = match deadline {
            Some(d) => tokio::time::timeout_at(d, call).await.ok(),
            None => Some(call.await),
        };
        match r {
            Some(Ok(d)) => d,
            _ => denied(),
        }
    }

    /// Gives back the units of the sliced checks `keep` says are not charged.
    fn untake_all(
        &self,
        checks: &[LimitCheck],
        taken: &[Option<Taken>],
        uncharged: impl Fn(usize) -> bool,
    ) {
        for (i, (c, t)) in checks.iter().zip(taken).enumerate() {
            if let Some(t) = t {
                if t.allowed && uncharged(i) {
                    t.entry.untake(c.hits, t.window_end);
                }
            }
        }
    }

    /// The request's decision from the slices' verdicts and the store's on the rest.
    fn assemble(
        &self,
        checks: &[LimitCheck],
        taken: Vec<Option<Taken>>,
        (idx, below): (&[usize], Option<Decision>),
        (home_idx, at_home): (&[usize], Option<Decision>),
        now: u64,
    ) -> Decision {
        let n = checks.len();
        let mut outcomes: Vec<Outcome> = taken
            .iter()
            .map(|t| match t {
                Some(t) => Outcome {
                    allowed: t.allowed,
                    remaining: u32::try_from(t.remaining).unwrap_or(u32::MAX),
                    reset: Duration::from_micros(t.reset_at.saturating_sub(now)),
                    retry_after: match t.allowed {
                        true => Duration::ZERO,
                        false => Duration::from_micros(t.retry_at.saturating_sub(now).max(1)),
                    },
                },
                // Not read (the slices denied the request): as the deny cache reports them.
                None => Outcome {
                    allowed: true,
                    remaining: 0,
                    reset: Duration::ZERO,
                    retry_after: Duration::ZERO,
                },
            })
            .collect();
        let (mut steps, mut leases, mut beside) = (0, Vec::new(), (false, false));
        use crate::store::DecidedAt::{Fallback, Unknown};
        let below_at = below.as_ref().map_or(Unknown, |d| d.at);
        let home_away = at_home.as_ref().is_some_and(|d| d.at == Fallback);
        if let Some(d) = below {
            (steps, beside) = (d.steps, (d.beside_lost, d.beside_apart));
            if !d.leases.is_empty() {
                leases = vec![crate::store::LeaseEffect::default(); n];
            }
            for (k, &i) in idx.iter().enumerate() {
                if let Some(o) = d.outcomes.get(k) {
                    outcomes[i] = *o;
                }
                if let (Some(l), Some(slot)) = (d.leases.get(k), leases.get_mut(i)) {
                    *slot = *l;
                }
            }
        }
        if let Some(d) = at_home {
            steps += d.steps;
            for (k, &i) in home_idx.iter().enumerate() {
                if let Some(o) = d.outcomes.get(k) {
                    outcomes[i] = *o;
                }
            }
        }
        let mut admission = Admission::default();
        for (c, o) in checks.iter().zip(&outcomes) {
            admission.add(c, o.allowed);
        }
        let admitted = admission.admitted();
        let at = match admitted {
            // Admitted: no denial of a fallback's in the answer.
            true => below_at,
            false => decided_at(checks, &taken, below_at, (home_idx, home_away)),
        };
        let allowed: Vec<bool> = outcomes.iter().map(|o| o.allowed).collect();
        let charge = charged(checks, &allowed, admitted);
        self.untake_all(checks, &taken, |i| !charge[i]);
        Decision {
            at,
            admitted,
            outcomes,
            steps,
            beside_lost: beside.0,
            beside_apart: beside.1,
            leases,
            ..Decision::default()
        }
    }
}

impl Decider for SlicedDecider {
    fn decide_by(
        &self,
        checks: Vec<LimitCheck>,
        deadline: Option<tokio::time::Instant>,
    ) -> BoxFuture<'_, Result<Decision, StoreError>> {
        if !checks.iter().any(|c| sliced(c) || global_elsewhere(c)) {
            return self.inner.decide_by(checks, deadline);
        }
        Box::pin(self.decide_sliced(checks, deadline))
    }
}

/// When a denied request was decided, for the decision log: the store below's instant
/// (`below`), or a fallback's mark if a limit that can deny was answered for want of the
/// store (a slice denied without a refill, or dry with its region cut off from home; a global
/// limit home did not answer: `home_away`).
fn decided_at(
    checks: &[LimitCheck],
    taken: &[Option<Taken>],
    below: crate::store::DecidedAt,
    (home_idx, home_away): (&[usize], bool),
) -> crate::store::DecidedAt {
    let outage = checks
        .iter()
        .zip(taken)
        .any(|(c, t)| !c.shadow && t.as_ref().is_some_and(|t| t.outage));
    if outage || (home_away && home_idx.iter().any(|&i| !checks[i].shadow)) {
        return crate::store::DecidedAt::Fallback;
    }
    below
}
