//! What the Redis store connects to and how: `REDIS_TYPE`, URLs (with secrets redacted in
//! `Debug`), Sentinel, TLS certificates, timeouts and the pool size.

use crate::store::StoreError;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Default bound on one Redis round trip (`REDIS_TIMEOUT`). Envoy gives up on the rate-limit call
/// after 20 ms by default and sluice stops waiting at the caller's deadline anyway, so this only
/// bounds callers that send none (and connecting): five Envoy timeouts, far above a healthy
/// Redis's latency (well under a millisecond) and short enough that a stuck Redis is noticed,
/// and the breaker opened, within a few hundred milliseconds.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(100);
/// Multiplexed connections to a standalone Redis (`REDIS_POOL_SIZE`), and script calls kept
/// outstanding on them. Not a cap on concurrent decisions: while a call runs, the next ones
/// queue and go together in the next call, so fewer outstanding calls mean bigger batches and
/// less Redis CPU per decision. One measured best on a 2-core pod (docs/performance.md).
pub const DEFAULT_POOL_SIZE: u32 = 1;

/// Standalone, Cluster or Sentinel: `REDIS_TYPE` as the settings read it (any case) and as the
/// store is built for it; the one enum for the Redis kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RedisKind {
    Single,
    Cluster,
    /// A master found through Redis Sentinel; otherwise decided as on standalone Redis.
    Sentinel,
}

impl RedisKind {
    /// The store name traces and logs give the backend of this kind.
    pub fn backend_name(self) -> &'static str {
        match self {
            Self::Single | Self::Sentinel => "redis",
            Self::Cluster => "redis-cluster",
        }
    }
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
    pub(super) fn certificates(&self) -> Result<redis::TlsCertificates, StoreError> {
        fn read(var: &str, path: &Path) -> Result<Vec<u8>, StoreError> {
            std::fs::read(path).map_err(|e| {
                StoreError::Permanent(format!("cannot read {var} {}: {e}", path.display()))
            })
        }
        let invalid = |var: &str, path: &Path, why: String| {
            StoreError::Permanent(format!("invalid {var} {}: {why}", path.display()))
        };
        let chain = |var: &str, path: &Path, pem: &[u8]| {
            crate::pem::cert_chain(pem).map_err(|why| invalid(var, path, why))
        };
        let root_cert = match &self.ca_cert {
            Some(path) => {
                let pem = read("REDIS_TLS_CACERT", path)?;
                chain("REDIS_TLS_CACERT", path, &pem)?;
                Some(pem)
            }
            None => None,
        };
        let client_tls = match (&self.client_cert, &self.client_key) {
            (Some(cert_path), Some(key_path)) => {
                let client_cert = read("REDIS_TLS_CLIENT_CERT", cert_path)?;
                let certs = chain("REDIS_TLS_CLIENT_CERT", cert_path, &client_cert)?;
                let client_key = read("REDIS_TLS_CLIENT_KEY", key_path)?;
                let key = crate::pem::private_key(&client_key)
                    .map_err(|why| invalid("REDIS_TLS_CLIENT_KEY", key_path, why))?;
                let provider = rustls::crypto::ring::default_provider();
                crate::pem::key_pair(certs, key, &provider).map_err(|e| {
                    let (crate::pem::KeyPairError::Key(e) | crate::pem::KeyPairError::Mismatch(e)) =
                        e;
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
    pub(super) fn connection_infos(
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
pub(super) fn with_auth(
    settings: redis::RedisConnectionInfo,
    auth: &str,
) -> redis::RedisConnectionInfo {
    match auth.split_once(':') {
        Some((user, pass)) => settings.set_password(pass).set_username(user),
        None => settings.set_password(auth),
    }
}

/// A `rediss://` address.
pub(super) fn is_tls(info: &redis::ConnectionInfo) -> bool {
    matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. })
}

/// A standalone client for a `rediss://` URL with the configured roots and client certificate.
pub(super) fn tls_client(
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
