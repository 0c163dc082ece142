//! What [`start`](super::start) needs: the listen addresses, rules, store, service options,
//! TLS, reload, tracing and drain settings as plain data (`app::server_config` fills them from
//! the settings, tests fill them directly), and why a start can fail.

use super::{grpc, http, reload, tls, workers, xds};
use crate::clock::{Clock, SystemClock};
use crate::config::RuleSet;
use crate::service::ServiceOptions;
use crate::store::CounterStore;
use crate::telemetry::trace::TraceSettings;
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

/// The gRPC health services sluice reports: the server (""), envoyproxy's name, and the RLS.
pub(super) const HEALTH_SERVICES: [&str; 3] = ["", HEALTH_SERVICE_NAME, grpc::RLS_SERVICE_NAME];

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

/// Everything [`start`] needs. Fields are public so `app.rs` (from the settings) and the tests
/// fill them directly.
#[derive(Debug)]
pub struct ServerConfig {
    /// gRPC listen address; port 0 picks a free port (see [`Running::grpc_addr`]).
    pub grpc_addr: SocketAddr,
    /// HTTP admin listen address; port 0 picks a free port (see [`Running::http_addr`]).
    pub http_addr: SocketAddr,
    /// The initial rules.
    pub rules: RuleSet,
    pub options: ServiceOptions,
    /// Time source of the default memory store (a `ManualClock` in tests).
    pub clock: Arc<dyn Clock>,
    /// Counter store; `None` builds a [`MemoryStore`] on `clock`.
    pub store: Option<Arc<dyn CounterStore>>,
    /// Upper bound on the drain after a shutdown starts; then remaining connections are dropped.
    pub shutdown_grace: Duration,
    /// NOT_SERVING but still answering, between the shutdown trigger and the drain. The
    /// library's default (and the tests') is zero; the binary's is [`DEFAULT_DRAIN_DELAY`].
    pub drain_delay: Duration,
    /// Where `rules` came from, for logs (and later reloads); `None` for in-memory rules.
    pub config_path: Option<PathBuf>,
    /// How often the health task probes the store (one PING for Redis) and updates the gRPC
    /// health status. The store is also probed once before [`start`] returns.
    pub health_interval: Duration,
    /// `TRACING_ENABLED`: export spans over OTLP with these settings; `None` traces nothing.
    pub tracing: Option<TraceSettings>,
    /// Live reload of the config; `None` keeps the initial rules for the process's life.
    pub reload: Option<reload::ReloadSettings>,
    /// Digest ([`crate::config::fingerprint`]) of the config tree taken just before `rules`
    /// were read, so reload sees any change made after that read.
    pub loaded_fingerprint: u64,
    /// TLS (and mTLS) on the gRPC port; `None` serves plaintext. The HTTP admin port is always
    /// plaintext.
    pub grpc_tls: Option<tls::TlsSettings>,
    /// Threads serving gRPC, each on its own single-threaded runtime (see `workers.rs`); the
    /// calling runtime is one of them. 0 counts as 1.
    pub grpc_threads: usize,
    /// Config over xDS (`CONFIG_TYPE=GRPC_XDS_SOTW`): `rules` are then empty and requests get
    /// UNAVAILABLE until the management server's first config is accepted.
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
    /// `max` scaled by a factor in [0.9, 1.1] drawn from `seed`'s hash.
    pub(super) fn jittered(&self, seed: u64) -> Duration {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(seed);
        let unit = (h.finish() >> 11) as f64 / (1u64 << 53) as f64;
        self.max.mul_f64(0.9 + 0.2 * unit)
    }
}

impl ServerConfig {
    /// Loopback on free ports for both servers, the system clock, a memory store, the default
    /// grace period: the usual starting point of a test, which then overrides fields.
    pub fn new(rules: RuleSet) -> Self {
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        Self {
            grpc_addr: loopback,
            http_addr: loopback,
            rules,
            options: ServiceOptions::default(),
            clock: Arc::new(SystemClock),
            store: None,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            drain_delay: Duration::ZERO,
            config_path: None,
            health_interval: DEFAULT_HEALTH_INTERVAL,
            tracing: None,
            reload: None,
            loaded_fingerprint: 0,
            grpc_tls: None,
            grpc_threads: workers::default_threads(),
            xds: None,
            envoy_stats: None,
            grpc_uds: None,
            debug_addr: None,
            connection_age: None,
        }
    }

    #[cfg(any(test, feature = "test-util"))]
    /// [`ServerConfig::new`] with `clock` driving the memory store: what in-process tests use
    /// (with a `ManualClock`), then override fields with struct update syntax.
    pub fn for_tests(rules: RuleSet, clock: Arc<dyn Clock>) -> Self {
        Self::new(rules).with_clock(clock)
    }

    /// Replaces the clock (the default memory store reads it).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Uses an explicit counter store instead of a memory store on `clock`.
    pub fn with_store(mut self, store: Arc<dyn CounterStore>) -> Self {
        self.store = Some(store);
        self
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
    #[error("cannot listen for gRPC on the Unix socket {path}: {source}")]
    BindUnix {
        path: PathBuf,
        source: std::io::Error,
    },
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
