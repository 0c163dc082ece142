//! The Redis store, standalone or Cluster, deciding with `decide.lua` atomically on the Redis
//! server clock. Standalone: every limit of a request in ONE `EVALSHA`, concurrent requests
//! batched into one call (plain ones in the packed layout, `packed.rs`). Cluster: one call per
//! slot, concurrent; if one slot denies, what the others charged is undone exactly, so a rejected
//! request never burns quota. Errors are classified transient/permanent here, where they are
//! converted.

mod batch;
mod cluster;
mod codec;
mod conn;
pub mod keys;
mod sentinel;
mod settings;

use batch::{batcher, run, single_connection, Job, BATCH_QUEUE};
use cluster::charge_or_undo;
use codec::Call;
use conn::{sentinels, Backend, Conn, ConnectErrors, Manager, Target};
use settings::{is_tls, tls_client};
pub use settings::{
    redact_url, RedisKind, RedisSettings, RedisTlsSettings, SentinelSettings, DEFAULT_POOL_SIZE,
    DEFAULT_TIMEOUT,
};

use super::{
    BoxFuture, CallShape, CounterKey, CounterStore, Decision, LimitCheck, Outcome, StoreError,
};
#[cfg(any(test, feature = "test-util"))]
use crate::clock::Clock;
use redis::cluster::ClusterClient;
use redis::{ErrorKind, RedisError, Script, ServerErrorKind};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The decision script; KEYS/ARGV are documented at its top.
pub const DECIDE_LUA: &str = include_str!("decide.lua");

/// `decide.lua` with its TTL jitter set (the script's `JITTER_MS` line).
fn decide_script(jitter: Duration) -> String {
    let ms = u64::try_from(jitter.as_millis()).unwrap_or(u64::MAX);
    let script = DECIDE_LUA.replacen(
        "local JITTER_MS = 0\n",
        &format!("local JITTER_MS = {ms}\n"),
        1,
    );
    // Outside `test-util` builds the script has no time override: it always decides on the
    // server's clock, whatever ARGV[1] holds.
    #[cfg(not(any(test, feature = "test-util")))]
    let script = script.replacen(TIME_OVERRIDE_LUA, "", 1);
    script
}

/// decide.lua's test-only time override (ARGV[1]), one line so builds without `test-util` can
/// drop it.
#[cfg_attr(any(test, feature = "test-util"), allow(dead_code))]
const TIME_OVERRIDE_LUA: &str =
    "if ARGV[1] ~= '' then now = tonumber(ARGV[1]); slack = 3600000 end -- test-util\n";

/// Counters in Redis or Redis Cluster.
pub struct RedisStore {
    backend: Backend,
    script: Script,
    prefix: String,
    timeout: Duration,
    kind: RedisKind,
    /// Tests only: decide on this clock instead of the Redis server clock.
    time: ScriptTime,
    healthy: Mutex<bool>,
    /// Cluster undos that failed after retries (a metric).
    undo_failures: Arc<AtomicU64>,
    /// Standalone: the queue of the batcher task (see [`batcher`]).
    batcher: std::sync::OnceLock<tokio::sync::mpsc::Sender<Job>>,
    /// Standalone: script calls the batcher keeps outstanding (`REDIS_POOL_SIZE`).
    in_flight: usize,
    /// The runtime the store was built on. The batcher and Cluster's charge-or-undo tasks run
    /// there rather than on the caller's serving thread: that runtime outlives every serving
    /// thread, so a drain never cancels an undo, and the one batcher serves all threads.
    runtime: tokio::runtime::Handle,
}

/// A standalone Redis (direct, or the master Sentinel names) behind a bb8 pool.
fn single_backend(
    settings: &RedisSettings,
    infos: Vec<redis::ConnectionInfo>,
    certs: Option<redis::TlsCertificates>,
) -> Result<Backend, StoreError> {
    let target = if settings.kind == RedisKind::Sentinel {
        Target::Sentinel(sentinels(settings, infos, certs)?)
    } else {
        let [info] = <[_; 1]>::try_from(infos).map_err(|v: Vec<_>| {
            StoreError::Permanent(format!(
                "REDIS_TYPE=single takes one Redis URL, got {}; set REDIS_TYPE=cluster for a seed list",
                v.len()
            ))
        })?;
        let client = match &certs {
            Some(certs) if is_tls(&info) => {
                tls_client(info, certs, settings.tls.skip_hostname_verification)
            }
            _ => redis::Client::open(info),
        }
        .map_err(|e| StoreError::Permanent(format!("Redis client: {e}")))?;
        Target::Direct(client)
    };
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(settings.timeout))
        .set_response_timeout(Some(settings.timeout));
    let errors = ConnectErrors::default();
    let pool = bb8::Pool::builder()
        .max_size(settings.pool_size.max(1))
        .min_idle(Some(settings.pool_size.max(1)))
        .connection_timeout(settings.timeout)
        // `is_valid` only reads the broken flag, so this costs no round trip.
        .test_on_check_out(true)
        // A refused connection fails the call at once instead of retrying until the
        // timeout: the breaker and the health probe handle recovery.
        .retry_connection(false)
        .error_sink(Box::new(errors.clone()))
        .build_unchecked(Manager {
            target,
            epoch: Arc::default(),
            config,
            errors,
        });
    Ok(Backend::Single(pool))
}

/// A Redis Cluster through the `redis` crate's async cluster client, seeded by `infos`.
fn cluster_backend(
    settings: &RedisSettings,
    infos: Vec<redis::ConnectionInfo>,
    certs: Option<redis::TlsCertificates>,
) -> Result<Backend, StoreError> {
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
    Ok(Backend::Cluster {
        client,
        conn: Mutex::new(None),
    })
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("kind", &self.kind)
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Builds the store without touching the network: connections are made on first use, so
    /// an unreachable Redis at start-up is a health state, not a crash loop. Fails only on
    /// settings that can never work (bad URL, bad prefix).
    pub fn new(settings: &RedisSettings) -> Result<Self, StoreError> {
        keys::validate_prefix(&settings.key_prefix).map_err(StoreError::Permanent)?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| {
            StoreError::Permanent(format!("the Redis store needs a Tokio runtime: {e}"))
        })?;
        // The sentinels take their own password; REDIS_AUTH is the master's.
        let auth = match (settings.kind, &settings.sentinel) {
            (RedisKind::Sentinel, Some(s)) => s.auth.as_deref(),
            _ => settings.auth.as_deref(),
        };
        let infos = settings.connection_infos(auth)?;
        let tls = infos.iter().any(is_tls);
        let certs = if tls {
            // redis asks rustls for the process-wide provider; make sure it is ring (the only
            // one compiled in) even if some other crate in the process enabled another.
            let _ = rustls::crypto::ring::default_provider().install_default();
            Some(settings.tls.certificates()?)
        } else {
            None
        };
        let backend = match settings.kind {
            RedisKind::Single | RedisKind::Sentinel => single_backend(settings, infos, certs)?,
            RedisKind::Cluster => cluster_backend(settings, infos, certs)?,
        };
        Ok(Self {
            backend,
            script: Script::new(&decide_script(settings.expiration_jitter)),
            prefix: settings.key_prefix.clone(),
            timeout: settings.timeout,
            kind: settings.kind,
            time: ScriptTime::default(),
            healthy: Mutex::new(true),
            undo_failures: Arc::default(),
            batcher: std::sync::OnceLock::new(),
            in_flight: settings.pool_size.max(1) as usize,
            runtime,
        })
    }

    /// Tests only (`test-util`): decide on `clock` (passed to the script) instead of Redis
    /// `TIME`, so window logic can be driven without sleeping.
    #[cfg(any(test, feature = "test-util"))]
    pub fn with_test_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.time = ScriptTime { clock: Some(clock) };
        self
    }

    /// The Redis key of a counter (for tests and operators inspecting Redis).
    pub fn key_of(&self, key: &CounterKey) -> String {
        keys::counter_key(&self.prefix, key)
    }

    fn set_healthy(&self, ok: bool) {
        if let Ok(mut h) = self.healthy.lock() {
            if *h != ok {
                if ok {
                    tracing::info!(kind = ?self.kind, "Redis store reachable again");
                } else {
                    tracing::warn!(kind = ?self.kind, "Redis store unreachable");
                }
            }
            *h = ok;
        }
    }

    /// The script call deciding `idx` of `checks` (see [`codec::encode`]).
    fn call_for(&self, checks: &[LimitCheck], idx: &[usize], whole: bool) -> Call {
        codec::encode(checks, idx, whole, |k| self.key_of(k))
    }

    fn now_arg(&self) -> String {
        self.time.arg()
    }

    fn record_health<T>(&self, r: &Result<T, StoreError>) {
        match r {
            Ok(_) => self.set_healthy(true),
            Err(StoreError::Transient(_)) => self.set_healthy(false),
            Err(StoreError::Permanent(_)) => {}
        }
    }

    /// The atomic steps of a request, as indexes into `checks`. Standalone Redis holds every key,
    /// so the whole request is ONE script call, exact, whatever the hash tags. Cluster needs one
    /// call per slot (a script may only touch keys of one slot); keys of different tags that
    /// happen to share a slot still go together.
    fn groups(&self, checks: &[LimitCheck]) -> Vec<Vec<usize>> {
        if self.kind != RedisKind::Cluster || checks.len() <= 1 {
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

    /// Standalone: the request goes to the batcher (started on first use, inside the runtime).
    async fn decide_batched(
        &self,
        pool: &bb8::Pool<Manager>,
        checks: &[LimitCheck],
        all: &[usize],
    ) -> Result<Decision, StoreError> {
        let tx = self.batcher.get_or_init(|| {
            let (tx, rx) = tokio::sync::mpsc::channel(BATCH_QUEUE);
            self.runtime.spawn(batcher(
                rx,
                pool.clone(),
                self.script.clone(),
                self.time.clone(),
                self.timeout,
                self.in_flight,
            ));
            tx
        });
        let (reply, answer) = tokio::sync::oneshot::channel();
        let call = self.call_for(checks, all, true);
        let r = async {
            tx.send(Job { call, reply })
                .await
                .map_err(|_| StoreError::Permanent("the Redis batcher stopped".into()))?;
            answer
                .await
                .map_err(|_| StoreError::Permanent("the Redis batcher dropped a call".into()))?
        };
        let r = match tokio::time::timeout(self.timeout, r).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Transient(format!(
                "Redis did not answer within {:?}",
                self.timeout
            ))),
        };
        self.record_health(&r);
        let mut outcomes = vec![DENIED; checks.len()];
        let admitted = codec::decode(&r?, all, false, &mut outcomes)?;
        Ok(Decision {
            admitted,
            outcomes,
            local: false,
        })
    }

    async fn decide_all(&self, checks: &[LimitCheck]) -> Result<Decision, StoreError> {
        let groups = self.groups(checks);
        if let (Backend::Single(pool), [all]) = (&self.backend, groups.as_slice()) {
            return self.decide_batched(pool, checks, all).await;
        }
        let conn = self.connection().await;
        self.record_health(&conn);
        let conn = conn?;
        if let [only] = groups.as_slice() {
            // One call decides everything: all or nothing inside the script, nothing to undo.
            let call = self.call_for(checks, only, true);
            let r = run(&self.script, conn, &self.now_arg(), &call, self.timeout).await;
            self.record_health(&r);
            let mut outcomes = vec![DENIED; checks.len()];
            let admitted = codec::decode(&r?, only, false, &mut outcomes)?;
            return Ok(Decision {
                admitted,
                outcomes,
                local: false,
            });
        }
        // Cluster, several slots. A refund (all or nothing) applies only if the request is
        // admitted, and one applied in a slot could not be taken back exactly when another slot
        // denies: so refunds wait for the verdict.
        if checks.iter().any(|c| c.refund && !c.record && c.hits > 0) {
            return self.refunds_after_the_verdict(checks).await;
        }
        // The charges and, if one slot denies, the undo of the others run on their own task, so
        // a caller that gives up (Envoy's deadline) cannot leave a charge without its undo.
        let calls: Vec<Call> = groups
            .iter()
            .map(|g| Call {
                tokens: true,
                ..self.call_for(checks, g, false)
            })
            .collect();
        // Which limits of each call are quota-mode (sent as shadow): the rule is applied here.
        // As `Admission`: a shadow limit or a refund never takes part in the quota rule.
        let in_quota_rule = |c: &LimitCheck| c.quota && !c.shadow && !c.refund;
        let quota: Vec<Vec<bool>> = if checks.iter().any(in_quota_rule) {
            groups
                .iter()
                .map(|g| g.iter().map(|&i| in_quota_rule(&checks[i])).collect())
                .collect()
        } else {
            Vec::new()
        };
        let task = self.runtime.spawn(charge_or_undo(
            self.script.clone(),
            conn,
            self.time.clone(),
            calls,
            quota,
            self.timeout,
            self.undo_failures.clone(),
        ));
        let (results, undone, admitted) = task
            .await
            .map_err(|e| StoreError::Permanent(format!("decision task failed: {e}")))?;
        let mut outcomes = vec![DENIED; checks.len()];
        let mut first_error = None;
        for (g, r) in groups.iter().zip(results) {
            self.record_health(&r);
            if let Err(e) = r.and_then(|values| codec::decode(&values, g, true, &mut outcomes)) {
                first_error.get_or_insert(e);
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        give_back(checks, &groups, &undone, &mut outcomes);
        Ok(Decision {
            admitted,
            outcomes,
            local: false,
        })
    }

    /// A Cluster request spanning slots with all-or-nothing refunds: decided first with each
    /// refund as a shadow check (it reads its counter and never denies), then, if admitted, the
    /// refunds are applied (a refund always admits). Two round trips, only for such requests.
    async fn refunds_after_the_verdict(
        &self,
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
        let mut decision = Box::pin(self.decide_all(&first)).await?;
        let idx: Vec<usize> = (0..checks.len()).filter(|&i| late(&checks[i])).collect();
        for &i in &idx {
            // As a refund reports itself: allowed, nothing to wait for.
            decision.outcomes[i].allowed = true;
            decision.outcomes[i].retry_after = Duration::ZERO;
        }
        if decision.admitted {
            let refunds: Vec<LimitCheck> = idx.iter().map(|&i| checks[i].clone()).collect();
            let applied = Box::pin(self.decide_all(&refunds)).await?;
            for (k, &i) in idx.iter().enumerate() {
                decision.outcomes[i] = applied.outcomes[k];
            }
        }
        Ok(decision)
    }

    /// A handle on a live connection: a clone of a pooled multiplexed connection (checked out
    /// only for the clone), or the shared Cluster connection, connected on first use.
    async fn connection(&self) -> Result<Conn, StoreError> {
        match &self.backend {
            Backend::Single(pool) => single_connection(pool).await,
            Backend::Cluster { client, conn } => {
                if let Some(c) = conn.lock().ok().and_then(|g| g.clone()) {
                    return Ok(Conn::Cluster(c));
                }
                // Two first calls may both connect; the later one's connection is kept.
                let c = client.get_async_connection().await.map_err(classify)?;
                if let Ok(mut g) = conn.lock() {
                    *g = Some(c.clone());
                }
                Ok(Conn::Cluster(c))
            }
        }
    }

    /// One PING round trip: health checks and circuit-breaker probes.
    pub async fn ping(&self) -> bool {
        let call = async {
            let mut conn = self.connection().await?;
            conn.query(async |c| redis::cmd("PING").query_async::<()>(c).await)
                .await
        };
        let ok = matches!(tokio::time::timeout(self.timeout, call).await, Ok(Ok(())));
        self.set_healthy(ok);
        ok
    }
}

/// Attempts at an undo before it is counted as failed.
const UNDO_ATTEMPTS: usize = 3;

const DENIED: Outcome = Outcome {
    allowed: false,
    remaining: 0,
    reset: Duration::ZERO,
    retry_after: Duration::ZERO,
};

/// The time the script decides on: Redis `TIME`, always, outside `test-util` builds; a test's
/// manual clock with it.
#[derive(Debug, Clone, Default)]
struct ScriptTime {
    #[cfg(any(test, feature = "test-util"))]
    clock: Option<Arc<dyn Clock>>,
}

impl ScriptTime {
    /// ARGV[1]: "" (the script reads Redis `TIME`), or the test clock's time.
    fn arg(&self) -> String {
        #[cfg(any(test, feature = "test-util"))]
        if let Some(c) = &self.clock {
            return c.now().as_micros().to_string();
        }
        String::new()
    }
}

impl CounterStore for RedisStore {
    fn decide<'a>(
        &'a self,
        checks: &'a [LimitCheck],
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        Box::pin(self.decide_all(checks))
    }

    fn healthy(&self) -> bool {
        self.healthy.lock().map(|h| *h).unwrap_or(false)
    }

    fn probe(&self) -> BoxFuture<'_, bool> {
        Box::pin(self.ping())
    }

    fn denial_is_final(&self, key: &CounterKey) -> bool {
        // Standalone decides every request in one call: no charge is ever temporary. On
        // Cluster, only a domain in one slot has no request that spans slots.
        self.kind != RedisKind::Cluster || key.domain_tag
    }

    fn stats(&self) -> super::StoreStats {
        super::StoreStats {
            undo_failures: self.undo_failures.load(Ordering::Relaxed),
            ..Default::default()
        }
    }

    fn call_shape(&self, checks: &[LimitCheck]) -> CallShape {
        let (store, groups) = match self.backend {
            // Standalone: one call whatever the keys (no grouping to compute).
            Backend::Single(_) => ("redis", usize::from(!checks.is_empty())),
            Backend::Cluster { .. } => ("redis-cluster", self.groups(checks).len()),
        };
        CallShape {
            store,
            groups,
            keys: checks.len(),
        }
    }
}

/// A failure of the connection itself (not an error reply): the connection must be replaced.
fn is_transport(e: &RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal()
}

/// Transient: Redis is down, slow, failing over or loading: retrying later can succeed.
/// Permanent: an error reply that will repeat (script error, auth, ACL), so a request cannot be
/// decided until an operator acts.
fn classify(e: RedisError) -> StoreError {
    let transient = is_transport(&e)
        || e.is_cluster_error()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::BusyLoading
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::ReadOnly
            )
        );
    if transient {
        StoreError::Transient(format!("Redis: {e}"))
    } else {
        StoreError::Permanent(format!("Redis: {e}"))
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_time_override_is_one_line_a_release_build_removes() {
        assert_eq!(DECIDE_LUA.matches(TIME_OVERRIDE_LUA).count(), 1);
        let without = DECIDE_LUA.replacen(TIME_OVERRIDE_LUA, "", 1);
        let reads = without
            .lines()
            .filter(|l| !l.trim_start().starts_with("--"))
            .filter(|l| l.contains("ARGV[1]"))
            .count();
        assert_eq!(reads, 0, "no other line reads the override");
        assert!(without.contains("redis.call('TIME')"));
    }
}
