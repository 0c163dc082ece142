//! The Redis store, standalone or Cluster, deciding with `decide.lua` atomically on the Redis
//! server clock. Two backends behind one [`RedisStore`]: standalone (`standalone.rs`: every
//! limit of a request in ONE `EVALSHA`, concurrent requests batched into one call; Sentinel is
//! the same backend behind another connector) and Cluster (`cluster.rs`: one call per slot,
//! concurrent, with the exact undo of what the other slots charged when the request is not
//! admitted). `codec.rs` is the only file that knows the script's argument and reply layout.
//! Errors are classified transient/permanent here, where they are converted.

mod admin;
mod batch;
mod beside;
mod board;
mod cluster;
mod codec;
mod conn;
mod fair;
mod health;
pub mod keys;
mod lease_arg;
mod members;
mod meta;
mod pool;
mod regions;
mod reply;
mod sentinel;
mod settings;
mod standalone;

pub use admin::RedisAdmin;
pub use board::{board_key, RedisBoard};
use cluster::Cluster;
use codec::{decide_script, Call, ScriptTime};
use conn::Conn;
pub use members::RedisMembers;
pub use pool::{pool_key, RedisPool};
pub use regions::{regions_key, short_key, RedisRegions};
use settings::is_tls;
pub use settings::{
    redact_url, RedisKind, RedisSettings, RedisTlsSettings, SentinelSettings, DEFAULT_POOL_SIZE,
    DEFAULT_TIMEOUT,
};
use standalone::Standalone;

use super::{
    BoxFuture, CounterKey, CounterStore, Decision, LimitCheck, Outcome, StoreError, StoreSignals,
};
#[cfg(any(test, feature = "test-util"))]
use crate::clock::Clock;
use redis::{ErrorKind, RedisError, Script, ServerErrorKind};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Counters in Redis: the backend for the settings' kind, and what both backends share.
pub struct RedisStore {
    common: Arc<Common>,
    backend: Backend,
}

enum Backend {
    Standalone(Standalone),
    Cluster(Arc<Cluster>),
}

/// What both backends need to call the script and report.
#[derive(Clone)]
struct Common {
    script: Arc<Script>,
    prefix: String,
    /// Bound on a decision's script call (`REDIS_TIMEOUT`, or longer under
    /// `FAILURE_MODE=local`, see [`RedisStore::patient`]).
    timeout: Duration,
    /// Bound on a probe, a demand board's or a heartbeat's call: always `REDIS_TIMEOUT`.
    quick: Duration,
    /// Tests only: decide on this clock instead of the Redis server clock.
    time: ScriptTime,
    /// Health and the undo-failure total go here (see [`RedisStore::reporting_to`]).
    signals: StoreSignals,
    /// What the calls' answers say of the store's health (per slot on a Cluster).
    health: Arc<health::Health>,
    /// The runtime the store was built on. The batcher and Cluster's charge-or-undo tasks run
    /// there rather than on the caller's serving thread: that runtime outlives every serving
    /// thread, so a drain never cancels an undo, and the one batcher serves all threads.
    runtime: tokio::runtime::Handle,
    /// Tests only: runs on a Cluster request spanning slots between its slots' first calls and
    /// their commits (where another request can change a slot).
    #[cfg(any(test, feature = "test-util"))]
    before_commit: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl Common {
    /// The script call deciding `idx` of `checks` (see [`codec::encode`]).
    fn call_for(&self, checks: &[LimitCheck], idx: &[usize], whole: bool) -> Call {
        codec::encode(checks, idx, whole, |k| keys::counter_key(&self.prefix, k))
    }

    /// Takes a call's answer into the store's health: `slot` is the Cluster slot it went to
    /// (`None`: none in particular, such as a connection or a PING).
    fn record_health<T>(&self, slot: Option<u16>, r: &Result<T, StoreError>) {
        self.health.record(slot, r, |ok| self.set_healthy(ok));
    }

    fn set_healthy(&self, ok: bool) {
        if self.signals.set_health(ok) {
            if ok {
                tracing::info!(store = self.signals.backend, "Redis store reachable again");
            } else {
                tracing::warn!(store = self.signals.backend, "Redis store unreachable");
            }
        }
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.backend {
            Backend::Standalone(_) => "standalone",
            Backend::Cluster(_) => "cluster",
        };
        f.debug_struct("RedisStore")
            .field("backend", &kind)
            .field("prefix", &self.common.prefix)
            .field("timeout", &self.common.timeout)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Builds the store without touching the network: connections are made on first use, so
    /// an unreachable Redis at start-up is a health state, not a crash loop. Fails only on
    /// settings that can never work (bad URL, bad prefix).
    pub fn new(settings: &RedisSettings) -> Result<Self, StoreError> {
        Self::with_connect_timeout(settings, settings.timeout)
    }

    /// [`RedisStore::new`] whose Cluster client connects within `connect` whatever its calls'
    /// timeout: the client's slot refresh repairs connections while it holds the lock every
    /// call waits on (redis 1.8 `refresh_slots`), so a hung master must cost the others at
    /// most `connect` there.
    fn with_connect_timeout(
        settings: &RedisSettings,
        connect: Duration,
    ) -> Result<Self, StoreError> {
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
            RedisKind::Single | RedisKind::Sentinel => {
                Backend::Standalone(Standalone::new(settings, infos, certs)?)
            }
            RedisKind::Cluster => {
                Backend::Cluster(Arc::new(Cluster::new(settings, infos, certs, connect)?))
            }
        };
        Ok(Self {
            common: Arc::new(Common {
                script: Arc::new(Script::new(&decide_script(settings.expiration_jitter))),
                prefix: settings.key_prefix.clone(),
                timeout: settings.timeout,
                quick: settings.timeout,
                time: ScriptTime::default(),
                signals: StoreSignals::new(settings.kind.backend_name()),
                health: Arc::new(health::Health::new(settings.kind == RedisKind::Cluster)),
                runtime,
                #[cfg(any(test, feature = "test-util"))]
                before_commit: None,
            }),
            backend,
        })
    }

    /// The store for `FAILURE_MODE=local`: a decision's script call waits up to `patience`
    /// (its caller was already answered locally at its deadline, and only the call's real
    /// answer says whether Redis charged it, so the write-back neither misses nor doubles it),
    /// while probes, boards and heartbeats keep `REDIS_TIMEOUT`.
    pub fn patient(settings: &RedisSettings, patience: Duration) -> Result<Self, StoreError> {
        let mut long = settings.clone();
        long.timeout = patience.max(settings.timeout);
        let mut store = Self::with_connect_timeout(&long, settings.timeout)?;
        Arc::make_mut(&mut store.common).quick = settings.timeout;
        Ok(store)
    }

    /// Replica heartbeats in the same Redis (how many sluice replicas share it).
    pub fn members(&self) -> RedisMembers {
        RedisMembers {
            board: self.board(),
        }
    }

    /// Reports health and undo failures on `signals` (for readiness and `/metrics`).
    pub fn reporting_to(mut self, signals: &StoreSignals) -> Self {
        Arc::make_mut(&mut self.common).signals = signals.clone();
        self
    }

    /// The store alone as a stack, reporting to its own signals (named after its kind).
    pub fn into_stack(self) -> super::StoreStack {
        let signals = self.common.signals.clone();
        let board = Arc::new(self.board());
        let admin = Arc::new(self.admin());
        super::StoreStack::new(Arc::new(self), signals)
            .with_board(board)
            .with_admin(admin)
    }

    /// Resets and overrides in the same Redis, on the same connections.
    pub fn admin(&self) -> RedisAdmin {
        let board = self.board();
        RedisAdmin {
            common: board.common,
            source: board.source,
        }
    }

    /// The demand boards of the quota service in the same Redis, on the same connections.
    pub fn board(&self) -> RedisBoard {
        let source = match &self.backend {
            Backend::Standalone(s) => board::Source::Pool(s.pool()),
            Backend::Cluster(c) => board::Source::Cluster(Arc::clone(c)),
        };
        RedisBoard {
            common: Arc::clone(&self.common),
            source,
        }
    }

    /// The pools of global limits in this Redis (the region's), on the same connections.
    pub fn pool(&self) -> RedisPool {
        RedisPool {
            board: self.board(),
            stamp: crate::store::global::Stamp::default(),
        }
    }

    /// Where the regions report their pools of global limits, when this Redis is their home.
    pub fn regions(&self) -> RedisRegions {
        RedisRegions {
            board: self.board(),
        }
    }

    /// Tests only (`test-util`): decide on `clock` (passed to the script) instead of Redis
    /// `TIME`, so window logic can be driven without sleeping.
    #[cfg(any(test, feature = "test-util"))]
    pub fn with_test_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        Arc::make_mut(&mut self.common).time = ScriptTime { clock: Some(clock) };
        self
    }

    /// Tests only (`test-util`): `hook` runs on every Cluster request spanning slots after its
    /// slots' first calls and before their commits, so a test can change a slot in between.
    #[cfg(any(test, feature = "test-util"))]
    pub fn with_commit_hook(mut self, hook: Arc<dyn Fn() + Send + Sync>) -> Self {
        Arc::make_mut(&mut self.common).before_commit = Some(hook);
        self
    }

    /// The Redis key of a counter (for tests and operators inspecting Redis).
    pub fn key_of(&self, key: &CounterKey) -> String {
        keys::counter_key(&self.common.prefix, key)
    }

    /// One PING round trip: health checks and circuit-breaker probes.
    pub async fn ping(&self) -> bool {
        let call = async {
            let mut conn: Conn = match &self.backend {
                Backend::Standalone(s) => s.connection().await?,
                Backend::Cluster(c) => c.connection().await?,
            };
            conn.query(async |c| redis::cmd("PING").query_async::<()>(c).await)
                .await
        };
        // Any failure of a PING, an error reply too, is the store's.
        let r = match tokio::time::timeout(self.common.quick, call).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(StoreError::Transient(e.to_string())),
            Err(_) => Err(StoreError::Transient("PING: no answer in time".into())),
        };
        self.common.record_health(None, &r);
        r.is_ok()
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

impl CounterStore for RedisStore {
    fn decide<'a>(
        &'a self,
        checks: &'a [LimitCheck],
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        Box::pin(async move {
            match &self.backend {
                Backend::Standalone(s) => s.decide(&self.common, checks).await,
                Backend::Cluster(c) => c.decide(&self.common, checks).await,
            }
        })
    }

    fn probe(&self) -> BoxFuture<'_, bool> {
        Box::pin(self.ping())
    }

    fn refund_fenced<'a>(
        &'a self,
        check: &'a LimitCheck,
        cleared: u64,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let prefix = &self.common.prefix;
            let call = codec::encode_fenced(check, cleared, |k| keys::counter_key(prefix, k));
            let values = self.call_alone(&call, &check.key).await?;
            Ok(!codec::already_applied(&values))
        })
    }

    fn grant_fair<'a>(
        &'a self,
        check: &'a LimitCheck,
        ask: &'a crate::store::global::FairAsk,
    ) -> BoxFuture<'a, Result<Option<crate::store::global::FairGrant>, StoreError>> {
        Box::pin(async move {
            let prefix = &self.common.prefix;
            let window_ms = check.window.map_or(0, |(start, _)| start / 1000);
            let regions = regions_key(prefix, &check.key, window_ms);
            let call = fair::encode(check, ask, regions, |k| keys::counter_key(prefix, k));
            let values = self.call_alone(&call, &check.key).await?;
            fair::decode_reply(&values, &call).map(Some)
        })
    }
}

impl RedisStore {
    /// One script call of its own (not batched with requests), on the connection of `key`'s
    /// slot; its outcome goes to the store's health signal.
    async fn call_alone(
        &self,
        call: &codec::Call,
        key: &CounterKey,
    ) -> Result<Vec<i64>, StoreError> {
        let run = async {
            let mut conn = match &self.backend {
                Backend::Standalone(s) => s.connection().await?,
                Backend::Cluster(c) => c.connection().await?,
            };
            let calls = [call];
            let batch = codec::Batch::General(&calls);
            let inv = batch.invocation(&self.common.script, &self.common.time.arg());
            batch::invoke(&mut conn, &inv, self.common.timeout).await
        };
        let r = run.await;
        let slot = keys::tag_slot(&keys::hash_tag(key));
        self.common.record_health(Some(slot), &r);
        r
    }
}

impl super::WriteBack for RedisStore {
    fn write_back<'a>(
        &'a self,
        checks: &'a [LimitCheck],
        token: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let Some(first) = checks.first() else {
                return Ok(());
            };
            let prefix = &self.common.prefix;
            // The guard shares the first counter's hash tag, hence its slot.
            let mut guard = keys::counter_key(prefix, &first.key);
            guard.push_str("#wb:");
            keys::escape_into(&mut guard, token);
            let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
            let call =
                codec::encode_guarded(checks, guard, ttl_ms, |k| keys::counter_key(prefix, k));
            // Either the limits' answers or {-1} (applied before): both mean it is recorded.
            let values = self.call_alone(&call, &first.key).await?;
            if codec::already_applied(&values) {
                tracing::debug!(token, "write-back already applied");
            }
            Ok(())
        })
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
