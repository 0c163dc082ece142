//! The Cluster backend: one script call per slot (a script may only touch keys of one slot),
//! concurrent; if the request is not admitted, what the admitting slots charged is undone
//! exactly (the same window, the same sorted-set entry, only the limits that were written).

use super::batch::run;
use super::codec::ScriptTime;
use super::codec::{self, Call};
use super::conn::Conn;
use super::{classify, keys, Common, RedisSettings, DENIED, UNDO_ATTEMPTS};
use crate::store::{Admission, Decision, LimitCheck, Outcome, StoreError};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::Script;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A Redis Cluster through the `redis` crate's async cluster client.
pub(super) struct Cluster {
    client: ClusterClient,
    /// Connected lazily, so sluice starts (and reports NOT_SERVING) while Redis is down and
    /// recovers without a restart.
    conn: Mutex<Option<ClusterConnection>>,
}

impl Cluster {
    /// The client for the seeds `infos`, connecting on first use.
    pub(super) fn new(
        settings: &RedisSettings,
        infos: Vec<redis::ConnectionInfo>,
        certs: Option<redis::TlsCertificates>,
    ) -> Result<Self, StoreError> {
        if infos.is_empty() {
            return Err(StoreError::Permanent("no Redis Cluster seed given".into()));
        }
        let mut builder = ClusterClient::builder(infos);
        if let Some(certs) = certs {
            builder = builder
                .certs(certs)
                .danger_accept_invalid_hostnames(settings.tls.skip_hostname_verification);
        }
        let client = builder
            .connection_timeout(settings.timeout)
            .response_timeout(settings.timeout)
            .retries(2)
            .build()
            .map_err(|e| StoreError::Permanent(format!("Redis Cluster client: {e}")))?;
        Ok(Self {
            client,
            conn: Mutex::new(None),
        })
    }

    /// The shared Cluster connection, connected on first use.
    pub(super) async fn connection(&self) -> Result<Conn, StoreError> {
        if let Some(c) = self.conn.lock().ok().and_then(|g| g.clone()) {
            return Ok(Conn::Cluster(c));
        }
        // Two first calls may both connect; the later one's connection is kept.
        let c = self.client.get_async_connection().await.map_err(classify)?;
        if let Ok(mut g) = self.conn.lock() {
            *g = Some(c.clone());
        }
        Ok(Conn::Cluster(c))
    }

    /// Decides a request. Usage a request records (a report Envoy sends when a response is
    /// done) must reach Redis even if the caller gives up at its deadline and drops this
    /// future: such a request runs on its own task.
    pub(super) async fn decide(
        self: &Arc<Self>,
        common: &Arc<Common>,
        checks: &[LimitCheck],
    ) -> Result<Decision, StoreError> {
        if !checks.iter().any(|c| c.record && c.hits > 0) {
            return self.decide_all(common, checks, true).await;
        }
        let (me, common, owned) = (Arc::clone(self), Arc::clone(common), checks.to_vec());
        let task = common
            .runtime
            .clone()
            .spawn(async move { me.decide_all(&common, &owned, true).await });
        task.await
            .unwrap_or_else(|e| Err(StoreError::Permanent(format!("decision task failed: {e}"))))
    }

    /// `defer_refunds`: all-or-nothing refunds spanning slots wait for the verdict (false for
    /// the refunds themselves, once the verdict is in: they always admit, so applying them
    /// needs no undo, and deferring them again would never end).
    async fn decide_all(
        &self,
        common: &Arc<Common>,
        checks: &[LimitCheck],
        defer_refunds: bool,
    ) -> Result<Decision, StoreError> {
        let groups = groups(checks);
        let conn = self.connection().await;
        common.record_health(&conn);
        let conn = conn?;
        if let [only] = groups.as_slice() {
            // One call decides everything: all or nothing inside the script, nothing to undo.
            let call = common.call_for(checks, only, true);
            let r = run(
                &common.script,
                conn,
                &common.time.arg(),
                &call,
                common.timeout,
            )
            .await;
            common.record_health(&r);
            let mut outcomes = vec![DENIED; checks.len()];
            let admitted = codec::decode(&r?, only, false, &mut outcomes)?;
            return Ok(Decision {
                admitted,
                outcomes,
                local: false,
                steps: 1,
            });
        }
        // Several slots. A refund (all or nothing) applies only if the request is admitted,
        // and one applied in a slot could not be taken back exactly when another slot denies:
        // so refunds wait for the verdict.
        if defer_refunds && checks.iter().any(|c| c.refund && !c.record && c.hits > 0) {
            return Box::pin(self.refunds_after_the_verdict(common, checks)).await;
        }
        // The charges and, if the request is not admitted, the undo of the others run on
        // their own task, so a caller that gives up (Envoy's deadline) cannot leave a charge
        // without its undo.
        let task = common.runtime.spawn(charge_or_undo(
            Arc::clone(common),
            conn,
            checks.to_vec(),
            groups,
        ));
        task.await
            .map_err(|e| StoreError::Permanent(format!("decision task failed: {e}")))?
    }

    /// A request spanning slots with all-or-nothing refunds: decided first with each refund as
    /// a shadow check (it reads its counter and never denies), then, if admitted, the refunds
    /// are applied (a refund always admits). Two round trips, only for such requests.
    async fn refunds_after_the_verdict(
        &self,
        common: &Arc<Common>,
        checks: &[LimitCheck],
    ) -> Result<Decision, StoreError> {
        let late = |c: &LimitCheck| c.refund && !c.record && c.hits > 0;
        let first: Vec<LimitCheck> = checks
            .iter()
            .map(|c| {
                if late(c) {
                    LimitCheck {
                        hits: 0,
                        refund: false,
                        shadow: true,
                        ..c.clone()
                    }
                } else {
                    c.clone()
                }
            })
            .collect();
        let mut decision = Box::pin(self.decide_all(common, &first, true)).await?;
        let idx: Vec<usize> = (0..checks.len()).filter(|&i| late(&checks[i])).collect();
        for &i in &idx {
            // As a refund reports itself: allowed, nothing to wait for.
            decision.outcomes[i].allowed = true;
            decision.outcomes[i].retry_after = Duration::ZERO;
        }
        if decision.admitted {
            let refunds: Vec<LimitCheck> = idx.iter().map(|&i| checks[i].clone()).collect();
            let applied = Box::pin(self.decide_all(common, &refunds, false)).await?;
            for (k, &i) in idx.iter().enumerate() {
                decision.outcomes[i] = applied.outcomes[k];
            }
            decision.steps += applied.steps;
        }
        Ok(decision)
    }
}

/// The atomic steps of a request, as indexes into `checks`: one call per slot; keys of
/// different tags that happen to share a slot still go together.
pub(super) fn groups(checks: &[LimitCheck]) -> Vec<Vec<usize>> {
    if checks.len() <= 1 {
        return vec![(0..checks.len()).collect()];
    }
    let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
    for (i, c) in checks.iter().enumerate() {
        let slot = keys::tag_slot(&keys::hash_tag(&c.key));
        match groups.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, g)) => g.push(i),
            None => groups.push((slot, vec![i])),
        }
    }
    groups.into_iter().map(|(_, g)| g).collect()
}

/// Runs every slot's call concurrently and decides the request by [`Admission`] over every
/// limit's verdict (quota-mode limits go to each slot as shadow, so a slot never applies the
/// quota rule alone); if the request is not admitted (a slot denies or fails, or every
/// quota-mode limit denied), undoes exactly what the admitting slots charged.
async fn charge_or_undo(
    common: Arc<Common>,
    conn: Conn,
    checks: Vec<LimitCheck>,
    groups: Vec<Vec<usize>>,
) -> Result<Decision, StoreError> {
    let calls: Vec<Call> = groups
        .iter()
        .map(|g| Call {
            tokens: true,
            ..common.call_for(&checks, g, false)
        })
        .collect();
    let (script, time, timeout) = (&common.script, &common.time, common.timeout);
    let now = time.arg();
    let results = futures_util::future::join_all(
        calls
            .iter()
            .map(|c| run(script, conn.clone(), &now, c, timeout)),
    )
    .await;
    let mut outcomes = vec![DENIED; checks.len()];
    let mut first_error = None;
    for (g, r) in groups.iter().zip(&results) {
        common.record_health(r);
        let decoded = r
            .as_ref()
            .map_err(Clone::clone)
            .and_then(|values| codec::decode(values, g, true, &mut outcomes));
        if let Err(e) = decoded {
            first_error.get_or_insert(e);
        }
    }
    let mut admission = Admission::default();
    for (c, o) in checks.iter().zip(&outcomes) {
        admission.add(c, o.allowed);
    }
    let admitted = first_error.is_none() && admission.admitted();
    let undone = undo(&common, &conn, &calls, &results, admitted).await;
    if let Some(e) = first_error {
        return Err(e);
    }
    give_back(&checks, &groups, &undone, &mut outcomes);
    Ok(Decision {
        admitted,
        outcomes,
        local: false,
        steps: groups.len(),
    })
}

/// Undoes what the slots of a request charged that must not stand; returns, per call,
/// whether it was undone. Not admitted: every slot that admitted (and so wrote its charges).
/// STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT: each slot applied the rule to its own keys; if a key
/// is over in any slot, the slots with none over (which charged every key) are undone, whether
/// or not the request is admitted (a shadow limit over its limit admits it).
async fn undo(
    common: &Common,
    conn: &Conn,
    calls: &[Call],
    results: &[Result<Vec<i64>, StoreError>],
    admitted: bool,
) -> Vec<bool> {
    let stop = calls.iter().any(codec::is_stop);
    let over: Vec<bool> = calls
        .iter()
        .zip(results)
        .map(|(c, r)| r.as_ref().is_ok_and(|v| codec::any_denied(c, v)))
        .collect();
    let any_over = over.contains(&true);
    let mut undone = vec![false; calls.len()];
    if admitted && !(stop && any_over) {
        return undone;
    }
    for (i, ((call, r), undone)) in calls.iter().zip(results).zip(&mut undone).enumerate() {
        let Ok(values) = r else { continue };
        let undo_slot = if stop {
            any_over && !over[i]
        } else {
            // A slot that admitted wrote its charges.
            !admitted && codec::admitted(values)
        };
        if !undo_slot {
            continue;
        }
        let undo = codec::encode_undo(call, values);
        if undo.keys.is_empty() {
            continue;
        }
        match run_undo(&common.script, conn, &common.time, &undo, common.timeout).await {
            Ok(()) => *undone = true,
            Err(e) => {
                common.signals.undo_failures.add(1);
                tracing::warn!(error = %e, keys = undo.keys.len(), "could not undo the charge of a request denied in another slot");
            }
        }
    }
    undone
}

/// Runs an undo, retrying a failed call up to [`UNDO_ATTEMPTS`] times; an undo the script
/// refuses (the charge moved too far) is not retried.
async fn run_undo(
    script: &Script,
    conn: &Conn,
    time: &ScriptTime,
    undo: &Call,
    timeout: Duration,
) -> Result<(), StoreError> {
    let mut last = None;
    for _ in 0..UNDO_ATTEMPTS {
        // Read the clock again: an undo decides nothing, it only needs "now" to clamp a
        // token bucket, and a test clock may have moved past a window edge meanwhile.
        let now = time.arg();
        match run(script, conn.clone(), &now, undo, timeout).await {
            Ok(v) if codec::undo_done(&v) => return Ok(()),
            Ok(_) => {
                return Err(StoreError::Permanent(
                    "the charge moved too far to be taken back within bounded work".into(),
                ))
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| StoreError::Permanent("no undo attempt was made".into())))
}

/// What an undone charge gave back is left again: the outcomes of the groups whose charges
/// were undone report the hits as remaining.
fn give_back(
    checks: &[LimitCheck],
    groups: &[Vec<usize>],
    undone: &[bool],
    outcomes: &mut [Outcome],
) {
    let undone_charge = |c: &LimitCheck, o: &Outcome| {
        o.allowed && c.hits > 0 && !c.refund && (!c.record || c.stop_over)
    };
    for (g, _) in groups.iter().zip(undone).filter(|(_, done)| **done) {
        // Per counter: what its last check reported plus every hit the undo gave back. Two
        // checks of one request on one counter see each other's hits, so the last one holds
        // the lowest figure, and after the undo every check on it has that much more.
        for (n, &i) in g.iter().enumerate() {
            let key = &checks[i].key;
            if g[..n].iter().any(|&j| checks[j].key == *key) {
                continue;
            }
            let on_key: Vec<usize> = g[n..]
                .iter()
                .copied()
                .filter(|&j| checks[j].key == *key)
                .collect();
            let given: u64 = on_key
                .iter()
                .filter(|&&j| undone_charge(&checks[j], &outcomes[j]))
                .map(|&j| checks[j].hits)
                .sum();
            if given == 0 {
                continue;
            }
            let last = on_key.last().map_or(0, |&j| outcomes[j].remaining);
            let remaining = last
                .saturating_add(u32::try_from(given).unwrap_or(u32::MAX))
                .min(key.limit.requests_per_unit);
            for j in on_key {
                outcomes[j].remaining = remaining;
            }
        }
    }
}
