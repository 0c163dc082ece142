//! Candidate limits (`CANDIDATE_CONFIG`) on Redis: a request's candidate checks are a request of
//! their own, decided in the SAME script call as its enforced checks (the script decides
//! several requests per call, each all or nothing), so trying a limit costs no round trip and
//! can never change the enforced answer. Standalone Redis sends both in the request's EVALSHA
//! (`standalone.rs`); on a Cluster both go in one call when every key of the request is in one
//! slot (a candidate on the same descriptor as the enforced limit shares its hash tag), else
//! the enforced checks go alone and the candidates are left to the service, which decides
//! them in a call of their own after the answer ([`Decision::beside_apart`]).

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
        if groups(checks).len() == 1 {
            if !checks.iter().any(|c| c.record && c.hits > 0) {
                return self.one_call(common, checks, (&own, &beside)).await;
            }
            // Recorded usage must reach Redis even if the caller gives up: its own task, as
            // `decide` runs such a request.
            let (me, common, owned) = (Arc::clone(self), Arc::clone(common), checks.to_vec());
            let task = common
                .runtime
                .clone()
                .spawn(async move { me.one_call(&common, &owned, (&own, &beside)).await });
            return task.await.unwrap_or_else(|e| {
                Err(StoreError::Permanent(format!("decision task failed: {e}")))
            });
        }
        // Apart: the enforced checks alone, the candidates left for the service to decide in
        // a call of their own after the answer (never holding it).
        let own_checks: Vec<LimitCheck> = own.iter().map(|&i| checks[i].clone()).collect();
        // Boxed: `decide` leads back here (never for these checks, all enforced).
        let mut d = Box::pin(self.decide(common, &own_checks))
            .await
            .map_err(|e| e.widened(&own, checks.len()))?;
        d.beside_apart = true;
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
        let (mut admitted, mut beside_lost) = (false, false);
        for (n, ((call, idx), values)) in calls.iter().zip([own, beside]).zip(&replies).enumerate()
        {
            let into = codec::Fold {
                outcomes: &mut outcomes,
                leases: &mut leases,
            };
            match (n, codec::decode(values, call.layout(), idx, into)) {
                (0, r) => admitted = r?,
                // A candidates' reply that cannot be read loses them, never the answer.
                (_, r) => beside_lost = r.is_err(),
            }
        }
        Ok(Decision {
            admitted,
            outcomes,
            steps: 1,
            beside_lost,
            leases,
            ..Decision::default()
        })
    }
}
