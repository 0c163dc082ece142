//! Candidate limits (`CANDIDATE_CONFIG`) on Redis: a request's candidate checks are a request of
//! their own, decided in the SAME script call as its enforced checks (the script decides
//! several requests per call, each all or nothing), so trying a limit costs no round trip and
//! can never change the enforced answer. Standalone Redis sends both in the request's EVALSHA
//! (`standalone.rs`); on a Cluster both go in one call when every key of the request is in one
//! slot (a candidate on the same descriptor as the enforced limit shares its hash tag), else
//! the candidates are decided in calls of their own, concurrently, and a failure of theirs
//! only marks them lost ([`Decision::beside_lost`]).

use super::batch::run_batch;
use super::cluster::{group_slot, groups, Cluster};
use super::{codec, Common, DENIED};
use crate::store::{Decision, LimitCheck, StoreError};
use std::sync::Arc;

/// A request's checks as indexes: the enforced ones, and the candidates beside them.
pub(super) fn split(checks: &[LimitCheck]) -> (Vec<usize>, Vec<usize>) {
    (0..checks.len()).partition(|&i| !checks[i].candidate)
}

impl Cluster {
    /// A request with enforced and candidate checks (both non-empty).
    pub(super) async fn decide_beside(
        self: &Arc<Self>,
        common: &Arc<Common>,
        checks: &[LimitCheck],
    ) -> Result<Decision, StoreError> {
        let (own, beside) = split(checks);
        // A request that records usage takes the path that outlives its caller (`decide`).
        let records = checks.iter().any(|c| c.record && c.hits > 0);
        if groups(checks).len() == 1 && !records {
            return self.one_call(common, checks, (&own, &beside)).await;
        }
        let sub = |idx: &[usize]| idx.iter().map(|&i| checks[i].clone()).collect::<Vec<_>>();
        let (own_checks, beside_checks) = (sub(&own), sub(&beside));
        // Boxed: `decide` leads back here (never for these halves, which are one kind each).
        let (enforced, candidates) = tokio::join!(
            Box::pin(self.decide(common, &own_checks)),
            Box::pin(self.decide(common, &beside_checks))
        );
        let mut enforced = enforced.map_err(|e| e.widened(&own, checks.len()))?;
        let (outcomes, leases) = (
            std::mem::take(&mut enforced.outcomes),
            std::mem::take(&mut enforced.leases),
        );
        let mut d = Decision {
            outcomes: vec![DENIED; checks.len()],
            ..enforced
        };
        for (o, &i) in outcomes.into_iter().zip(&own) {
            d.outcomes[i] = o;
        }
        if !leases.is_empty() {
            d.leases = vec![crate::store::LeaseEffect::default(); checks.len()];
            for (l, &i) in leases.into_iter().zip(&own) {
                d.leases[i] = l;
            }
        }
        match candidates {
            Ok(c) => {
                d.steps += c.steps;
                for (k, &i) in beside.iter().enumerate() {
                    if let Some(o) = c.outcomes.get(k) {
                        d.outcomes[i] = *o;
                    }
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "candidate limits not decided");
                d.beside_lost = true;
            }
        }
        Ok(d)
    }

    /// Both requests in one script call, on the one slot their keys share.
    async fn one_call(
        &self,
        common: &Common,
        checks: &[LimitCheck],
        (own, beside): (&[usize], &[usize]),
    ) -> Result<Decision, StoreError> {
        let conn = self.connection().await;
        common.record_health(None, &conn);
        let calls = [
            common.call_for(checks, own, true),
            common.call_for(checks, beside, true),
        ];
        let r = run_batch(
            &common.script,
            conn?,
            &common.time.arg(),
            &[&calls[0], &calls[1]],
            common.timeout,
        )
        .await;
        common.record_health(group_slot(checks, own), &r);
        let replies = r?;
        let (mut outcomes, mut leases) = (vec![DENIED; checks.len()], Vec::new());
        let mut admitted = false;
        for (n, ((call, idx), values)) in calls.iter().zip([own, beside]).zip(&replies).enumerate()
        {
            let into = codec::Fold {
                outcomes: &mut outcomes,
                leases: &mut leases,
            };
            let ok = codec::decode(values, call.layout(), idx, into)?;
            if n == 0 {
                admitted = ok;
            }
        }
        Ok(Decision {
            at: crate::store::DecidedAt::Unknown,
            admitted,
            outcomes,
            local: false,
            steps: 1,
            beside_lost: false,
            leases,
        })
    }
}
