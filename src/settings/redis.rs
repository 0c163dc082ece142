//! The Redis store's settings (`REDIS_*`, `FAILURE_MODE`'s parser, the breaker) and the URL
//! forms envoyproxy/ratelimit accepts, normalised to redis-rs URLs.

use super::{parse_duration, parse_go_bool, Secret, SettingsError};
use crate::duration::format_go;
use crate::service::FailureMode;
use crate::store::breaker::{BreakerSettings, DEFAULT_FAILURE_THRESHOLD};
use crate::store::redis::{
    redact_url, RedisKind, RedisSettings, RedisTlsSettings, SentinelSettings, DEFAULT_POOL_SIZE,
};
use clap::Args;
use std::path::PathBuf;
use std::time::Duration;
/// The Redis store. Without `REDIS_URL`, counters live in process memory.
#[derive(Debug, Clone, Args)]
pub struct RedisArgs {
    /// Redis address: `host:port` (as envoyproxy/ratelimit takes it), `redis://` or `rediss://`
    /// URLs, or a comma-separated list of them (the seeds of a Cluster).
    // `hide_env_values`: `--help` must not print a URL that may hold a password.
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    pub redis_url: Option<Secret>,

    /// `single` (one Redis), `cluster` (Redis Cluster; REDIS_URL lists seed nodes) or
    /// `sentinel` (REDIS_URL is `master_name,host:port,...`: the master's name, then the
    /// sentinels).
    #[arg(
        long,
        env = "REDIS_TYPE",
        default_value = "single",
        value_enum,
        ignore_case = true
    )]
    pub redis_type: RedisKind,

    /// Redis password, or `user:password` for an ACL user.
    #[arg(long, env = "REDIS_AUTH", hide_env_values = true)]
    pub redis_auth: Option<Secret>,

    /// With REDIS_TYPE=sentinel: the sentinels' password (or `user:password`); REDIS_AUTH
    /// stays the master's.
    #[arg(long, env = "REDIS_SENTINEL_AUTH", hide_env_values = true)]
    pub redis_sentinel_auth: Option<Secret>,

    /// Connect to Redis over TLS (plain `host:port` addresses become `rediss://`).
    #[arg(
        long,
        env = "REDIS_TLS",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub redis_tls: bool,

    /// PEM CA bundle that signs the Redis server certificate (default: the system roots).
    #[arg(long, env = "REDIS_TLS_CACERT")]
    pub redis_tls_cacert: Option<PathBuf>,

    /// PEM client certificate for Redis `tls-auth-clients yes` (with REDIS_TLS_CLIENT_KEY).
    #[arg(long, env = "REDIS_TLS_CLIENT_CERT")]
    pub redis_tls_client_cert: Option<PathBuf>,

    /// PEM private key of REDIS_TLS_CLIENT_CERT.
    #[arg(long, env = "REDIS_TLS_CLIENT_KEY")]
    pub redis_tls_client_key: Option<PathBuf>,

    /// Accept a Redis certificate whose names do not match the host (e.g. GCP Memorystore); the
    /// chain is still verified against the CA.
    #[arg(
        long,
        env = "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub redis_tls_skip_hostname_verification: bool,

    /// Multiplexed connections to a standalone Redis, and script calls kept outstanding on them.
    /// Not a cap on concurrent decisions: decisions that arrive while calls run go together in
    /// the next call.
    #[arg(long, env = "REDIS_POOL_SIZE", default_value_t = DEFAULT_POOL_SIZE,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub redis_pool_size: u32,

    /// Bound on every Redis round trip, connecting included (`500ms`, `1s`): a dead Redis never
    /// holds a request longer.
    #[arg(
        long,
        env = "REDIS_TIMEOUT",
        default_value = format_go(crate::store::redis::DEFAULT_TIMEOUT),
        value_parser = parse_duration
    )]
    pub redis_timeout: Duration,

    /// Prefix of every Redis key sluice writes.
    #[arg(long, env = "CACHE_KEY_PREFIX", default_value = "")]
    pub cache_key_prefix: String,

    /// Up to this many seconds are added to each Redis key's TTL (never more than the TTL
    /// itself), so keys written at one window edge do not all expire at once; 0 adds none.
    #[arg(long, env = "EXPIRATION_JITTER_MAX_SECONDS", default_value_t = 300)]
    pub expiration_jitter_max_seconds: u32,

    /// Consecutive Redis failures that open the circuit breaker (requests then fail at once).
    #[arg(long, env = "REDIS_BREAKER_THRESHOLD", default_value_t = DEFAULT_FAILURE_THRESHOLD,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub redis_breaker_threshold: u32,

    /// How long the open breaker answers at once before letting one request try Redis again.
    #[arg(
        long,
        env = "REDIS_BREAKER_OPEN",
        default_value = format_go(crate::store::breaker::DEFAULT_OPEN_FOR),
        value_parser = parse_duration
    )]
    pub redis_breaker_open: Duration,
}

/// `FAILURE_MODE`: `allow`, `deny` or `local`, case-insensitive.
pub fn parse_failure_mode(s: &str) -> Result<FailureMode, String> {
    s.parse()
}

impl RedisArgs {
    /// The Redis store's settings, or `None` for the memory store (no `REDIS_URL`, or an
    /// empty one). Fails on settings that can never work, before anything is started.
    pub fn settings(&self) -> Result<Option<RedisSettings>, SettingsError> {
        let Some(raw) = self.redis_url.as_ref().map(Secret::expose) else {
            return Ok(None);
        };
        if raw.trim().is_empty() {
            return Ok(None);
        }
        let (raw, sentinel) = match self.redis_type {
            RedisKind::Sentinel => {
                let (name, rest) = raw.split_once(',').unwrap_or((raw, ""));
                let name = name.trim();
                if name.is_empty() || name.contains(':') || name.contains('/') {
                    return Err(SettingsError::Redis(
                        "REDIS_TYPE=sentinel takes REDIS_URL=master_name,host:port[,host:port...]: \
                         the first item is the master's name as the sentinels monitor it"
                            .into(),
                    ));
                }
                let sentinel = SentinelSettings {
                    master_name: name.to_string(),
                    auth: self
                        .redis_sentinel_auth
                        .as_ref()
                        .map(|a| a.expose().to_string())
                        .filter(|a| !a.is_empty()),
                };
                if rest.split(',').all(|i| i.trim().is_empty()) {
                    return Err(SettingsError::Redis(format!(
                        "REDIS_TYPE=sentinel: REDIS_URL names no sentinel after the master's name \
                         {name:?} (REDIS_URL=master_name,host:port[,host:port...])"
                    )));
                }
                (rest, Some(sentinel))
            }
            _ => (raw, None),
        };
        let urls = normalize_redis_urls(raw, self.redis_tls)?;
        let kind = self.redis_type;

        if kind == RedisKind::Single && urls.len() > 1 {
            return Err(SettingsError::Redis(format!(
                "REDIS_URL lists {} addresses but REDIS_TYPE is single; set REDIS_TYPE=cluster \
                 for a Cluster's seed list",
                urls.len()
            )));
        }
        let tls = RedisTlsSettings {
            ca_cert: self.redis_tls_cacert.clone(),
            client_cert: self.redis_tls_client_cert.clone(),
            client_key: self.redis_tls_client_key.clone(),
            skip_hostname_verification: self.redis_tls_skip_hostname_verification,
        };
        if tls.client_cert.is_some() != tls.client_key.is_some() {
            return Err(SettingsError::Redis(
                "REDIS_TLS_CLIENT_CERT and REDIS_TLS_CLIENT_KEY must be set together".into(),
            ));
        }
        if tls != RedisTlsSettings::default() && !urls.iter().any(|u| u.starts_with("rediss://")) {
            // envoyproxy ignores them too without REDIS_TLS; say so, it is probably a mistake.
            tracing::warn!(
                "REDIS_TLS_* certificate settings are ignored: Redis is reached without TLS \
                 (set REDIS_TLS=true or use rediss:// URLs)"
            );
        }
        Ok(Some(RedisSettings {
            urls,
            kind,
            sentinel,
            auth: self
                .redis_auth
                .as_ref()
                .map(|a| a.expose().to_string())
                .filter(|a| !a.is_empty()),
            pool_size: self.redis_pool_size,
            timeout: self.redis_timeout,
            key_prefix: self.cache_key_prefix.clone(),
            expiration_jitter: Duration::from_secs(u64::from(self.expiration_jitter_max_seconds)),
            tls,
        }))
    }

    pub fn breaker(&self) -> BreakerSettings {
        BreakerSettings {
            failure_threshold: self.redis_breaker_threshold,
            open_for: self.redis_breaker_open,
            patience: self.redis_timeout,
        }
    }
}

/// `REDIS_URL` to connection URLs: a comma-separated list whose items are `host:port`
/// (envoyproxy/ratelimit's form, made `redis://host:port`, or `rediss://` with `tls`) or
/// `redis://` / `rediss://` URLs (kept; `tls` upgrades `redis://` to `rediss://`). Errors never
/// show credentials.
pub fn normalize_redis_urls(raw: &str, tls: bool) -> Result<Vec<String>, SettingsError> {
    let bad = |item: &str, why: &str| {
        let shown = if item.contains("://") {
            redact_url(item)
        } else if item.contains('@') {
            // Credentials in a form no URL parser understands: show none of it.
            "<redacted>".to_string()
        } else {
            item.to_string()
        };
        SettingsError::Redis(format!("invalid REDIS_URL entry {shown:?}: {why}"))
    };
    let mut urls = Vec::new();
    for item in raw.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        // redis-rs reads a `#insecure` fragment as "skip every certificate check": too quiet a
        // switch for that; REDIS_TLS_SKIP_HOSTNAME_VERIFICATION is the explicit, narrower one.
        if item.contains('#') {
            return Err(bad(
                item,
                "a URL fragment ('#...') is not accepted (to relax TLS checks, set \
                 REDIS_TLS_SKIP_HOSTNAME_VERIFICATION=true)",
            ));
        }
        let url = match item.split_once("://") {
            Some((scheme, rest)) => {
                let scheme = scheme.to_ascii_lowercase();
                let scheme = match scheme.as_str() {
                    "redis" if tls => "rediss",
                    "redis" | "rediss" => scheme.as_str(),
                    _ => {
                        return Err(bad(
                            item,
                            "the scheme must be redis:// or rediss:// (or give host:port)",
                        ))
                    }
                };
                if rest.is_empty() {
                    return Err(bad(item, "no host"));
                }
                format!("{scheme}://{rest}")
            }
            None => {
                // envoyproxy's form: host:port, nothing else.
                let (host, port) = item
                    .rsplit_once(':')
                    .ok_or_else(|| bad(item, "expected host:port or a redis:// URL"))?;
                if host.is_empty() || host.contains(['/', '@', '?', '#']) {
                    return Err(bad(item, "expected host:port or a redis:// URL"));
                }
                if port.parse::<u16>().is_err() {
                    return Err(bad(item, "the port must be a number up to 65535"));
                }
                let scheme = if tls { "rediss" } else { "redis" };
                format!("{scheme}://{host}:{port}")
            }
        };
        urls.push(url);
    }
    if urls.is_empty() {
        return Err(SettingsError::Redis("REDIS_URL holds no address".into()));
    }
    Ok(urls)
}
