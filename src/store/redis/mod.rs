//! The Redis store, standalone or Cluster. A decision groups the request's limits by hash tag and
//! evaluates each group with ONE `EVALSHA` of `decide.lua`, atomically and on the Redis server
//! clock; if one group denies, the groups that charged are refunded, so a rejected request never
//! burns quota. Errors are classified transient/permanent here, where they are converted.

pub mod keys;

use super::{
    BoxFuture, CallShape, CounterKey, CounterStore, Decision, LimitCheck, Outcome, StoreError,
};
use crate::clock::Clock;
use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{ErrorKind, RedisError, Script, ServerErrorKind};
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The decision script; KEYS/ARGV are documented at its top.
pub const DECIDE_LUA: &str = include_str!("decide.lua");

/// Default bound on one Redis round trip (`REDIS_TIMEOUT`): Envoy's own default timeout for the
/// rate-limit call is 20 ms, so waiting much longer only ties up sluice.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(500);
pub const DEFAULT_POOL_SIZE: u32 = 8;

/// Standalone or Cluster (`REDIS_TYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisKind {
    Single,
    Cluster,
}

/// Everything needed to reach Redis. `Debug` never prints credentials.
#[derive(Clone)]
pub struct RedisSettings {
    /// Node URLs (`redis://` or `rediss://`); one for standalone, the seeds for Cluster.
    pub urls: Vec<String>,
    pub kind: RedisKind,
    /// `REDIS_AUTH`: `pass` or `user:pass`; overrides credentials in the URLs.
    pub auth: Option<String>,
    /// Connections in the standalone pool (each is multiplexed, so requests are pipelined).
    pub pool_size: u32,
    /// Bound on every Redis round trip, connection set-up included.
    pub timeout: Duration,
    /// `CACHE_KEY_PREFIX`.
    pub key_prefix: String,
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
    fn connection_infos(&self) -> Result<Vec<redis::ConnectionInfo>, StoreError> {
        use redis::IntoConnectionInfo;
        self.urls
            .iter()
            .map(|u| {
                let mut info = u.as_str().into_connection_info().map_err(|e| {
                    StoreError::Permanent(format!("invalid Redis URL {}: {e}", redact_url(u)))
                })?;
                if let Some(auth) = &self.auth {
                    let (user, pass) = match auth.split_once(':') {
                        Some((u, p)) => (Some(u.to_string()), p.to_string()),
                        None => (None, auth.clone()),
                    };
                    let mut redis = info.redis_settings().clone();
                    redis = redis.set_password(pass);
                    if let Some(user) = user {
                        redis = redis.set_username(user);
                    }
                    info = info.set_redis_settings(redis);
                }
                Ok(info)
            })
            .collect()
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

/// A multiplexed connection that remembers an I/O failure, so the pool drops it instead of
/// handing a dead connection out again after Redis restarts.
pub struct PooledConn {
    conn: MultiplexedConnection,
    broken: bool,
}

/// bb8 manager for [`PooledConn`]. bb8-redis's own manager never reports a multiplexed
/// connection as broken, so it needs a PING on every checkout (a second round trip per
/// decision) to notice a restarted Redis; this one marks a connection broken when a call on it
/// fails at the transport level.
#[derive(Debug)]
pub struct Manager {
    client: redis::Client,
    config: redis::AsyncConnectionConfig,
    errors: ConnectErrors,
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
        let conn = self
            .client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        self.errors.connected();
        Ok(PooledConn {
            conn,
            broken: false,
        })
    }

    async fn is_valid(&self, conn: &mut PooledConn) -> Result<(), RedisError> {
        redis::cmd("PING").query_async::<()>(&mut conn.conn).await
    }

    fn has_broken(&self, conn: &mut PooledConn) -> bool {
        conn.broken
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
        conn: tokio::sync::Mutex<Option<ClusterConnection>>,
    },
}

/// Counters in Redis or Redis Cluster.
pub struct RedisStore {
    backend: Backend,
    script: Script,
    prefix: String,
    timeout: Duration,
    kind: RedisKind,
    /// Tests only: decide on this clock instead of the Redis server clock.
    test_clock: Option<Arc<dyn Clock>>,
    healthy: Mutex<bool>,
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
        let infos = settings.connection_infos()?;
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
            RedisKind::Single => {
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
                let config = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(settings.timeout))
                    .set_response_timeout(Some(settings.timeout));
                let errors = ConnectErrors::default();
                let pool = bb8::Pool::builder()
                    .max_size(settings.pool_size.max(1))
                    .connection_timeout(settings.timeout)
                    .test_on_check_out(false)
                    // A refused connection fails the call at once instead of retrying until the
                    // timeout: the breaker and the health probe handle recovery.
                    .retry_connection(false)
                    .error_sink(Box::new(errors.clone()))
                    .build_unchecked(Manager {
                        client,
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
                    conn: tokio::sync::Mutex::new(None),
                }
            }
        };
        Ok(Self {
            backend,
            script: Script::new(DECIDE_LUA),
            prefix: settings.key_prefix.clone(),
            timeout: settings.timeout,
            kind: settings.kind,
            test_clock: None,
            healthy: Mutex::new(true),
        })
    }

    /// Tests only: decide on `clock` (passed to the script) instead of Redis `TIME`, so window
    /// logic can be driven without sleeping. Production never calls this.
    pub fn with_test_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.test_clock = Some(clock);
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

    /// Runs the script for one group of limits: one EVALSHA (plus SCRIPT LOAD after NOSCRIPT).
    async fn eval_group(
        &self,
        group: &[&LimitCheck],
        refund: bool,
    ) -> Result<Vec<i64>, StoreError> {
        let mut inv = self.script.prepare_invoke();
        let now = self
            .test_clock
            .as_ref()
            .map(|c| c.now().as_micros().to_string())
            .unwrap_or_default();
        inv.arg(now);
        for c in group {
            let p = c.params();
            let flags = u8::from(c.shadow) | (u8::from(refund || c.refund) << 1);
            inv.key(self.key_of(&c.key))
                .arg(p.limit)
                .arg(p.period_us)
                .arg(c.hits)
                .arg(flags)
                .arg(p.algorithm.code())
                .arg(p.burst);
        }
        let call = async {
            match &self.backend {
                Backend::Single(pool) => {
                    let mut conn = pool.get().await.map_err(|e| match e {
                        bb8::RunError::User(e) => classify(e),
                        bb8::RunError::TimedOut => {
                            StoreError::Transient("timed out connecting to Redis".into())
                        }
                    })?;
                    let r = inv.invoke_async::<Vec<i64>>(&mut conn.conn).await;
                    if let Err(e) = &r {
                        if is_transport(e) {
                            conn.broken = true;
                        }
                    }
                    r.map_err(classify)
                }
                Backend::Cluster { client, conn } => {
                    let mut c = {
                        let mut guard = conn.lock().await;
                        match guard.as_ref() {
                            Some(c) => c.clone(),
                            None => {
                                let c = client.get_async_connection().await.map_err(classify)?;
                                *guard = Some(c.clone());
                                c
                            }
                        }
                    };
                    inv.invoke_async::<Vec<i64>>(&mut c).await.map_err(classify)
                }
            }
        };
        let result = match tokio::time::timeout(self.timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Transient(format!(
                "Redis did not answer within {:?}",
                self.timeout
            ))),
        };
        match &result {
            Ok(_) => self.set_healthy(true),
            Err(StoreError::Transient(_)) => self.set_healthy(false),
            Err(StoreError::Permanent(_)) => {}
        }
        let values = result?;
        if values.len() != 1 + 4 * group.len() {
            return Err(StoreError::Permanent(format!(
                "decide.lua returned {} values for {} limits",
                values.len(),
                group.len()
            )));
        }
        Ok(values)
    }

    async fn decide_all(&self, checks: &[LimitCheck]) -> Result<Decision, StoreError> {
        // Group by hash tag, keeping each check's index; one script call per group.
        let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
        let mut by_tag: HashMap<String, usize> = HashMap::new();
        for (i, c) in checks.iter().enumerate() {
            let tag = keys::hash_tag(&c.key);
            let g = *by_tag.entry(tag.clone()).or_insert_with(|| {
                groups.push((tag, Vec::new()));
                groups.len() - 1
            });
            groups[g].1.push(i);
        }
        let calls = groups.iter().map(|(_, idx)| {
            let group: Vec<&LimitCheck> = idx.iter().map(|&i| &checks[i]).collect();
            async move { self.eval_group(&group, false).await }
        });
        let results = futures_util::future::join_all(calls).await;

        let mut outcomes = vec![
            Outcome {
                allowed: false,
                remaining: 0,
                reset: Duration::ZERO,
                retry_after: Duration::ZERO,
            };
            checks.len()
        ];
        let mut admitted = true;
        let mut group_admitted = Vec::with_capacity(groups.len());
        let mut first_error = None;
        for ((_, idx), r) in groups.iter().zip(results) {
            match r {
                Ok(values) => {
                    let ok = values[0] == 1;
                    admitted &= ok;
                    group_admitted.push(ok);
                    for (j, &i) in idx.iter().enumerate() {
                        let v = &values[1 + 4 * j..5 + 4 * j];
                        outcomes[i] = Outcome {
                            allowed: v[0] == 1,
                            remaining: u32::try_from(v[1].max(0)).unwrap_or(u32::MAX),
                            reset: micros(v[2]),
                            retry_after: if v[3] < 0 {
                                Duration::MAX
                            } else {
                                micros(v[3])
                            },
                        };
                    }
                }
                Err(e) => {
                    admitted = false;
                    group_admitted.push(false);
                    first_error.get_or_insert(e);
                }
            }
        }
        if !admitted {
            // All or nothing across groups: give back what admitted groups charged.
            for ((_, idx), ok) in groups.iter().zip(&group_admitted) {
                if !*ok {
                    continue;
                }
                let charged: Vec<&LimitCheck> = idx
                    .iter()
                    .map(|&i| &checks[i])
                    .filter(|c| c.hits > 0 && !c.refund)
                    .collect();
                if charged.is_empty() {
                    continue;
                }
                match self.eval_group(&charged, true).await {
                    Ok(_) => {
                        for &i in idx {
                            let c = &checks[i];
                            if c.hits > 0 && !c.refund {
                                let o = &mut outcomes[i];
                                o.remaining = o
                                    .remaining
                                    .saturating_add(u32::try_from(c.hits).unwrap_or(u32::MAX))
                                    .min(c.key.limit.requests_per_unit);
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "could not refund a partially charged request");
                    }
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        Ok(Decision {
            admitted,
            outcomes,
            local: false,
        })
    }

    /// One PING round trip: health checks and circuit-breaker probes.
    pub async fn ping(&self) -> bool {
        let call = async {
            match &self.backend {
                Backend::Single(pool) => {
                    let mut conn = pool.get().await.map_err(|e| e.to_string())?;
                    let r = redis::cmd("PING").query_async::<()>(&mut conn.conn).await;
                    if let Err(e) = &r {
                        if is_transport(e) {
                            conn.broken = true;
                        }
                    }
                    r.map_err(|e| e.to_string())
                }
                Backend::Cluster { client, conn } => {
                    let mut guard = conn.lock().await;
                    if guard.is_none() {
                        *guard = Some(
                            client
                                .get_async_connection()
                                .await
                                .map_err(|e| e.to_string())?,
                        );
                    }
                    let mut c = guard.clone().ok_or("no connection")?;
                    drop(guard);
                    redis::cmd("PING")
                        .query_async::<()>(&mut c)
                        .await
                        .map_err(|e| e.to_string())
                }
            }
        };
        let ok = matches!(tokio::time::timeout(self.timeout, call).await, Ok(Ok(())));
        self.set_healthy(ok);
        ok
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

    fn call_shape(&self, checks: &[LimitCheck]) -> CallShape {
        let groups: std::collections::HashSet<String> =
            checks.iter().map(|c| keys::hash_tag(&c.key)).collect();
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
