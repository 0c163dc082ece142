//! What [`start`](super::start) needs: the built [`Parts`] it serves (from `app::assemble`),
//! and the listen addresses, TLS, reload, xDS and drain settings as plain data
//! (`app::server_config` fills them from the settings, tests fill them directly), and why a
//! start can fail.

use super::{grpc, http, reload, tls, workers, xds};
use crate::service::RateLimiter;
use crate::telemetry::trace::Tracing;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
/// Default time in-flight requests get to finish after a shutdown starts.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(15);
/// How long sluice reports NOT_SERVING but still answers after SIGTERM (`SHUTDOWN_DRAIN_DELAY`):
/// longer than the shipped Envoy health check's interval x unhealthy threshold (1 s x 2) and
/// than an endpoint's removal usually takes to reach every Envoy in Kubernetes.
pub const DEFAULT_DRAIN_DELAY: Duration = Duration::from_secs(5);

/// Health-check service name envoyproxy/ratelimit registers, kept for existing probes.
pub const HEALTH_SERVICE_NAME: &str = "ratelimit";

/// Default time between two probes of the counter store by the health task.
pub const DEFAULT_HEALTH_INTERVAL: Duration = Duration::from_secs(1);

/// The gRPC health services sluice reports: the server (""), envoyproxy's name, the RLS and
/// the RLQS.
pub(super) const HEALTH_SERVICES: [&str; 4] = [
    "",
    HEALTH_SERVICE_NAME,
    grpc::RLS_SERVICE_NAME,
    crate::proto::RLQS_SERVICE_NAME,
];

/// envoyproxy's stats (`USE_STATSD`, `USE_PROMETHEUS`): see `telemetry/envoy_stats.rs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvoyStatsSettings {
    /// Where statsd lines go, and how often.
    pub statsd: Option<crate::telemetry::envoy_stats::StatsdSettings>,
    /// The listener (`PROMETHEUS_ADDR`; port 0 picks one) and path serving envoyproxy's series.
    pub prometheus: Option<(SocketAddr, String)>,
    /// `EXTRA_TAGS`.
    pub tags: Vec<(String, String)>,
}

/// The built parts a server serves: the decision engine (rules, store stack, options,
/// telemetry) and the trace export to flush at the end. Built by `app::assemble`.
#[derive(Debug)]
pub struct Parts {
    pub limiter: Arc<RateLimiter>,
    pub tracing: Option<Tracing>,
}

/// Everything [`start`] needs. Fields are public so `app.rs` (from the settings) and the tests
/// fill them directly.
#[derive(Debug)]
pub struct ServerConfig {
    /// What is served.
    pub parts: Parts,
    /// gRPC listen address; port 0 picks a free port (see [`Running::grpc_addr`]).
    pub grpc_addr: SocketAddr,
    /// HTTP admin listen address; port 0 picks a free port (see [`Running::http_addr`]).
    pub http_addr: SocketAddr,
    /// Upper bound on the drain after a shutdown starts; then remaining connections are dropped.
    pub shutdown_grace: Duration,
    /// NOT_SERVING but still answering, between the shutdown trigger and the drain. The
    /// library's default (and the tests') is zero; the binary's is [`DEFAULT_DRAIN_DELAY`].
    pub drain_delay: Duration,
    /// How often the health task probes the store (one PING for Redis) and updates the gRPC
    /// health status. The store is also probed once before [`start`] returns.
    pub health_interval: Duration,
    /// Live reload of the config; `None` keeps the initial rules for the process's life.
    pub reload: Option<reload::ReloadSettings>,
    /// Digest ([`crate::config::fingerprint`]) of the config tree taken just before `rules`
    /// were read, so reload sees any change made after that read.
    pub loaded_fingerprint: u64,
    /// Live reload of the candidate config (`CANDIDATE_CONFIG`) and the digest of what it was
    /// loaded from.
    pub candidate_reload: Option<(reload::ReloadSettings, u64)>,
    /// TLS (and mTLS) on the gRPC port; `None` serves plaintext. The HTTP admin port is always
    /// plaintext.
    pub grpc_tls: Option<tls::TlsSettings>,
    /// Threads serving gRPC, each on its own single-threaded runtime (see `workers.rs`); the
    /// calling runtime is one of them. 0 counts as 1.
    pub grpc_threads: usize,
    /// The Rate Limit Quota Service's bounds (`RLQS_*`).
    pub quota: crate::quota::QuotaSettings,
    /// Config over xDS (`CONFIG_TYPE=GRPC_XDS_SOTW`): the limiter then awaits its first config
    /// (requests get UNAVAILABLE until the management server's first config is accepted).
    pub xds: Option<xds::XdsSettings>,
    /// envoyproxy's stats, besides sluice's own `/metrics`; `None` sends and serves none.
    pub envoy_stats: Option<EnvoyStatsSettings>,
    /// `GRPC_UDS`: serve gRPC on this Unix socket instead of `grpc_addr` (plaintext only).
    pub grpc_uds: Option<PathBuf>,
    /// envoyproxy's debug listener (`DEBUG_HOST:DEBUG_PORT`; port 0 picks one). As there, a
    /// port that cannot be bound is logged and the service runs without it.
    pub debug_addr: Option<SocketAddr>,
    /// `GRPC_MAX_CONNECTION_AGE`; `None` never ages a connection out.
    pub connection_age: Option<ConnectionAge>,
    /// The gRPC listener's HTTP/2 and TCP bounds.
    pub http2: Http2Limits,
    /// `JSON_ENDPOINT`: serve `/json` on the plaintext HTTP port; `None`: only when gRPC is
    /// plaintext too (with TLS on, `/json` would let a caller without a certificate around it).
    pub json_endpoint: Option<bool>,
    /// The admin API's listener (`ADMIN_*`); `None` serves none (the overrides are still
    /// polled and applied).
    pub admin: Option<super::admin::AdminListen>,
    /// `JSON_ALLOW_NEGATIVE_HITS`: take `is_negative_hits` on `/json`; `None`: only when gRPC
    /// is plaintext (a refund zeroes a counter: whoever reaches the port could free anyone).
    pub json_negative_hits: Option<bool>,
}

/// The gRPC listener's per-connection bounds (settings/http2.rs says what each is for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Http2Limits {
    /// SETTINGS_MAX_CONCURRENT_STREAMS.
    pub max_concurrent_streams: u32,
    /// Keepalive: the idle time before a PING (and TCP probes), and how long its answer may
    /// take; `None` sends none.
    pub keepalive: Option<(Duration, Duration)>,
}

impl Default for Http2Limits {
    fn default() -> Self {
        Self {
            max_concurrent_streams: 1024,
            keepalive: Some((Duration::from_secs(60), Duration::from_secs(20))),
        }
    }
}

/// gRPC connections are asked to go (HTTP/2 GOAWAY, NO_ERROR) once older than `max`, as
/// grpc-go's `MaxConnectionAge` does for envoyproxy: a long-lived Envoy connection then moves
/// to replicas added since, and the server closes it once its calls in flight are answered.
/// grpc-go jitters each connection's age by ±10%; tonic takes one age per server, so each
/// serving thread draws its own jittered age (connections opened at different times still age
/// out apart). `GRPC_MAX_CONNECTION_AGE_GRACE` is not passed on: tonic 0.14's grace replaces
/// the GOAWAY with a bare close at age + grace (its `connection_timeout_future`), which would
/// cut every connection instead of moving it. See docs/migration.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionAge {
    pub max: Duration,
}

impl ConnectionAge {
    /// The longest `GRPC_MAX_CONNECTION_AGE` taken: Go's longest `time.Duration`
    /// (2562047h47m16s, about 292 years), so whatever envoyproxy accepted still starts, and
    /// anything longer is a settings error naming the variable instead of a panic when the age
    /// is jittered (issue 50: `18446744073709551615` panicked in `Duration::mul_f64`). `0`
    /// says "never".
    pub const LONGEST: Duration = Duration::from_secs(2_562_047 * 3600 + 47 * 60 + 16);

    /// `GRPC_MAX_CONNECTION_AGE` as Go writes durations, at most [`ConnectionAge::LONGEST`].
    pub fn parse(s: &str) -> Result<Duration, String> {
        let age = crate::duration::parse_go(s)?;
        if age > Self::LONGEST {
            return Err(format!(
                "GRPC_MAX_CONNECTION_AGE {s} is longer than 2562047h47m16s (Go's longest \
                 duration); 0 never ages a connection"
            ));
        }
        Ok(age)
    }

    /// `max` scaled by a factor in [0.9, 1.1] drawn from `seed`'s hash.
    pub(crate) fn jittered(&self, seed: u64) -> Duration {
        jittered(self.max, seed)
    }
}

/// `age` scaled by a factor in [0.9, 1.1] drawn from `seed`'s hash (so connections, and RLQS
/// streams, opened together do not all age out together); saturating, never a panic.
fn jittered(age: Duration, seed: u64) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(seed);
    let unit = (h.finish() >> 11) as f64 / (1u64 << 53) as f64;
    Duration::try_from_secs_f64(age.as_secs_f64() * (0.9 + 0.2 * unit)).unwrap_or(Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_absurd_connection_age_is_a_settings_error_and_jitter_never_panics() {
        let e = ConnectionAge::parse("18446744073709551615").expect_err("absurd");
        assert!(e.contains("GRPC_MAX_CONNECTION_AGE"), "{e}");
        assert!(e.contains("2562047h47m16s"), "{e}");
        assert_eq!(ConnectionAge::parse("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(ConnectionAge::parse("0"), Ok(Duration::ZERO));
        let longest = ConnectionAge::parse("2562047h47m16s").expect("Go's longest");
        for seed in 0..1000 {
            let j = jittered(longest, seed);
            assert!(
                j >= longest.mul_f64(0.9) && j <= longest.mul_f64(1.1),
                "{j:?}"
            );
        }
        assert!(jittered(Duration::MAX, 7) >= Duration::MAX / 2);
    }
}

impl ServerConfig {
    /// Serves `parts` on loopback on free ports for both servers, with the default grace period
    /// and no drain delay: the usual starting point of a test, which then overrides fields.
    pub fn new(parts: Parts) -> Self {
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        Self {
            parts,
            grpc_addr: loopback,
            http_addr: loopback,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            drain_delay: Duration::ZERO,
            health_interval: DEFAULT_HEALTH_INTERVAL,
            reload: None,
            loaded_fingerprint: 0,
            candidate_reload: None,
            grpc_tls: None,
            grpc_threads: workers::default_threads(),
            quota: crate::quota::QuotaSettings::default(),
            xds: None,
            envoy_stats: None,
            grpc_uds: None,
            debug_addr: None,
            connection_age: None,
            http2: Http2Limits::default(),
            json_endpoint: None,
            json_negative_hits: None,
            admin: Some(super::admin::AdminListen::loopback()),
        }
    }
}

impl ServerConfig {
    /// What `/json` serves: by default what plaintext gRPC would let anyone send anyway.
    pub(super) fn json_policy(&self) -> super::http::JsonPolicy {
        let plaintext = self.grpc_tls.is_none();
        super::http::JsonPolicy {
            serve: self.json_endpoint.unwrap_or(plaintext),
            negative_hits: self.json_negative_hits.unwrap_or(plaintext),
        }
    }
}

/// Why the servers could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen for {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot listen for {what} on the Unix socket {path}: {source}")]
    BindUnix {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("admin API: {0}")]
    Admin(String),
    #[error("{0}")]
    DecisionLog(String),
    #[error("not supported: {0}")]
    Unsupported(&'static str),
    #[error("cannot build gRPC reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("cannot set up /json transcoding: {0}")]
    Transcoder(#[from] http::TranscodeSetupError),
    #[error(transparent)]
    Metrics(#[from] crate::telemetry::metrics::MetricsError),
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error("cannot start OTLP trace export: {0}")]
    Tracing(#[from] crate::telemetry::trace::TraceError),
    #[error("cannot start {threads} gRPC serving threads: {source}")]
    Threads {
        threads: usize,
        source: std::io::Error,
    },
    #[error("gRPC server failed: {0}")]
    Grpc(#[from] tonic::transport::Error),
    #[error("HTTP admin server failed: {0}")]
    Http(std::io::Error),
    #[error("{0} server stopped before shutdown was requested")]
    StoppedEarly(&'static str),
    #[error("{what} server task failed: {source}")]
    Task {
        what: &'static str,
        source: tokio::task::JoinError,
    },
}
