//! The Cluster backend: one script call per slot (a script may only touch keys of one slot),
//! concurrent; if the request is not admitted, what the admitting slots charged is undone
//! exactly (the same window, the same sorted-set entry, only the limits that were written).

use super::batch::run;
use super::codec::ScriptTime;
use super::codec::{self, Call, Reply, SlotReply};
use super::conn::Conn;
use super::{classify, keys, Common, RedisSettings, DENIED, UNDO_ATTEMPTS};
use crate::store::{charged, Admission, Decision, LimitCheck, Outcome, Partial, StoreError};
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
        connect: Duration,
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
            .connection_timeout(connect)
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
        if checks.iter().any(|c| c.candidate) && checks.iter().any(|c| !c.candidate) {
            return self.decide_beside(common, checks).await;
        }
        if !checks.iter().any(|c| c.record && c.hits > 0) {
            return self.decide_all(common, checks).await;
        }
        let (me, common, owned) = (Arc::clone(self), Arc::clone(common), checks.to_vec());
        let task = common
            .runtime
            .clone()
            .spawn(async move { me.decide_all(&common, &owned).await });
        task.await
            .unwrap_or_else(|e| Err(StoreError::Permanent(format!("decision task failed: {e}"))))
    }

    async fn decide_all(
        &self,
        common: &Arc<Common>,
        checks: &[LimitCheck],
    ) -> Result<Decision, StoreError> {
        let groups = groups(checks);
        let conn = self.connection().await;
        common.record_health(None, &conn);
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
            common.record_health(group_slot(checks, only), &r);
            let (mut outcomes, mut leases) = (vec![DENIED; checks.len()], Vec::new());
            let into = codec::Fold {
                outcomes: &mut outcomes,
                leases: &mut leases,
            };
            let admitted = codec::decode(&r?, call.layout(), only, into)?;
            return Ok(Decision {
                at: crate::store::DecidedAt::Unknown,
                admitted,
                outcomes,
                local: false,
                steps: 1,
                beside_lost: false,
                beside_apart: false,
                leases,
            });
        }
        // The slots' calls and, where the verdict says so, the undo or the commit that follows
        // run on their own task, so a caller that gives up (Envoy's deadline) cannot leave a
        // charge without its undo.
        let task = common.runtime.spawn(charge_or_undo(
            Arc::clone(common),
            conn,
            checks.to_vec(),
            groups,
        ));
        task.await
            .map_err(|e| StoreError::Permanent(format!("decision task failed: {e}")))?
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
        let slot = slot_of(c);
        match groups.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, g)) => g.push(i),
            None => groups.push((slot, vec![i])),
        }
    }
    groups.into_iter().map(|(_, g)| g).collect()
}

/// A refund that gives quota back only if the request is admitted: applied in one slot, it
/// could not be taken back exactly if another slot denied, so its slot is decided dry first.
/// So are an `in_flight` slot taken and a reservation made (neither has an undo token).
fn waits_for_verdict(c: &LimitCheck) -> bool {
    (c.refund && !c.record && c.hits > 0) || c.lease.as_ref().is_some_and(|l| !l.release)
}

/// The Cluster slot of `c`'s counter (of its hash tag).
fn slot_of(c: &LimitCheck) -> u16 {
    keys::tag_slot(&keys::hash_tag(&c.key))
}

/// The slot a group of [`groups`] is called on (`None` for no check at all).
pub(super) fn group_slot(checks: &[LimitCheck], group: &[usize]) -> Option<u16> {
    group.first().and_then(|&i| checks.get(i)).map(slot_of)
}

/// An `in_flight` take (a request-time call naming its id).
fn is_take(c: &LimitCheck) -> bool {
    c.key.limit.algorithm == crate::config::Algorithm::InFlight
        && c.lease.as_ref().is_some_and(|l| !l.release)
}

/// Whether a slot's call names one counter twice. Its charges cannot be undone one by one:
/// each was decided on what the one before it left (a token bucket's recorded excess is clamped
/// after the charge before it), so the slot is decided dry and committed with the verdict.
fn names_a_key_twice(call: &Call) -> bool {
    let mut keys: Vec<&String> = call.keys.iter().collect();
    keys.sort_unstable();
    keys.windows(2).any(|w| w[0] == w[1])
}

/// Decides a request spanning slots exactly as one atomic call would. Every slot's call runs
/// concurrently: a slot is charged by its own verdict (quota-mode limits go as shadow, so a
/// slot never applies the quota rule alone), or decided dry when it holds a refund that waits
/// for the verdict. The request's verdict is then [`Admission`] over every limit, and what it
/// charges is [`charged`]'s rule over all of them. A slot charged beyond that (by its own,
/// kinder verdict) has exactly those charges undone; a dry slot is committed with the verdict.
async fn charge_or_undo(
    common: Arc<Common>,
    conn: Conn,
    checks: Vec<LimitCheck>,
    groups: Vec<Vec<usize>>,
) -> Result<Decision, StoreError> {
    let mut r = Spanning::first_pass(common, conn, checks, groups).await;
    #[cfg(any(test, feature = "test-util"))]
    if let Some(hook) = &r.common.before_commit {
        hook();
    }
    r.commit_dry().await;
    if !r.admitted {
        r.steps += take_back_leases(
            &r.common,
            &r.conn,
            &r.calls,
            &r.groups,
            &r.committed,
            &mut r.leases,
        )
        .await;
    }
    let stays = r.undo_excess().await;
    r.finish(stays)
}

/// The verdict on a request from its limits' outcomes (`failed`: a slot could not answer):
/// whether it is admitted, whether a recording limit is over under `stop_over`, and what
/// [`charged`] writes.
fn verdict(checks: &[LimitCheck], outcomes: &[Outcome], failed: bool) -> (bool, bool, Vec<bool>) {
    let mut admission = Admission::default();
    for (c, o) in checks.iter().zip(outcomes) {
        admission.add(c, o.allowed);
    }
    let allowed: Vec<bool> = outcomes.iter().map(|o| o.allowed).collect();
    let admitted = !failed && admission.admitted();
    let stopped = checks.iter().any(|c| c.stop_over)
        && checks.iter().zip(&allowed).any(|(c, &ok)| c.record && !ok);
    (admitted, stopped, charged(checks, &allowed, admitted))
}

/// A request spanning slots as its slots answer: the calls, what each slot said, the verdict so
/// far and what it charges. Each step is one method, in the order [`charge_or_undo`] runs them.
struct Spanning {
    common: Arc<Common>,
    conn: Conn,
    checks: Vec<LimitCheck>,
    groups: Vec<Vec<usize>>,
    calls: Vec<Call>,
    outcomes: Vec<Outcome>,
    leases: Vec<crate::store::LeaseEffect>,
    /// Each slot's decoded reply; `None`: it failed.
    slots: Vec<Option<SlotReply>>,
    /// Dry slots committed with the verdict.
    committed: Vec<bool>,
    first_error: Option<StoreError>,
    steps: usize,
    admitted: bool,
    stopped: bool,
    charge: Vec<bool>,
}

impl Spanning {
    /// Every slot's call, concurrently: charged by its own verdict, or dry.
    async fn first_pass(
        common: Arc<Common>,
        conn: Conn,
        checks: Vec<LimitCheck>,
        groups: Vec<Vec<usize>>,
    ) -> Self {
        let calls: Vec<Call> = groups
            .iter()
            .map(|g| {
                let call = common.call_for(&checks, g, false);
                if g.iter().any(|&i| waits_for_verdict(&checks[i])) || names_a_key_twice(&call) {
                    call.with_reply(Reply::Dry)
                } else {
                    call
                }
            })
            .collect();
        let now = common.time.arg();
        let results = futures_util::future::join_all(
            calls
                .iter()
                .map(|c| run(&common.script, conn.clone(), &now, c, common.timeout)),
        )
        .await;
        let (mut outcomes, mut leases) = (vec![DENIED; checks.len()], Vec::new());
        let mut slots: Vec<Option<SlotReply>> = Vec::with_capacity(groups.len());
        let mut first_error = None;
        for ((g, call), r) in groups.iter().zip(&calls).zip(&results) {
            common.record_health(group_slot(&checks, g), r);
            let decoded = r.as_ref().map_err(Clone::clone).and_then(|values| {
                let into = codec::Fold {
                    outcomes: &mut outcomes,
                    leases: &mut leases,
                };
                codec::decode_slot(values, call.layout(), g, into)
            });
            slots.push(decoded.map_err(|e| first_error.get_or_insert(e)).ok());
        }
        let (admitted, stopped, charge) = verdict(&checks, &outcomes, first_error.is_some());
        Self {
            steps: groups.len(),
            committed: vec![false; groups.len()],
            common,
            conn,
            checks,
            groups,
            calls,
            outcomes,
            leases,
            slots,
            first_error,
            admitted,
            stopped,
            charge,
        }
    }

    /// Dry slots: committed with the verdict, when it charges anything there. A slot that denies
    /// at its commit (a concurrent request changed it) or fails denies the request.
    async fn commit_dry(&mut self) {
        for n in 0..self.groups.len() {
            if self.calls[n].reply != Reply::Dry || self.slots[n].is_none() {
                continue;
            }
            // (A reservation or settle of 0 hits still changes what is held; an `in_flight`
            // take not charged is remembered as a denial of its id.)
            let writes = |c: &LimitCheck| c.hits > 0 || c.lease.is_some();
            let (checks, charge) = (&self.checks, &self.charge);
            if !self.groups[n]
                .iter()
                .any(|&i| (charge[i] && writes(&checks[i])) || (!charge[i] && is_take(&checks[i])))
            {
                continue;
            }
            let commit = self.calls[n].with_reply(Reply::Verdict {
                admitted: self.admitted,
                over: self.stopped,
            });
            self.steps += 1;
            let c = &self.common;
            let r = run(
                &c.script,
                self.conn.clone(),
                &c.time.arg(),
                &commit,
                c.timeout,
            )
            .await;
            let slot = group_slot(&self.checks, &self.groups[n]);
            self.common.record_health(slot, &r);
            let decoded = r.and_then(|v| {
                let into = codec::Fold {
                    outcomes: &mut self.outcomes,
                    leases: &mut self.leases,
                };
                codec::decode_slot(&v, commit.layout(), &self.groups[n], into)
            });
            match decoded {
                Ok(slot) => {
                    if self.admitted && !slot.admitted {
                        self.admitted = false;
                        self.charge = verdict(&self.checks, &self.outcomes, true).2;
                    }
                    self.slots[n] = Some(slot);
                    self.committed[n] = true;
                }
                Err(e) => {
                    self.first_error.get_or_insert(e);
                    self.admitted = false;
                    self.charge = verdict(&self.checks, &self.outcomes, true).2;
                    self.slots[n] = None;
                }
            }
        }
    }

    /// Charged slots: undoes what the request's rule does not charge. Returns, per check,
    /// whether its charge stays in the store (what could not be undone stays too).
    async fn undo_excess(&mut self) -> Vec<bool> {
        let mut stays = vec![false; self.checks.len()];
        let c = &self.common;
        for (n, g) in self.groups.iter().enumerate() {
            let Some(slot) = &self.slots[n] else { continue };
            if self.calls[n].reply == Reply::Dry && !self.committed[n] {
                continue;
            }
            let undo: Vec<bool> = g.iter().map(|&i| !self.charge[i]).collect();
            let call = codec::encode_undo(&self.calls[n], slot, &undo);
            if call.keys.is_empty() {
                for &i in g {
                    stays[i] = self.charge[i];
                }
                continue;
            }
            self.steps += 1;
            let undone = run_undo(&c.script, &self.conn, &c.time, &call, c.timeout).await;
            for (&i, &u) in g.iter().zip(&undo) {
                stays[i] = self.charge[i] || (u && undone.is_err());
            }
            if let Err(e) = undone {
                c.signals.undo_failures.add(1);
                tracing::warn!(error = %e, keys = call.keys.len(), "could not undo the charge of a request denied in another slot");
            }
        }
        stays
    }

    /// The decision, or the failure with what stays charged (review A3: whoever decides the
    /// request instead, FAILURE_MODE=local, must not charge those again).
    fn finish(mut self, stays: Vec<bool>) -> Result<Decision, StoreError> {
        if let Some(cause) = self.first_error {
            let mut failed = vec![false; self.checks.len()];
            for (g, slot) in self.groups.iter().zip(&self.slots) {
                for &i in g.iter().filter(|_| slot.is_none()) {
                    failed[i] = true;
                }
            }
            return Err(StoreError::Partial(Box::new(Partial {
                cause: cause.partial().map_or(cause.clone(), |p| p.cause.clone()),
                charged: stays,
                failed,
            })));
        }
        // As one atomic call reports (memory, the script): when every limit that changed its
        // counter is charged, each limit reports what it saw; otherwise a limit not charged
        // reports its counter as the request found it.
        let exact = self
            .checks
            .iter()
            .zip(&self.outcomes)
            .zip(&self.charge)
            .all(|((c, o), &w)| {
                w || (c.hits == 0 && c.lease.is_none()) || !(o.allowed || c.record)
            });
        for (g, slot) in self.groups.iter().zip(&self.slots).filter(|_| !exact) {
            let Some(slot) = slot else { continue };
            for (&i, &before) in g.iter().zip(&slot.before) {
                if !self.charge[i] {
                    self.outcomes[i].remaining = before;
                }
            }
        }
        Ok(Decision {
            at: crate::store::DecidedAt::Unknown,
            admitted: self.admitted,
            outcomes: self.outcomes,
            local: false,
            steps: self.steps,
            beside_lost: false,
            beside_apart: false,
            leases: self.leases,
        })
    }
}

/// Review A10: a dry slot committed while the request was still admitted may have taken an
/// `in_flight` slot or made a reservation before a later slot's commit denied (or failed): those
/// changes carry no undo token, so they are taken back by what they did (the slot becomes a
/// remembered denial of its id, the reservation goes with its hits). Returns the calls made.
async fn take_back_leases(
    common: &Common,
    conn: &Conn,
    calls: &[Call],
    groups: &[Vec<usize>],
    committed: &[bool],
    leases: &mut [crate::store::LeaseEffect],
) -> usize {
    use crate::store::lease_effect::LeaseChange;
    let mut steps = 0;
    for (n, g) in groups.iter().enumerate() {
        if !committed[n] {
            continue;
        }
        let added: Vec<bool> = g
            .iter()
            .map(|&i| {
                leases
                    .get(i)
                    .is_some_and(|l| matches!(l.change, LeaseChange::Added { .. }))
            })
            .collect();
        let call = encode_unlease(&calls[n], &added);
        if call.keys.is_empty() {
            continue;
        }
        steps += 1;
        let mut last = None;
        for _ in 0..UNDO_ATTEMPTS {
            match run(
                &common.script,
                conn.clone(),
                &common.time.arg(),
                &call,
                common.timeout,
            )
            .await
            {
                Ok(_) => {
                    last = None;
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        if let Some(e) = last {
            common.signals.undo_failures.add(1);
            tracing::warn!(error = %e, keys = call.keys.len(), "could not take back the lease changes of a request denied in another slot");
            continue;
        }
        // Nothing stays added: the lease metrics book no entry for a denied request.
        for (&i, &a) in g.iter().zip(&added) {
            if let Some(l) = leases.get_mut(i).filter(|_| a) {
                l.change = LeaseChange::None;
            }
        }
    }
    steps
}

/// The call that takes back the lease changes (a slot taken, a reservation made) that the
/// limits of `call` selected by `take_back` committed, for a request another slot then denied
/// (review A10): decide.lua's "u" mode, in the lease layout.
fn encode_unlease(call: &Call, take_back: &[bool]) -> Call {
    let mut out = Call {
        keys: Vec::new(),
        args: Vec::new(),
        reply: Reply::Unlease,
        plain: false,
        counting: 0,
        lease: Vec::new(),
    };
    for (n, (key, args)) in call
        .keys
        .iter()
        .zip(call.args.chunks(call.per_key()))
        .enumerate()
    {
        let Some(lease) = call.lease.get(n) else {
            continue;
        };
        if !take_back.get(n).copied().unwrap_or(false) || !matches!(lease.op, 1 | 4) {
            continue;
        }
        out.keys.push(key.clone());
        out.args.extend_from_slice(args);
        out.lease.push(lease.clone());
    }
    out
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
