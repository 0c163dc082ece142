//! The Redis store, standalone or Cluster, deciding with `decide.lua` atomically on the Redis
//! server clock. Standalone: every limit of a request in ONE `EVALSHA`, concurrent requests
//! batched into one call (plain ones in the packed layout, `packed.rs`). Cluster: one call per
//! slot, concurrent; if one slot denies, what the others charged is undone exactly, so a rejected
//! request never burns quota. Errors are classified transient/permanent here, where they are
//! converted.

pub mod keys;
mod packed;
mod sentinel;

use super::{
    BoxFuture, CallShape, CounterKey, CounterStore, Decision, LimitCheck, Outcome, StoreError,
};
#[cfg(any(test, feature = "test-util"))]
use crate::clock::Clock;
use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{ErrorKind, RedisError, Script, ServerErrorKind};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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

/// Default bound on one Redis round trip (`REDIS_TIMEOUT`). Envoy gives up on the rate-limit call
/// after 20 ms by default and sluice stops waiting at the caller's deadline anyway, so this only
/// bounds callers that send none (and connecting): five Envoy timeouts, far above a healthy
/// Redis's latency (well under a millisecond) and short enough that a stuck Redis is noticed,
/// and the breaker opened, within a few hundred milliseconds.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(100);
/// Multiplexed connections to a standalone Redis (`REDIS_POOL_SIZE`), and script calls kept
/// outstanding on them. Not a cap on concurrent decisions: while a call runs, the next ones
/// queue and go together in the next call, so fewer outstanding calls mean bigger batches and
/// less Redis CPU per decision. One measured best on a 2-core pod (README "Performance").
pub const DEFAULT_POOL_SIZE: u32 = 1;

/// Standalone or Cluster (`REDIS_TYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisKind {
    Single,
    Cluster,
    /// A master found through Redis Sentinel; otherwise decided as on standalone Redis.
    Sentinel,
}

/// `REDIS_TYPE=sentinel`: the monitored master's name (the first item of envoyproxy's
/// `REDIS_URL`) and `REDIS_SENTINEL_AUTH`, the sentinels' own password (`REDIS_AUTH` stays the
/// master's). `Debug` never prints the password.
#[derive(Clone)]
pub struct SentinelSettings {
    pub master_name: String,
    pub auth: Option<String>,
}

impl fmt::Debug for SentinelSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SentinelSettings")
            .field("master_name", &self.master_name)
            .field("auth", &self.auth.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// Everything needed to reach Redis. `Debug` never prints credentials.
#[derive(Clone)]
pub struct RedisSettings {
    /// Node URLs (`redis://` or `rediss://`); one for standalone, the seeds for Cluster, the
    /// sentinels for Sentinel.
    pub urls: Vec<String>,
    pub kind: RedisKind,
    /// Required with [`RedisKind::Sentinel`], ignored otherwise.
    pub sentinel: Option<SentinelSettings>,
    /// `REDIS_AUTH`: `pass` or `user:pass`; overrides credentials in the URLs.
    pub auth: Option<String>,
    /// Connections in the standalone pool (each is multiplexed, so requests are pipelined).
    pub pool_size: u32,
    /// Bound on every Redis round trip, connection set-up included.
    pub timeout: Duration,
    /// `CACHE_KEY_PREFIX`.
    pub key_prefix: String,
    /// `EXPIRATION_JITTER_MAX_SECONDS`: up to this much is added to every key's TTL (never more
    /// than the TTL itself), so keys written at one window edge expire spread out.
    pub expiration_jitter: Duration,
    /// Certificates for `rediss://` URLs (unused for `redis://`).
    pub tls: RedisTlsSettings,
}

/// TLS to Redis (envoyproxy's `REDIS_TLS_*`), applied to `rediss://` URLs. The defaults trust
/// the system's root certificates and present no client certificate. `Debug` shows paths only,
/// never file contents.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisTlsSettings {
    /// `REDIS_TLS_CACERT`: PEM CA bundle that replaces the system roots for verifying Redis.
    pub ca_cert: Option<PathBuf>,
    /// `REDIS_TLS_CLIENT_CERT`: PEM client certificate chain, for `tls-auth-clients yes`.
    pub client_cert: Option<PathBuf>,
    /// `REDIS_TLS_CLIENT_KEY`: the client certificate's PEM private key.
    pub client_key: Option<PathBuf>,
    /// `REDIS_TLS_SKIP_HOSTNAME_VERIFICATION`: accept a certificate whose names do not match the
    /// host connected to (managed Redis services that hand out IPs); the chain is still verified.
    pub skip_hostname_verification: bool,
}

impl RedisTlsSettings {
    /// Reads and checks the files, so a missing file, a bad PEM or a client key that does not
    /// match its certificate fails at start, naming the file, instead of at every connection.
    fn certificates(&self) -> Result<redis::TlsCertificates, StoreError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        fn read(var: &str, path: &Path) -> Result<Vec<u8>, StoreError> {
            std::fs::read(path).map_err(|e| {
                StoreError::Permanent(format!("cannot read {var} {}: {e}", path.display()))
            })
        }
        fn certs(var: &str, path: &Path, pem: &[u8]) -> Result<(), StoreError> {
            let bad = |why: String| {
                StoreError::Permanent(format!("invalid {var} {}: {why}", path.display()))
            };
            let certs = CertificateDer::pem_slice_iter(pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad(e.to_string()))?;
            match certs.first() {
                None => Err(bad("no PEM CERTIFICATE block found".into())),
                Some(first) => rustls::server::ParsedCertificate::try_from(first)
                    .map(|_| ())
                    .map_err(|e| bad(e.to_string())),
            }
        }
        let root_cert = match &self.ca_cert {
            Some(path) => {
                let pem = read("REDIS_TLS_CACERT", path)?;
                certs("REDIS_TLS_CACERT", path, &pem)?;
                Some(pem)
            }
            None => None,
        };
        let client_tls = match (&self.client_cert, &self.client_key) {
            (Some(cert_path), Some(key_path)) => {
                let client_cert = read("REDIS_TLS_CLIENT_CERT", cert_path)?;
                certs("REDIS_TLS_CLIENT_CERT", cert_path, &client_cert)?;
                let client_key = read("REDIS_TLS_CLIENT_KEY", key_path)?;
                let key = PrivateKeyDer::from_pem_slice(&client_key).map_err(|e| {
                    StoreError::Permanent(format!(
                        "invalid REDIS_TLS_CLIENT_KEY {}: {e}",
                        key_path.display()
                    ))
                })?;
                let chain = CertificateDer::pem_slice_iter(&client_cert)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| StoreError::Permanent(e.to_string()))?;
                rustls::sign::CertifiedKey::from_der(
                    chain,
                    key,
                    &rustls::crypto::ring::default_provider(),
                )
                .map_err(|e| {
                    StoreError::Permanent(format!(
                        "REDIS_TLS_CLIENT_KEY {} does not fit REDIS_TLS_CLIENT_CERT {}: {e}",
                        key_path.display(),
                        cert_path.display()
                    ))
                })?;
                Some(redis::ClientTlsConfig {
                    client_cert,
                    client_key,
                })
            }
            (None, None) => None,
            _ => {
                return Err(StoreError::Permanent(
                    "REDIS_TLS_CLIENT_CERT and REDIS_TLS_CLIENT_KEY must be set together".into(),
                ))
            }
        };
        Ok(redis::TlsCertificates {
            client_tls,
            root_cert,
        })
    }
}

impl fmt::Debug for RedisSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisSettings")
            .field(
                "urls",
                &self.urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>(),
            )
            .field("kind", &self.kind)
            .field("sentinel", &self.sentinel)
            .field("auth", &self.auth.as_ref().map(|_| "<redacted>"))
            .field("pool_size", &self.pool_size)
            .field("timeout", &self.timeout)
            .field("key_prefix", &self.key_prefix)
            .field("tls", &self.tls)
            .finish()
    }
}

/// `redis://user:secret@host` -> `redis://user:<redacted>@host`.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s + 3 => {
            let creds = &url[s + 3..at];
            let user = creds.split_once(':').map_or("", |(u, _)| u);
            format!("{}{}:<redacted>{}", &url[..s + 3], user, &url[at..])
        }
        _ => url.to_string(),
    }
}

impl RedisSettings {
    /// The URLs' connection details, `auth` (`pass` or `user:pass`) replacing their credentials.
    fn connection_infos(
        &self,
        auth: Option<&str>,
    ) -> Result<Vec<redis::ConnectionInfo>, StoreError> {
        use redis::IntoConnectionInfo;
        self.urls
            .iter()
            .map(|u| {
                let mut info = u.as_str().into_connection_info().map_err(|e| {
                    StoreError::Permanent(format!("invalid Redis URL {}: {e}", redact_url(u)))
                })?;
                if let Some(auth) = auth {
                    let settings = with_auth(info.redis_settings().clone(), auth);
                    info = info.set_redis_settings(settings);
                }
                Ok(info)
            })
            .collect()
    }
}

/// `auth` is `pass` or `user:pass`.
fn with_auth(settings: redis::RedisConnectionInfo, auth: &str) -> redis::RedisConnectionInfo {
    match auth.split_once(':') {
        Some((user, pass)) => settings.set_password(pass).set_username(user),
        None => settings.set_password(auth),
    }
}

/// A `rediss://` address.
fn is_tls(info: &redis::ConnectionInfo) -> bool {
    matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. })
}

/// A standalone client for a `rediss://` URL with the configured roots and client certificate.
fn tls_client(
    info: redis::ConnectionInfo,
    certs: &redis::TlsCertificates,
    skip_hostname_verification: bool,
) -> redis::RedisResult<redis::Client> {
    let client = redis::Client::build_with_tls(info, certs.clone())?;
    if !skip_hostname_verification {
        return Ok(client);
    }
    // `build_with_tls` resets the flag, so it is set on the finished address.
    let info = client.get_connection_info().clone();
    let mut addr = info.addr().clone();
    addr.set_danger_accept_invalid_hostnames(true);
    redis::Client::open(info.set_addr(addr))
}

/// A multiplexed connection shared by every in-flight call, and a flag set when a call on it
/// fails at the transport level, so the pool replaces it (after a Redis restart, say).
pub struct PooledConn {
    conn: MultiplexedConnection,
    broken: Broken,
}

/// Marks connections broken. A transport failure on one connection usually means Redis went
/// away (a restart, a failover), so it also retires every connection opened before it: the
/// next call then gets a fresh connection instead of another dead one.
#[derive(Clone, Debug)]
struct Broken {
    this: Arc<AtomicBool>,
    /// Failures seen by the pool so far, and how many there had been when this one connected.
    epoch: Arc<AtomicU64>,
    born: u64,
}

impl Broken {
    fn set(&self) {
        if !self.this.swap(true, Ordering::Relaxed) {
            self.epoch.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn is_set(&self) -> bool {
        self.this.load(Ordering::Relaxed) || self.epoch.load(Ordering::Relaxed) != self.born
    }
}

/// bb8 manager for [`PooledConn`]. A call checks a connection out only long enough to clone its
/// handle (the clone shares the one socket and its writer task), so bb8 keeps `REDIS_POOL_SIZE`
/// multiplexed connections open and hands them out in turn, while the number of calls in flight
/// is unbounded and concurrent commands are written in batches (auto-pipelining). bb8-redis's
/// own manager never reports a multiplexed connection as broken, so it needs a PING on every
/// checkout (a second round trip per decision) to notice a restarted Redis; this one checks the
/// flag a failed call set, without I/O.
#[derive(Debug)]
pub struct Manager {
    target: Target,
    epoch: Arc<AtomicU64>,
    config: redis::AsyncConnectionConfig,
    errors: ConnectErrors,
}

/// Where the pool's connections go.
#[derive(Debug)]
enum Target {
    Direct(redis::Client),
    /// Wherever the sentinels say the master is, asked anew for each connection.
    Sentinel(sentinel::Sentinels),
}

/// The sentinels of `settings` (their URLs as `infos`, with `REDIS_SENTINEL_AUTH`) and how to
/// reach the master they name (`REDIS_AUTH`, the same TLS).
fn sentinels(
    settings: &RedisSettings,
    infos: Vec<redis::ConnectionInfo>,
    certs: Option<redis::TlsCertificates>,
) -> Result<sentinel::Sentinels, StoreError> {
    let Some(s) = &settings.sentinel else {
        return Err(StoreError::Permanent(
            "REDIS_TYPE=sentinel needs the master's name (REDIS_URL=master_name,host:port,...)"
                .into(),
        ));
    };
    if infos.is_empty() {
        return Err(StoreError::Permanent(
            "REDIS_TYPE=sentinel needs at least one sentinel address after the master's name"
                .into(),
        ));
    }
    let mut master = redis::RedisConnectionInfo::default();
    if let Some(auth) = &settings.auth {
        master = with_auth(master, auth);
    }
    let tls = certs.map(|c| (c, settings.tls.skip_hostname_verification));
    sentinel::Sentinels::new(infos, s.master_name.clone(), master, tls)
        .map_err(|e| StoreError::Permanent(format!("Redis Sentinel client: {e}")))
}

/// Logs why the pool could not connect. bb8 hands connection errors to its error sink only (a
/// caller just times out), so without this a rejected certificate or a wrong CA would never be
/// told. Each distinct error is logged once until a connection succeeds again, so a Redis that
/// stays down does not flood the log.
#[derive(Debug, Clone, Default)]
struct ConnectErrors {
    last: Arc<Mutex<Option<String>>>,
}

impl ConnectErrors {
    fn connected(&self) {
        if let Ok(mut last) = self.last.lock() {
            *last = None;
        }
    }
}

impl bb8::ErrorSink<RedisError> for ConnectErrors {
    fn sink(&self, error: RedisError) {
        let message = error.to_string();
        if let Ok(mut last) = self.last.lock() {
            if last.as_deref() != Some(message.as_str()) {
                tracing::warn!(error = %message, "cannot connect to Redis");
                *last = Some(message);
            }
        }
    }

    fn boxed_clone(&self) -> Box<dyn bb8::ErrorSink<RedisError>> {
        Box::new(self.clone())
    }
}

impl bb8::ManageConnection for Manager {
    type Connection = PooledConn;
    type Error = RedisError;

    async fn connect(&self) -> Result<PooledConn, RedisError> {
        let conn = match &self.target {
            Target::Direct(client) => {
                client
                    .get_multiplexed_async_connection_with_config(&self.config)
                    .await?
            }
            Target::Sentinel(sentinels) => sentinels.connect_master(&self.config).await?,
        };
        self.errors.connected();
        Ok(PooledConn {
            conn,
            broken: Broken {
                this: Arc::new(AtomicBool::new(false)),
                born: self.epoch.load(Ordering::Relaxed),
                epoch: self.epoch.clone(),
            },
        })
    }

    /// No I/O: a connection is valid until a call on it failed at the transport level.
    async fn is_valid(&self, conn: &mut PooledConn) -> Result<(), RedisError> {
        if conn.broken.is_set() {
            Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "connection marked broken",
            )))
        } else {
            Ok(())
        }
    }

    fn has_broken(&self, conn: &mut PooledConn) -> bool {
        conn.broken.is_set()
    }
}

// One Backend per store, built once: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
enum Backend {
    Single(bb8::Pool<Manager>),
    Cluster {
        client: ClusterClient,
        /// Connected lazily, so sluice starts (and reports NOT_SERVING) while Redis is down
        /// and recovers without a restart.
        conn: Mutex<Option<ClusterConnection>>,
    },
}

/// A connection handle for one call.
#[derive(Clone)]
enum Conn {
    Single(MultiplexedConnection, Broken),
    Cluster(ClusterConnection),
}

impl Conn {
    /// Runs `run` on this connection; a transport failure marks a pooled connection broken.
    async fn query<T>(
        &mut self,
        run: impl AsyncFnOnce(&mut Conn) -> redis::RedisResult<T>,
    ) -> Result<T, StoreError> {
        let broken = match self {
            Conn::Single(_, broken) => Some(broken.clone()),
            Conn::Cluster(_) => None,
        };
        let r = run(self).await;
        if let (Err(e), Some(broken)) = (&r, broken) {
            // READONLY: this server was demoted to a replica. Sentinel also closes the clients of
            // a server it reconfigures, so this is the fallback if that close is missed: the
            // next connection goes to the master the sentinels name.
            if is_transport(e) || e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly) {
                broken.set();
            }
        }
        r.map_err(classify)
    }
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Conn::Single(c, _) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::Single(c, _) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c, _) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

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
            RedisKind::Single | RedisKind::Sentinel => {
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
                Backend::Single(pool)
            }
            RedisKind::Cluster => {
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
                Backend::Cluster {
                    client,
                    conn: Mutex::new(None),
                }
            }
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

    /// The script call deciding `idx` of `checks`, owned so it can run on a spawned task.
    /// `whole`: the call decides the whole request, so the script applies the quota-mode rule;
    /// otherwise (one slot of several) quota limits go as shadow and the caller applies it.
    fn call_for(&self, checks: &[LimitCheck], idx: &[usize], whole: bool) -> Call {
        let meta = |c: &LimitCheck| {
            let quota = if whole { FLAG_QUOTA } else { FLAG_SHADOW };
            let flags = if c.shadow { FLAG_SHADOW } else { 0 }
                | if c.refund { FLAG_REFUND } else { 0 }
                | if c.quota { quota } else { 0 };
            u64::from(c.key.limit.algorithm.code())
                | flags << 2
                | u64::from(c.key.limit.burst) << META_BURST_SHIFT
        };
        // Plain requests (fixed windows, no shadow, no refund: meta 0) skip the meta argument.
        let plain = idx.iter().all(|&i| meta(&checks[i]) == 0);
        let per_key = if plain {
            ARGS_PER_KEY - 1
        } else {
            ARGS_PER_KEY
        };
        let mut keys = Vec::with_capacity(idx.len());
        let mut args = Vec::with_capacity(idx.len() * per_key);
        for &i in idx {
            let c = &checks[i];
            let p = c.params();
            keys.push(self.key_of(&c.key));
            args.extend([u64::from(p.limit), p.period_us, c.hits]);
            if !plain {
                args.push(meta(c));
            }
        }
        Call {
            keys,
            args,
            tokens: false,
            plain,
        }
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
        let admitted = parse(&r?, all, false, &mut outcomes)?;
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
            let admitted = parse(&r?, only, false, &mut outcomes)?;
            return Ok(Decision {
                admitted,
                outcomes,
                local: false,
            });
        }
        // Cluster, several slots: the charges and, if one slot denies, the undo of the others
        // run on their own task, so a caller that gives up (Envoy's deadline) cannot leave a
        // charge without its undo.
        let calls: Vec<Call> = groups
            .iter()
            .map(|g| Call {
                tokens: true,
                ..self.call_for(checks, g, false)
            })
            .collect();
        // Which limits of each call are quota-mode (sent as shadow): the rule is applied here.
        let quota: Vec<Vec<bool>> = if checks.iter().any(|c| c.quota) {
            groups
                .iter()
                .map(|g| g.iter().map(|&i| checks[i].quota).collect())
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
            if let Err(e) = r.and_then(|values| parse(&values, g, true, &mut outcomes)) {
                first_error.get_or_insert(e);
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        // What an undone charge gave back is left again.
        for (g, done) in groups.iter().zip(undone) {
            if !done {
                continue;
            }
            for &i in g {
                let c = &checks[i];
                let o = &mut outcomes[i];
                if o.allowed && c.hits > 0 && !c.refund {
                    o.remaining = o
                        .remaining
                        .saturating_add(u32::try_from(c.hits).unwrap_or(u32::MAX))
                        .min(c.key.limit.requests_per_unit);
                }
            }
        }
        Ok(Decision {
            admitted,
            outcomes,
            local: false,
        })
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

/// Script arguments per limit (see the top of `decide.lua`); an undo call adds the token.
const ARGS_PER_KEY: usize = 4;
/// The flags of `decide.lua`'s `meta` argument (shifted left by 2 into it), and where its
/// burst starts.
const FLAG_SHADOW: u64 = 1;
const FLAG_REFUND: u64 = 2;
const FLAG_QUOTA: u64 = 8;
const META_BURST_SHIFT: u32 = 6;
/// The undo flag, as placed in `meta`.
const UNDO: u64 = 4 << 2;
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

/// One script call: its keys and the numeric arguments after ARGV[2].
#[derive(Debug, Clone)]
struct Call {
    keys: Vec<String>,
    args: Vec<u64>,
    /// Ask for undo tokens (ARGV[2]).
    tokens: bool,
    /// Fixed windows only, no flags: 3 arguments per limit, the script's fast path.
    plain: bool,
}

impl Call {
    /// Values per limit in the reply.
    fn width(&self) -> usize {
        if self.is_undo() {
            1
        } else if self.tokens {
            4
        } else {
            3
        }
    }

    fn per_key(&self) -> usize {
        if self.plain {
            ARGS_PER_KEY - 1
        } else if self.is_undo() {
            ARGS_PER_KEY + 1
        } else {
            ARGS_PER_KEY
        }
    }

    fn is_undo(&self) -> bool {
        !self.plain && self.args.get(3).is_some_and(|meta| meta & UNDO != 0)
    }
}

/// One EVALSHA (plus SCRIPT LOAD after NOSCRIPT), bounded by `timeout`.
async fn run(
    script: &Script,
    conn: Conn,
    now: &str,
    call: &Call,
    timeout: Duration,
) -> Result<Vec<i64>, StoreError> {
    let mut replies = run_batch(script, conn, now, &[call], timeout).await?;
    replies
        .pop()
        .ok_or_else(|| StoreError::Permanent("decide.lua returned no reply".into()))
}

/// ONE EVALSHA deciding every call of `calls` in turn (each all or nothing); the replies, split
/// per call. All calls must agree on `tokens`.
async fn run_batch(
    script: &Script,
    mut conn: Conn,
    now: &str,
    calls: &[&Call],
    timeout: Duration,
) -> Result<Vec<Vec<i64>>, StoreError> {
    if let Some(packed) = packed::Packed::new(calls) {
        let mut inv = script.prepare_invoke();
        inv.arg(now).arg("p");
        for &(key, _, _) in &packed.counters {
            inv.key(key);
        }
        for a in packed.args() {
            inv.arg(a);
        }
        let reply = invoke(&mut conn, &inv, timeout).await?;
        return packed.answers(&reply);
    }
    let tokens = calls.first().is_some_and(|c| c.tokens);
    let mut inv = script.prepare_invoke();
    inv.arg(now)
        .arg(if tokens { "1" } else { "0" })
        .arg(calls.len());
    for call in calls {
        let n = i64::try_from(call.keys.len()).unwrap_or(i64::MAX);
        inv.arg(if call.plain { -n } else { n });
        for (key, args) in call.keys.iter().zip(call.args.chunks(call.per_key())) {
            inv.key(key.as_str());
            for a in args {
                inv.arg(*a);
            }
        }
    }
    let values = invoke(&mut conn, &inv, timeout).await?;
    let expected: usize = calls.iter().map(|c| 1 + c.width() * c.keys.len()).sum();
    if values.len() != expected {
        return Err(StoreError::Permanent(format!(
            "decide.lua returned {} values for {} requests of {} limits",
            values.len(),
            calls.len(),
            calls.iter().map(|c| c.keys.len()).sum::<usize>()
        )));
    }
    let mut rest = values.as_slice();
    Ok(calls
        .iter()
        .map(|c| {
            let (one, tail) = rest.split_at(1 + c.width() * c.keys.len());
            rest = tail;
            one.to_vec()
        })
        .collect())
}

/// One EVALSHA (plus SCRIPT LOAD after NOSCRIPT), bounded by `timeout`.
async fn invoke(
    conn: &mut Conn,
    inv: &redis::ScriptInvocation<'_>,
    timeout: Duration,
) -> Result<Vec<i64>, StoreError> {
    let fut = conn.query(async |c| inv.invoke_async::<Vec<i64>>(c).await);
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(StoreError::Transient(format!(
            "Redis did not answer within {timeout:?}"
        ))),
    }
}

/// Decisions waiting for the batcher at most; a caller past it waits for room (bounded memory),
/// within its `REDIS_TIMEOUT`.
const BATCH_QUEUE: usize = 16_384;

/// Most limits one batched call decides: a batch stays far below Redis's 1 ms budget even when
/// every limit is a sliding_log (a request with more limits goes alone).
const MAX_BATCH_KEYS: usize = 64;

/// A decision waiting for the batcher.
struct Job {
    call: Call,
    reply: tokio::sync::oneshot::Sender<Result<Vec<i64>, StoreError>>,
}

/// Standalone Redis: sends concurrent decisions together. It keeps at most `in_flight` script
/// calls outstanding (`REDIS_POOL_SIZE`, one per connection); while they run, new decisions queue and the next call takes all of them
/// (up to [`MAX_BATCH_KEYS`] limits). One decision alone goes at once: batching adds no wait,
/// it only forms under load, where it saves Redis the per-call cost of EVALSHA (argument
/// tables, `TIME`, helper closures, the reply) and sluice the per-command encoding.
async fn batcher(
    mut rx: tokio::sync::mpsc::Receiver<Job>,
    pool: bb8::Pool<Manager>,
    script: Script,
    time: ScriptTime,
    timeout: Duration,
    in_flight: usize,
) {
    let permits = Arc::new(tokio::sync::Semaphore::new(in_flight.max(1)));
    let mut carried: Option<Job> = None;
    loop {
        let first = match carried.take() {
            Some(j) => j,
            None => match rx.recv().await {
                Some(j) => j,
                None => return,
            },
        };
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let mut keys = first.call.keys.len();
        let mut jobs = vec![first];
        while keys < MAX_BATCH_KEYS {
            match rx.try_recv() {
                Ok(j) if keys + j.call.keys.len() <= MAX_BATCH_KEYS => {
                    keys += j.call.keys.len();
                    jobs.push(j);
                }
                Ok(j) => {
                    carried = Some(j);
                    break;
                }
                Err(_) => break,
            }
        }
        // A caller that gave up while queued (Envoy's deadline) is not decided: its request
        // would be charged with nobody told.
        jobs.retain(|j| !j.reply.is_closed());
        if jobs.is_empty() {
            continue;
        }
        let (pool, script, now) = (pool.clone(), script.clone(), time.arg());
        tokio::spawn(async move {
            let result = match single_connection(&pool).await {
                Ok(conn) => {
                    let calls: Vec<&Call> = jobs.iter().map(|j| &j.call).collect();
                    run_batch(&script, conn, &now, &calls, timeout).await
                }
                Err(e) => Err(e),
            };
            match result {
                Ok(replies) => {
                    for (job, reply) in jobs.into_iter().zip(replies) {
                        let _ = job.reply.send(Ok(reply));
                    }
                }
                Err(e) => {
                    for job in jobs {
                        let _ = job.reply.send(Err(e.clone()));
                    }
                }
            }
            drop(permit);
        });
    }
}

/// A clone of a pooled multiplexed connection (checked out only for the clone).
async fn single_connection(pool: &bb8::Pool<Manager>) -> Result<Conn, StoreError> {
    let pooled = pool.get().await.map_err(|e| match e {
        bb8::RunError::User(e) => classify(e),
        bb8::RunError::TimedOut => StoreError::Transient("timed out connecting to Redis".into()),
    })?;
    Ok(Conn::Single(pooled.conn.clone(), pooled.broken.clone()))
}

/// Folds one call's reply into `outcomes` (at `idx`); returns whether the call admitted.
fn parse(
    values: &[i64],
    idx: &[usize],
    tokens: bool,
    outcomes: &mut [Outcome],
) -> Result<bool, StoreError> {
    let width = if tokens { 4 } else { 3 };
    if values.len() != 1 + width * idx.len() {
        return Err(StoreError::Permanent(format!(
            "decide.lua returned {} values for {} limits",
            values.len(),
            idx.len()
        )));
    }
    for (v, &i) in values[1..].chunks(width).zip(idx) {
        outcomes[i] = Outcome {
            allowed: v[0] & 1 == 1,
            remaining: u32::try_from((v[0] >> 1).max(0)).unwrap_or(u32::MAX),
            reset: micros(v[1]),
            retry_after: if v[2] < 0 {
                Duration::MAX
            } else {
                micros(v[2])
            },
        };
    }
    Ok(values[0] == 1)
}

/// Runs every slot's call concurrently; if the request is not admitted (a slot denies or fails,
/// or every quota-mode limit denied), undoes exactly what the admitting slots charged: the same
/// window, the same sorted-set entry, only the checks that were written. `quota` says, per call
/// and limit, which limits are quota-mode (empty: none). Returns each call's result, per call
/// whether an undo was done, and whether the request was admitted.
async fn charge_or_undo(
    script: Script,
    conn: Conn,
    time: ScriptTime,
    calls: Vec<Call>,
    quota: Vec<Vec<bool>>,
    timeout: Duration,
    failures: Arc<AtomicU64>,
) -> (Vec<Result<Vec<i64>, StoreError>>, Vec<bool>, bool) {
    let now = time.arg();
    let results = futures_util::future::join_all(
        calls
            .iter()
            .map(|c| run(&script, conn.clone(), &now, c, timeout)),
    )
    .await;
    let admitted = results
        .iter()
        .all(|r| r.as_ref().is_ok_and(|v| v.first() == Some(&1)))
        && quota_rule_holds(&calls, &results, &quota);
    let mut undone = vec![false; calls.len()];
    if admitted {
        return (results, undone, true);
    }
    for ((call, r), undone) in calls.iter().zip(&results).zip(&mut undone) {
        let Ok(values) = r else { continue };
        if values.first() != Some(&1) {
            continue;
        }
        let mut undo = Call {
            keys: Vec::new(),
            args: Vec::new(),
            tokens: false,
            plain: false,
        };
        for ((key, args), v) in call
            .keys
            .iter()
            .zip(call.args.chunks(call.per_key()))
            .zip(values[1..].chunks(call.width()))
        {
            let (hits, meta) = (args[2], args.get(3).copied().unwrap_or(0));
            // Written: allowed, hits to charge, not a refund. A shadow denial wrote nothing.
            if v[0] & 1 == 1 && hits > 0 && meta & (FLAG_REFUND << 2) == 0 {
                undo.keys.push(key.clone());
                undo.args.extend([
                    args[0],
                    args[1],
                    hits,
                    meta | UNDO,
                    u64::try_from(v[3]).unwrap_or(0),
                ]);
                // (A plain call's limits are fixed windows with no flags: meta 0.)
            }
        }
        if undo.keys.is_empty() {
            continue;
        }
        let mut last = None;
        for _ in 0..UNDO_ATTEMPTS {
            // Read the clock again: an undo decides nothing, it only needs "now" to clamp a
            // token bucket, and a test clock may have moved past a window edge meanwhile.
            let now = time.arg();
            match run(&script, conn.clone(), &now, &undo, timeout).await {
                Ok(v) if v[1..].iter().all(|&done| done == 1) => {
                    last = None;
                    *undone = true;
                    break;
                }
                Ok(_) => {
                    last = Some(StoreError::Permanent(
                        "the charge moved too far to be taken back within bounded work".into(),
                    ));
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        if let Some(e) = last {
            failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, keys = undo.keys.len(), "could not undo the charge of a request denied in another slot");
        }
    }
    (results, undone, false)
}

/// The quota-mode half of [`crate::store::Admission`] across slots: with quota limits, at
/// least one of them allowed the request (their calls sent them as shadow, so each call's
/// `admitted` covers only the enforced limits).
fn quota_rule_holds(
    calls: &[Call],
    results: &[Result<Vec<i64>, StoreError>],
    quota: &[Vec<bool>],
) -> bool {
    if quota.iter().all(|q| !q.contains(&true)) {
        return true;
    }
    calls.iter().zip(results).zip(quota).any(|((call, r), q)| {
        let Ok(values) = r else { return false };
        values
            .get(1..)
            .unwrap_or_default()
            .chunks(call.width())
            .zip(q)
            .any(|(v, &is_quota)| is_quota && v.first().is_some_and(|s| s & 1 == 1))
    })
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
        let groups = self.groups(checks);
        CallShape {
            store: match self.backend {
                Backend::Single(_) => "redis",
                Backend::Cluster { .. } => "redis-cluster",
            },
            groups: groups.len(),
            keys: checks.len(),
        }
    }
}

fn micros(v: i64) -> Duration {
    Duration::from_micros(u64::try_from(v).unwrap_or(0))
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
