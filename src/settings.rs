//! Command line and environment settings. Every flag falls back to the environment variable that
//! envoyproxy/ratelimit reads, so sluice runs as a drop-in for `/bin/ratelimit` configured by env
//! vars only; this module turns those raw values into a [`ServerConfig`] and nothing else.

use crate::clock::{Clock, SystemClock};
use crate::config::{load_path, ConfigErrors, LoadOptions, RuleSet};
use crate::server::reload::ReloadSettings;
use crate::server::tls::TlsSettings;
use crate::server::{ServerConfig, StoreChain};
use crate::service::headers::HeaderOptions;
use crate::service::{FailureMode, RequestCaps, ServiceOptions};
use crate::store::breaker::{BreakerSettings, DEFAULT_FAILURE_THRESHOLD};
use crate::store::redis::{
    redact_url, RedisKind, RedisSettings, RedisTlsSettings, SentinelSettings, DEFAULT_POOL_SIZE,
};
use crate::store::StoreError;
use crate::telemetry::trace::TraceSettings;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use std::ffi::OsStr;
use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

pub mod stats;
pub mod xds;

/// `sluice`: with no subcommand it serves, reading the same environment as envoyproxy/ratelimit.
#[derive(Debug, Parser)]
#[command(
    name = "sluice",
    version,
    about = "Envoy/Istio-compatible gRPC rate-limit service",
    // `sluice` alone (or with serve flags) means `sluice serve`; the flags of the default command
    // live at the top level, and clap rejects mixing them with an explicit subcommand.
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,

    /// Serve flags used when no subcommand is given.
    #[command(flatten)]
    pub serve: ServeArgs,

    #[command(flatten)]
    pub log: LogArgs,
}

impl Cli {
    /// Parses the process's arguments and environment, exiting with usage on error. An env var
    /// set to the empty string counts as unset (Kubernetes manifests often carry `value: ""`),
    /// so it falls back to the default instead of failing to parse.
    pub fn parse_args() -> Self {
        let cmd = ignore_empty_env(Cli::command(), &|name| {
            std::env::var_os(name).is_some_and(|v| v.is_empty())
        });
        let matches = cmd.get_matches();
        Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
    }

    /// The command to run, with `serve` as the default.
    pub fn into_command(self) -> (Command, LogArgs) {
        let command = self.command.unwrap_or(Command::Serve(self.serve));
        (command, self.log)
    }
}

// Parsed once at start; boxing `ServeArgs` would buy nothing and cost every match a deref.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the RLS gRPC API and the HTTP admin endpoints (the default).
    Serve(ServeArgs),
    /// Validate a config file or directory: print every error, exit 1 if there is any.
    Check(CheckArgs),
    /// Load generator for any RLS endpoint: decisions/s, OK / OVER_LIMIT / errors, latency.
    Bench(crate::bench::BenchArgs),
}

/// Logging, shared by every command.
#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Minimum log level (envoyproxy names: trace, debug, info, warn, error; case-insensitive).
    /// `RUST_LOG`, when set, overrides it with full filter directives.
    #[arg(
        long,
        env = "LOG_LEVEL",
        default_value = "info",
        value_enum,
        ignore_case = true,
        global = true
    )]
    pub log_level: LogLevel,

    /// Log line format on stderr.
    #[arg(
        long,
        env = "LOG_FORMAT",
        default_value = "text",
        value_enum,
        ignore_case = true,
        global = true
    )]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogLevel {
    Trace,
    Debug,
    Info,
    #[value(alias = "warning")]
    Warn,
    // logrus (envoyproxy) also has fatal and panic; both only ever log errors.
    #[value(alias = "fatal", alias = "panic")]
    Error,
}

impl LogLevel {
    pub fn as_tracing(self) -> tracing::Level {
        match self {
            LogLevel::Trace => tracing::Level::TRACE,
            LogLevel::Debug => tracing::Level::DEBUG,
            LogLevel::Info => tracing::Level::INFO,
            LogLevel::Warn => tracing::Level::WARN,
            LogLevel::Error => tracing::Level::ERROR,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// `sluice serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address the gRPC server listens on.
    #[arg(long, env = "GRPC_HOST", default_value = "0.0.0.0")]
    pub grpc_host: String,

    /// Port of the gRPC server (0 picks a free port).
    #[arg(long, env = "GRPC_PORT", default_value_t = 8081)]
    pub grpc_port: u16,

    /// Serve gRPC on this Unix socket instead of GRPC_HOST:GRPC_PORT (plaintext only).
    #[arg(long, env = "GRPC_UDS")]
    pub grpc_uds: Option<PathBuf>,

    /// Address of envoyproxy's debug listener (`/`, `/rlconfig`, `/stats`).
    #[arg(long, env = "DEBUG_HOST", default_value = "0.0.0.0")]
    pub debug_host: String,

    /// Port of the debug listener; one that cannot be bound is logged and skipped, as in
    /// envoyproxy.
    #[arg(long, env = "DEBUG_PORT", default_value_t = 6070)]
    pub debug_port: u16,

    /// Address the HTTP admin server listens on.
    #[arg(long, env = "HOST", default_value = "0.0.0.0")]
    pub host: String,

    /// Port of the HTTP admin server (0 picks a free port).
    #[arg(long, env = "PORT", default_value_t = 8080)]
    pub port: u16,

    /// Config file or directory of files. When absent, the envoyproxy runtime layout
    /// RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY is used.
    #[arg(long, env = "SLUICE_CONFIG")]
    pub config: Option<PathBuf>,

    #[command(flatten)]
    pub runtime: RuntimeArgs,

    #[command(flatten)]
    pub source: xds::ConfigSourceArgs,

    #[command(flatten)]
    pub stats: stats::StatsArgs,

    /// Decide and count as usual but always answer OK.
    #[arg(
        long,
        env = "SHADOW_MODE",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub shadow_mode: bool,

    /// Treat every limit as `quota_mode: true` (envoyproxy's global quota mode): a request is
    /// over limit only when all of its limits are.
    #[arg(
        long,
        env = "QUOTA_MODE",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub quota_mode: bool,

    /// Fill the response's `dynamic_metadata` as envoyproxy does: the domain, the descriptors
    /// and the config `metadata` of the descriptors that passed.
    #[arg(
        long,
        env = "RESPONSE_DYNAMIC_METADATA",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub response_dynamic_metadata: bool,

    /// Most descriptors one request may carry; a request over it gets INVALID_ARGUMENT before
    /// any store work (Envoy sends one per matching rate-limit action: a handful).
    #[arg(long, env = "MAX_DESCRIPTORS_PER_REQUEST", default_value_t = RequestCaps::default().descriptors,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_descriptors_per_request: u32,

    /// Most entries one descriptor may carry (INVALID_ARGUMENT above it).
    #[arg(long, env = "MAX_ENTRIES_PER_DESCRIPTOR", default_value_t = RequestCaps::default().entries,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_entries_per_descriptor: u32,

    /// Most bytes in a descriptor entry's key (INVALID_ARGUMENT above it).
    #[arg(long, env = "MAX_DESCRIPTOR_KEY_BYTES", default_value_t = RequestCaps::default().key_bytes,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_descriptor_key_bytes: u32,

    /// Most bytes in a descriptor entry's value, e.g. a path or a header (INVALID_ARGUMENT above
    /// it).
    #[arg(long, env = "MAX_DESCRIPTOR_VALUE_BYTES", default_value_t = RequestCaps::default().value_bytes,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_descriptor_value_bytes: u32,

    /// How long in-flight requests may run after SIGTERM/SIGINT (`15s`, `500ms`, `1m30s`).
    #[arg(
        long,
        env = "SHUTDOWN_GRACE_PERIOD",
        default_value = "15s",
        value_parser = parse_duration
    )]
    pub shutdown_grace: Duration,

    /// How long a gRPC connection may live before the server asks the client to reconnect (an
    /// HTTP/2 GOAWAY), so clients spread over new replicas; ±10% jitter; `0` never ages one.
    #[arg(
        long,
        env = "GRPC_MAX_CONNECTION_AGE",
        default_value = "24h",
        value_parser = parse_duration
    )]
    pub grpc_max_connection_age: Duration,

    /// envoyproxy's bound on a connection's life after its GOAWAY. Read and validated but not
    /// enforced: after the GOAWAY the connection closes once its calls in flight are answered
    /// (see [`crate::server::ConnectionAge`] for why no hard close is added).
    #[arg(
        long,
        env = "GRPC_MAX_CONNECTION_AGE_GRACE",
        default_value = "1h",
        value_parser = parse_duration
    )]
    pub grpc_max_connection_age_grace: Duration,

    /// Threads serving gRPC, each accepting connections on its own single-threaded runtime
    /// (default: the CPUs this process may use, cgroup quota included). A connection's requests
    /// are served by the thread that accepted it.
    #[arg(long, env = "WORKER_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub worker_threads: Option<u16>,

    #[command(flatten)]
    pub redis: RedisArgs,

    /// Counters the in-memory store holds at most (used when no `REDIS_URL` is set): about 100
    /// bytes each when full. Past it, the counter closest to expiry is evicted (it starts
    /// afresh, which can only ever admit more) and `sluice_memory_evictions_total` counts it.
    #[arg(long, env = "MEMORY_MAX_COUNTERS", default_value_t = crate::store::memory::DEFAULT_MAX_COUNTERS,
        value_parser = parse_max_counters)]
    pub memory_max_counters: usize,

    /// Bytes of the local deny cache (0 = off): a counter known to be over its limit is denied
    /// locally until its window resets, without a Redis call.
    #[arg(long, env = "LOCAL_CACHE_SIZE_IN_BYTES", default_value_t = 0)]
    pub local_cache_size_in_bytes: usize,

    /// What to answer when the counter store fails: `allow` (OK) or `deny` (OVER_LIMIT). Unset,
    /// sluice answers gRPC UNAVAILABLE and Envoy's `failure_mode_deny` decides.
    #[arg(long, env = "FAILURE_MODE", value_parser = parse_failure_mode)]
    pub failure_mode: Option<FailureMode>,

    #[command(flatten)]
    pub observe: ObserveArgs,

    #[command(flatten)]
    pub tls: TlsArgs,
}

/// TLS on the gRPC port, with envoyproxy/ratelimit's names. The HTTP admin port stays plaintext.
#[derive(Debug, Clone, Args)]
pub struct TlsArgs {
    /// Serve gRPC over TLS with GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY.
    #[arg(
        long,
        env = "GRPC_SERVER_USE_TLS",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub grpc_server_use_tls: bool,

    /// PEM certificate chain of the gRPC server (reloaded when the file changes).
    #[arg(long, env = "GRPC_SERVER_TLS_CERT")]
    pub grpc_server_tls_cert: Option<PathBuf>,

    /// PEM private key of the gRPC server (reloaded when the file changes).
    #[arg(long, env = "GRPC_SERVER_TLS_KEY")]
    pub grpc_server_tls_key: Option<PathBuf>,

    /// PEM CA bundle: when set, clients must present a certificate signed by it (mutual TLS).
    #[arg(long, env = "GRPC_CLIENT_TLS_CACERT")]
    pub grpc_client_tls_cacert: Option<PathBuf>,
}

impl TlsArgs {
    /// The gRPC TLS settings, or `None` for plaintext. The files are read (and checked) when the
    /// server starts.
    pub fn grpc_tls(&self) -> Result<Option<TlsSettings>, SettingsError> {
        // clap refuses an empty path, and an empty env var counts as unset (`ignore_empty_env`).
        let cert = self.grpc_server_tls_cert.clone();
        let key = self.grpc_server_tls_key.clone();
        let ca = self.grpc_client_tls_cacert.clone();
        if !self.grpc_server_use_tls {
            // Serving plaintext while the operator expects every client to show a certificate
            // would silently drop the authentication they asked for.
            if ca.is_some() {
                return Err(SettingsError::Tls(
                    "GRPC_CLIENT_TLS_CACERT is set but GRPC_SERVER_USE_TLS is not true: \
                     refusing to serve gRPC in plaintext when client certificates are expected"
                        .into(),
                ));
            }
            // envoyproxy ignores them too; say so, since it is probably not what was meant.
            if cert.is_some() || key.is_some() {
                tracing::warn!(
                    "GRPC_SERVER_TLS_CERT/GRPC_SERVER_TLS_KEY are ignored: GRPC_SERVER_USE_TLS is \
                     not true, gRPC is served in plaintext"
                );
            }
            return Ok(None);
        }
        let (Some(cert), Some(key)) = (cert, key) else {
            return Err(SettingsError::Tls(
                "GRPC_SERVER_USE_TLS=true needs both GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY \
                 (PEM files)"
                    .into(),
            ));
        };
        let settings = TlsSettings::new(cert, key);
        Ok(Some(match ca {
            Some(ca) => settings.with_client_ca(ca),
            None => settings,
        }))
    }
}

/// Metrics, response headers and traces.
#[derive(Debug, Clone, Args)]
pub struct ObserveArgs {
    /// Share of a limit past which allowed hits count as `near_limit` in metrics (0..=1).
    #[arg(long, env = "NEAR_LIMIT_RATIO", default_value = "0.8", value_parser = parse_ratio)]
    pub near_limit_ratio: f64,

    /// Add `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset` (and `Retry-After` on
    /// OVER_LIMIT) to the response headers Envoy sends the client.
    #[arg(
        long,
        env = "LIMIT_RESPONSE_HEADERS_ENABLED",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub limit_response_headers_enabled: bool,

    /// Name of the header with the most restrictive limit's quota.
    #[arg(long, env = "LIMIT_LIMIT_HEADER", default_value = "RateLimit-Limit", value_parser = parse_header_name)]
    pub limit_limit_header: String,

    /// Name of the header with the hits left in its window.
    #[arg(long, env = "LIMIT_REMAINING_HEADER", default_value = "RateLimit-Remaining", value_parser = parse_header_name)]
    pub limit_remaining_header: String,

    /// Name of the header with the seconds until its window resets.
    #[arg(long, env = "LIMIT_RESET_HEADER", default_value = "RateLimit-Reset", value_parser = parse_header_name)]
    pub limit_reset_header: String,

    /// `ietf`: also send the IETF draft pair `RateLimit-Policy` and `RateLimit`.
    #[arg(long, env = "RATELIMIT_HEADERS_DRAFT", value_enum, ignore_case = true)]
    pub ratelimit_headers_draft: Option<HeadersDraft>,

    /// Export traces over OTLP (gRPC) to OTEL_EXPORTER_OTLP_ENDPOINT.
    #[arg(
        long,
        env = "TRACING_ENABLED",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub tracing_enabled: bool,

    /// OTLP gRPC endpoint of an OpenTelemetry Collector (or any OTLP receiver).
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_ENDPOINT",
        default_value = "http://localhost:4317"
    )]
    pub otel_exporter_otlp_endpoint: String,

    /// `service.name` of the exported spans.
    #[arg(long, env = "OTEL_SERVICE_NAME", default_value = "sluice")]
    pub otel_service_name: String,

    /// Share of root traces sampled (0..=1); a sampled incoming `traceparent` is always followed.
    #[arg(long, env = "TRACING_SAMPLING_RATE", default_value = "1", value_parser = parse_ratio)]
    pub tracing_sampling_rate: f64,

    /// envoyproxy/ratelimit's exporter protocol: only `grpc` is supported (OTLP over HTTP is
    /// refused at start rather than silently dropping spans).
    #[arg(long, env = "TRACING_EXPORTER_PROTOCOL", default_value = "grpc", value_parser = parse_exporter_protocol)]
    pub tracing_exporter_protocol: String,
}

/// `RATELIMIT_HEADERS_DRAFT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HeadersDraft {
    /// draft-ietf-httpapi-ratelimit-headers: `RateLimit-Policy` and `RateLimit`.
    Ietf,
}

impl ObserveArgs {
    /// The response headers to add, or `None` when disabled.
    pub fn headers(&self) -> Option<HeaderOptions> {
        self.limit_response_headers_enabled.then(|| HeaderOptions {
            limit: self.limit_limit_header.clone(),
            remaining: self.limit_remaining_header.clone(),
            reset: self.limit_reset_header.clone(),
            ietf_draft: self.ratelimit_headers_draft == Some(HeadersDraft::Ietf),
        })
    }

    /// The trace export settings, or `None` when disabled.
    pub fn tracing(&self) -> Option<TraceSettings> {
        self.tracing_enabled.then(|| TraceSettings {
            endpoint: self.otel_exporter_otlp_endpoint.clone(),
            service_name: self.otel_service_name.clone(),
            sampling_rate: self.tracing_sampling_rate,
        })
    }
}

/// A number in `0..=1` (`NEAR_LIMIT_RATIO`, `TRACING_SAMPLING_RATE`).
pub fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!(
            "invalid ratio {s:?} (a number from 0 to 1, e.g. 0.8)"
        )),
    }
}

/// A valid HTTP header name (Envoy rejects a response carrying an invalid one).
pub fn parse_header_name(s: &str) -> Result<String, String> {
    let s = s.trim();
    axum::http::HeaderName::try_from(s)
        .map(|_| s.to_string())
        .map_err(|_| format!("invalid HTTP header name {s:?}"))
}

/// `grpc` only.
pub fn parse_exporter_protocol(s: &str) -> Result<String, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "grpc" => Ok("grpc".into()),
        other => Err(format!(
            "unsupported trace exporter protocol {other:?}: sluice exports OTLP over gRPC only \
             (point OTEL_EXPORTER_OTLP_ENDPOINT at the collector's gRPC port, usually 4317)"
        )),
    }
}

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
    pub redis_type: RedisType,

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
        default_value = DEFAULT_REDIS_TIMEOUT,
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
        default_value = DEFAULT_BREAKER_OPEN,
        value_parser = parse_duration
    )]
    pub redis_breaker_open: Duration,
}

/// `REDIS_TYPE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RedisType {
    Single,
    Cluster,
    Sentinel,
}

/// `REDIS_TIMEOUT`'s default as clap reads it; a test checks it equals
/// [`crate::store::redis::DEFAULT_TIMEOUT`].
const DEFAULT_REDIS_TIMEOUT: &str = "100ms";
/// `REDIS_BREAKER_OPEN`'s default; a test checks it equals
/// [`crate::store::breaker::DEFAULT_OPEN_FOR`].
const DEFAULT_BREAKER_OPEN: &str = "1s";

/// `FAILURE_MODE`: `allow` or `deny`, case-insensitive.
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
            RedisType::Sentinel => {
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
        let kind = match self.redis_type {
            RedisType::Single => RedisKind::Single,
            RedisType::Cluster => RedisKind::Cluster,
            RedisType::Sentinel => RedisKind::Sentinel,
        };

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

/// The envoyproxy/ratelimit runtime directory layout.
#[derive(Debug, Clone, Args)]
pub struct RuntimeArgs {
    // Strings, not paths: an empty part is valid (it vanishes from the composed path).
    /// Root of the runtime directory tree.
    #[arg(
        long,
        env = "RUNTIME_ROOT",
        default_value = "/srv/runtime_data/current"
    )]
    pub runtime_root: String,

    /// Directory under the root (Istio's sample uses `ratelimit`).
    #[arg(long, env = "RUNTIME_SUBDIRECTORY", default_value = "")]
    pub runtime_subdirectory: String,

    /// Directory under the subdirectory that holds the config files.
    #[arg(long, env = "RUNTIME_APPDIRECTORY", default_value = "config")]
    pub runtime_appdirectory: String,

    /// Skip files and directories whose name starts with `.` (Kubernetes ConfigMap mounts hold
    /// `..data` symlinks).
    #[arg(
        long,
        env = "RUNTIME_IGNOREDOTFILES",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub runtime_ignoredotfiles: bool,

    /// envoyproxy's switch between watching the runtime root (a swapped `RUNTIME_ROOT` symlink)
    /// or the config directory (a ConfigMap's `..data` swap). Accepted for compatibility: sluice
    /// re-reads the whole tree from `RUNTIME_ROOT` down, following symlinks, so it sees both.
    #[arg(
        long,
        env = "RUNTIME_WATCH_ROOT",
        default_value = "true",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub runtime_watch_root: bool,

    /// How often the config files are checked for changes (`1s`, `500ms`); `0` turns live
    /// reload off.
    #[arg(
        long,
        env = "CONFIG_RELOAD_INTERVAL",
        default_value = "1s",
        value_parser = parse_duration
    )]
    pub config_reload_interval: Duration,
}

impl RuntimeArgs {
    /// ROOT/SUBDIRECTORY/APPDIRECTORY, as envoyproxy/ratelimit composes it (empty parts vanish).
    pub fn config_dir(&self) -> PathBuf {
        Path::new(&self.runtime_root)
            .join(&self.runtime_subdirectory)
            .join(&self.runtime_appdirectory)
    }
}

/// Drops the env fallback of every argument whose variable `is_empty` says is set but empty.
pub fn ignore_empty_env(cmd: clap::Command, is_empty: &dyn Fn(&OsStr) -> bool) -> clap::Command {
    cmd.mut_args(|a| {
        if a.get_env().is_some_and(is_empty) {
            a.env(None)
        } else {
            a
        }
    })
    .mut_subcommands(|sub| ignore_empty_env(sub, is_empty))
}

/// `sluice check PATH`.
#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    /// Config file or directory to validate.
    pub path: PathBuf,

    /// Skip files and directories whose name starts with `.`.
    #[arg(
        long,
        env = "RUNTIME_IGNOREDOTFILES",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub ignore_dotfiles: bool,

    /// Merge files with the same domain (as the service does with MERGE_DOMAIN_CONFIG=true).
    #[arg(
        long,
        env = "MERGE_DOMAIN_CONFIG",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub merge_domain_config: bool,
}

/// A setting that may carry credentials (a Redis URL with a password, later tokens): `Debug`
/// never shows its value, so logging the settings can never leak it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The raw value, for the one place that needs it (connecting).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_string()))
    }
}

/// Why `serve` cannot start from these settings.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("{0}")]
    Redis(String),
    #[error("{0}")]
    Tls(String),
    #[error("cannot set up the Redis store: {0}")]
    Store(#[from] StoreError),
    #[error("cannot resolve {what} address {host}:{port}: {reason}")]
    Resolve {
        what: &'static str,
        host: String,
        port: u16,
        reason: String,
    },
    #[error("invalid config in {path}:\n{errors}")]
    Config { path: PathBuf, errors: ConfigErrors },
    #[error("{0}")]
    Xds(String),
    #[error("{0}")]
    Stats(String),
}

impl ServeArgs {
    /// The config file or directory to load: `--config`, else the runtime layout.
    pub fn config_path(&self) -> PathBuf {
        self.config
            .clone()
            .unwrap_or_else(|| self.runtime.config_dir())
    }

    pub fn load_options(&self) -> LoadOptions {
        LoadOptions {
            ignore_dotfiles: self.runtime.runtime_ignoredotfiles,
            merge_domains: self.source.merge_domain_config,
        }
    }

    /// The one place that decides which counter store `serve` uses: `None` for the memory
    /// store (no `REDIS_URL`), else the Redis store behind its circuit breaker and, with
    /// `LOCAL_CACHE_SIZE_IN_BYTES` > 0, the local deny cache. Never touches the network, so an
    /// unreachable Redis is a health state, not a start-up failure.
    pub fn store_chain(&self) -> Result<Option<StoreChain>, SettingsError> {
        Ok(self.redis.settings()?.map(|redis| StoreChain {
            redis,
            breaker: self.redis.breaker(),
            local_cache_bytes: self.local_cache_size_in_bytes,
        }))
    }

    /// Resolves addresses, builds the store and loads the config: everything `serve` needs
    /// before it binds. Fails before any port is opened.
    pub fn server_config(&self) -> Result<ServerConfig, SettingsError> {
        let chain = self.store_chain()?;
        let grpc_tls = self.tls.grpc_tls()?;
        let grpc_addr = resolve("gRPC", &self.grpc_host, self.grpc_port)?;
        let http_addr = resolve("HTTP", &self.host, self.port)?;
        let xds = self.source.xds()?;
        let path = self.config_path();
        // Taken before the read: a change made after it is seen by the first reload check.
        let loaded_fingerprint = match xds {
            None => crate::config::fingerprint(&path, &self.load_options()),
            Some(_) => 0,
        };
        let rules = match xds {
            None => load_rules(&path, &self.load_options())?,
            // The management server brings the rules.
            Some(_) => RuleSet::empty(),
        };
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let store = match &chain {
            Some(chain) => {
                tracing::info!(
                    kind = ?chain.redis.kind,
                    urls = ?chain.redis.urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>(),
                    timeout = ?chain.redis.timeout,
                    tls = ?chain.redis.tls,
                    local_cache_bytes = chain.local_cache_bytes,
                    "using the Redis store"
                );
                Some(chain.build(Arc::clone(&clock))?)
            }
            None => {
                tracing::info!(
                    max_counters = self.memory_max_counters,
                    "using the in-memory store (counters are per process)"
                );
                Some(
                    Arc::new(crate::store::memory::MemoryStore::with_max_counters(
                        Arc::clone(&clock),
                        self.memory_max_counters,
                    )) as Arc<dyn crate::store::CounterStore>,
                )
            }
        };
        let mut config = ServerConfig::new(rules).with_clock(clock);
        config.grpc_addr = grpc_addr;
        config.http_addr = http_addr;
        config.options = ServiceOptions {
            global_shadow_mode: self.shadow_mode,
            global_quota_mode: self.quota_mode,
            failure_mode: self.failure_mode,
            near_limit_ratio: self.observe.near_limit_ratio,
            headers: self.observe.headers(),
            caps: RequestCaps {
                descriptors: self.max_descriptors_per_request,
                entries: self.max_entries_per_descriptor,
                key_bytes: self.max_descriptor_key_bytes,
                value_bytes: self.max_descriptor_value_bytes,
            },
            ready_needs_config: self.source.ready_needs_config(),
            response_dynamic_metadata: self.response_dynamic_metadata,
        };
        config.tracing = self.observe.tracing();
        config.grpc_tls = grpc_tls;
        config.loaded_fingerprint = loaded_fingerprint;
        let interval = self.runtime.config_reload_interval;
        config.reload = (xds.is_none() && !interval.is_zero()).then(|| ReloadSettings {
            path: path.clone(),
            options: self.load_options(),
            interval,
        });
        config.store = store;
        config.shutdown_grace = self.shutdown_grace;
        config.connection_age =
            (!self.grpc_max_connection_age.is_zero()).then_some(crate::server::ConnectionAge {
                max: self.grpc_max_connection_age,
            });
        if let Some(n) = self.worker_threads {
            config.grpc_threads = usize::from(n);
        }
        config.config_path = xds.is_none().then_some(path);
        config.xds = xds;
        config.envoy_stats = self.stats.settings()?;
        if self.grpc_uds.is_some() && config.grpc_tls.is_some() {
            return Err(SettingsError::Tls(
                "GRPC_UDS and GRPC_SERVER_USE_TLS are both set: sluice serves a Unix socket in \
                 plaintext only"
                    .into(),
            ));
        }
        config.grpc_uds = self.grpc_uds.clone();
        config.debug_addr = Some(resolve("debug", &self.debug_host, self.debug_port)?);
        Ok(config)
    }
}

/// `MEMORY_MAX_COUNTERS`: at least 1 (a store that keeps no counter would enforce no limit).
fn parse_max_counters(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1: a store holding no counter enforces no limit".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("not a number of counters: {e}")),
    }
}

fn load_rules(path: &Path, opts: &LoadOptions) -> Result<RuleSet, SettingsError> {
    load_path(path, opts).map_err(|errors| SettingsError::Config {
        path: path.to_path_buf(),
        errors,
    })
}

/// `host:port` to a socket address. Hosts are usually IPs (`0.0.0.0`, `::`), but names such as
/// `localhost` work too, as with Go's net.Listen.
fn resolve(what: &'static str, host: &str, port: u16) -> Result<SocketAddr, SettingsError> {
    let err = |reason: String| SettingsError::Resolve {
        what,
        host: host.to_string(),
        port,
        reason,
    };
    // Accept `[::1]` as well as `::1`.
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if let Ok(ip) = bare.parse::<std::net::IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    (bare, port)
        .to_socket_addrs()
        .map_err(|e| err(e.to_string()))?
        .next()
        .ok_or_else(|| err("no address found".to_string()))
}

/// envconfig's map syntax, `key:value,key:value`: trimmed pairs, empty entries skipped; an entry
/// without `:` is an error naming `setting`.
fn key_value_list<'a>(s: &'a str, setting: &str) -> Result<Vec<(&'a str, &'a str)>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|entry| {
            entry
                .split_once(':')
                .map(|(k, v)| (k.trim(), v.trim()))
                .ok_or_else(|| format!("{setting} entry {entry:?} is not key:value"))
        })
        .collect()
}

/// Go's `strconv.ParseBool`, which envoyproxy/ratelimit uses for its boolean env vars.
pub fn parse_go_bool(s: &str) -> Result<bool, String> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(format!(
            "invalid boolean {s:?} (use true/false/1/0/t/f/TRUE/FALSE/True/False)"
        )),
    }
}

/// A duration as Go's `time.ParseDuration` writes them (`15s`, `500ms`, `1m30s`, `1.5h`, units
/// ns/us/µs/ms/s/m/h, plus `d` for days); a bare number means seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("invalid duration {s:?} (examples: 15s, 500ms, 1m30s)");
    let t = s.trim();
    if t.is_empty() {
        return Err(bad());
    }
    if let Ok(secs) = t.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    let mut total = Duration::ZERO;
    let mut rest = t;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        let (num, tail) = rest.split_at(num_len);
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let value: f64 = num.parse().map_err(|_| bad())?;
        let scale = match unit {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            "d" => 86_400.0,
            _ => return Err(bad()),
        };
        let part = Duration::try_from_secs_f64(value * scale).map_err(|_| bad())?;
        total = total.checked_add(part).ok_or_else(bad)?;
        rest = tail;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_max_counters_must_keep_at_least_one() {
        assert_eq!(parse_max_counters("10000"), Ok(10_000));
        let e = parse_max_counters("0").expect_err("0 keeps nothing");
        assert!(e.contains("at least 1"), "{e}");
        assert!(parse_max_counters("-1").is_err());
        let e = parse(&["--memory-max-counters", "0"]).expect_err("refused at start");
        assert!(e.to_string().contains("at least 1"), "{e}");
        assert!(parse(&["--memory-max-counters", "5"]).is_ok());
    }

    #[test]
    fn worker_threads_default_to_the_cpus_and_refuse_zero() {
        let s = serve_args(parse(&[]).unwrap());
        assert_eq!(s.worker_threads, None, "unset: one serving thread per CPU");
        let s = serve_args(parse(&["--worker-threads", "3"]).unwrap());
        assert_eq!(s.worker_threads, Some(3));
        let e = parse(&["--worker-threads", "0"]).expect_err("no thread serves nothing");
        assert!(e.to_string().contains("worker-threads"), "{e}");
    }

    /// Parses `args` as if no environment variable were set: the env fallbacks are stripped from
    /// the command, so the tests neither depend on nor mutate the process environment (which
    /// other test threads read concurrently). The env names themselves are checked separately.
    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        let cmd = strip_env(Cli::command());
        let argv = std::iter::once("sluice").chain(args.iter().copied());
        let matches = cmd.try_get_matches_from(argv)?;
        Cli::from_arg_matches(&matches)
    }

    fn strip_env(cmd: clap::Command) -> clap::Command {
        cmd.mut_args(|a| a.env(None))
            .mut_subcommands(|sub| sub.mut_args(|a| a.env(None)))
    }

    fn serve_args(cli: Cli) -> ServeArgs {
        match cli.into_command().0 {
            Command::Serve(s) => s,
            other => panic!("expected serve, got {other:?}"),
        }
    }

    /// Env var name of the flag `long` in `cmd`.
    fn env_of(cmd: &clap::Command, long: &str) -> Option<String> {
        cmd.get_arguments()
            .find(|a| a.get_long() == Some(long))
            .and_then(|a| a.get_env())
            .map(|e| e.to_string_lossy().into_owned())
    }

    #[test]
    fn env_names_of_envoyproxy() {
        let cmd = Cli::command();
        let serve = cmd
            .find_subcommand("serve")
            .cloned()
            .unwrap_or_else(|| panic!("no serve subcommand"));
        for (long, env) in [("log-level", "LOG_LEVEL"), ("log-format", "LOG_FORMAT")] {
            assert_eq!(env_of(&cmd, long).as_deref(), Some(env), "--{long}");
        }
        for c in [&cmd, &serve] {
            for (long, env) in [
                ("grpc-host", "GRPC_HOST"),
                ("grpc-port", "GRPC_PORT"),
                ("host", "HOST"),
                ("port", "PORT"),
                ("config", "SLUICE_CONFIG"),
                ("runtime-root", "RUNTIME_ROOT"),
                ("runtime-subdirectory", "RUNTIME_SUBDIRECTORY"),
                ("runtime-appdirectory", "RUNTIME_APPDIRECTORY"),
                ("runtime-ignoredotfiles", "RUNTIME_IGNOREDOTFILES"),
                ("runtime-watch-root", "RUNTIME_WATCH_ROOT"),
                ("config-reload-interval", "CONFIG_RELOAD_INTERVAL"),
                ("shadow-mode", "SHADOW_MODE"),
                ("shutdown-grace", "SHUTDOWN_GRACE_PERIOD"),
                ("grpc-max-connection-age", "GRPC_MAX_CONNECTION_AGE"),
                (
                    "grpc-max-connection-age-grace",
                    "GRPC_MAX_CONNECTION_AGE_GRACE",
                ),
                ("redis-url", "REDIS_URL"),
                ("redis-type", "REDIS_TYPE"),
                ("redis-auth", "REDIS_AUTH"),
                ("redis-sentinel-auth", "REDIS_SENTINEL_AUTH"),
                ("redis-tls", "REDIS_TLS"),
                ("redis-tls-cacert", "REDIS_TLS_CACERT"),
                ("redis-tls-client-cert", "REDIS_TLS_CLIENT_CERT"),
                ("redis-tls-client-key", "REDIS_TLS_CLIENT_KEY"),
                (
                    "redis-tls-skip-hostname-verification",
                    "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
                ),
                ("grpc-server-use-tls", "GRPC_SERVER_USE_TLS"),
                ("grpc-server-tls-cert", "GRPC_SERVER_TLS_CERT"),
                ("grpc-server-tls-key", "GRPC_SERVER_TLS_KEY"),
                ("grpc-client-tls-cacert", "GRPC_CLIENT_TLS_CACERT"),
                ("redis-pool-size", "REDIS_POOL_SIZE"),
                ("redis-timeout", "REDIS_TIMEOUT"),
                ("cache-key-prefix", "CACHE_KEY_PREFIX"),
                ("redis-breaker-threshold", "REDIS_BREAKER_THRESHOLD"),
                ("redis-breaker-open", "REDIS_BREAKER_OPEN"),
                ("local-cache-size-in-bytes", "LOCAL_CACHE_SIZE_IN_BYTES"),
                ("memory-max-counters", "MEMORY_MAX_COUNTERS"),
                ("worker-threads", "WORKER_THREADS"),
                ("failure-mode", "FAILURE_MODE"),
                ("near-limit-ratio", "NEAR_LIMIT_RATIO"),
                (
                    "limit-response-headers-enabled",
                    "LIMIT_RESPONSE_HEADERS_ENABLED",
                ),
                ("limit-limit-header", "LIMIT_LIMIT_HEADER"),
                ("limit-remaining-header", "LIMIT_REMAINING_HEADER"),
                ("limit-reset-header", "LIMIT_RESET_HEADER"),
                ("ratelimit-headers-draft", "RATELIMIT_HEADERS_DRAFT"),
                ("tracing-enabled", "TRACING_ENABLED"),
                ("otel-exporter-otlp-endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT"),
                ("otel-service-name", "OTEL_SERVICE_NAME"),
                ("tracing-sampling-rate", "TRACING_SAMPLING_RATE"),
                ("tracing-exporter-protocol", "TRACING_EXPORTER_PROTOCOL"),
            ] {
                assert_eq!(env_of(c, long).as_deref(), Some(env), "--{long}");
            }
        }
    }

    #[test]
    fn observability_settings() {
        let s = serve_args(parse(&[]).unwrap());
        assert_eq!(s.observe.near_limit_ratio, 0.8);
        assert_eq!(s.observe.headers(), None, "headers are opt-in");
        assert_eq!(s.observe.tracing(), None, "tracing is opt-in");

        let s = serve_args(
            parse(&[
                "--near-limit-ratio=0.5",
                "--limit-response-headers-enabled=true",
                "--limit-remaining-header=X-Left",
                "--ratelimit-headers-draft=IETF",
                "--tracing-enabled",
                "--otel-exporter-otlp-endpoint=http://collector:4317",
                "--tracing-sampling-rate=0.25",
            ])
            .unwrap(),
        );
        assert_eq!(s.observe.near_limit_ratio, 0.5);
        assert_eq!(
            s.observe.headers(),
            Some(HeaderOptions {
                limit: "RateLimit-Limit".into(),
                remaining: "X-Left".into(),
                reset: "RateLimit-Reset".into(),
                ietf_draft: true,
            })
        );
        assert_eq!(
            s.observe.tracing(),
            Some(TraceSettings {
                endpoint: "http://collector:4317".into(),
                service_name: "sluice".into(),
                sampling_rate: 0.25,
            })
        );

        for bad in [
            "--near-limit-ratio=1.5",
            "--near-limit-ratio=x",
            "--tracing-sampling-rate=-0.1",
            "--limit-limit-header=bad header",
            "--ratelimit-headers-draft=rfc",
            "--tracing-exporter-protocol=http",
        ] {
            let e = parse(&[bad]).map(|_| ()).unwrap_err().to_string();
            assert!(
                e.contains("invalid") || e.contains("unsupported"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn empty_env_values_count_as_unset() {
        let cmd = ignore_empty_env(Cli::command(), &|n| n == "SHADOW_MODE" || n == "GRPC_PORT");
        assert_eq!(env_of(&cmd, "shadow-mode"), None);
        assert_eq!(env_of(&cmd, "grpc-port"), None);
        assert_eq!(env_of(&cmd, "port").as_deref(), Some("PORT"));
        let serve = cmd
            .find_subcommand("serve")
            .unwrap_or_else(|| panic!("no serve subcommand"));
        assert_eq!(env_of(serve, "shadow-mode"), None);
        assert_eq!(env_of(serve, "host").as_deref(), Some("HOST"));
    }

    #[test]
    fn defaults_match_envoyproxy() {
        let cli = parse(&[]).unwrap();
        assert_eq!(cli.log.log_level, LogLevel::Info);
        assert_eq!(cli.log.log_format, LogFormat::Text);
        let s = serve_args(cli);
        assert_eq!(s.grpc_host, "0.0.0.0");
        assert_eq!(s.grpc_port, 8081);
        assert_eq!(s.host, "0.0.0.0");
        assert_eq!(s.port, 8080);
        assert_eq!(s.config, None);
        assert!(!s.shadow_mode);
        assert!(!s.runtime.runtime_ignoredotfiles);
        assert_eq!(s.shutdown_grace, Duration::from_secs(15));
        assert_eq!(
            s.config_path(),
            PathBuf::from("/srv/runtime_data/current/config")
        );
        // No REDIS_URL: the memory store.
        assert!(s.store_chain().unwrap().is_none());
        let r = &s.redis;
        assert_eq!(r.redis_type, RedisType::Single);
        assert!(!r.redis_tls);
        assert_eq!(r.redis_tls_cacert, None);
        assert_eq!(r.redis_tls_client_cert, None);
        assert_eq!(r.redis_tls_client_key, None);
        assert!(!r.redis_tls_skip_hostname_verification);
        assert!(!s.tls.grpc_server_use_tls);
        assert_eq!(s.tls.grpc_tls().unwrap(), None);
        assert_eq!(r.redis_pool_size, DEFAULT_POOL_SIZE);
        assert_eq!(r.redis_timeout, crate::store::redis::DEFAULT_TIMEOUT);
        assert_eq!(r.cache_key_prefix, "");
        assert_eq!(r.breaker(), BreakerSettings::default());
        assert_eq!(s.local_cache_size_in_bytes, 0);
        assert_eq!(s.failure_mode, None);
    }

    #[test]
    fn runtime_layout_and_values() {
        let cli = parse(&[
            "--grpc-host=127.0.0.1",
            "--grpc-port=9081",
            "--host=::1",
            "--port=9080",
            "--runtime-root=/data",
            "--runtime-subdirectory=ratelimit",
            "--runtime-appdirectory=rules",
            "--runtime-ignoredotfiles=1",
            "--shadow-mode=True",
            "--quota-mode=1",
            "--shutdown-grace=500ms",
            "--log-level=DEBUG",
            "--log-format=json",
        ])
        .unwrap();
        assert_eq!(cli.log.log_level, LogLevel::Debug);
        assert_eq!(cli.log.log_format, LogFormat::Json);
        let s = serve_args(cli);
        assert!(s.shadow_mode);
        assert!(s.quota_mode);
        assert!(s.runtime.runtime_ignoredotfiles);
        assert!(s.load_options().ignore_dotfiles);
        assert_eq!(s.shutdown_grace, Duration::from_millis(500));
        assert_eq!(s.config_path(), PathBuf::from("/data/ratelimit/rules"));
        assert_eq!(
            resolve("gRPC", &s.grpc_host, s.grpc_port).unwrap(),
            "127.0.0.1:9081".parse::<SocketAddr>().unwrap()
        );
        assert_eq!(
            resolve("HTTP", &s.host, s.port).unwrap(),
            "[::1]:9080".parse::<SocketAddr>().unwrap()
        );
        assert_eq!(
            resolve("HTTP", "[::]", 1).unwrap(),
            "[::]:1".parse::<SocketAddr>().unwrap()
        );
    }

    #[test]
    fn empty_subdirectory_vanishes() {
        let s = serve_args(parse(&["--runtime-root=/srv/rt/"]).unwrap());
        assert_eq!(s.config_path(), PathBuf::from("/srv/rt/config"));
    }

    #[test]
    fn config_flag_wins_over_runtime_layout() {
        let s = serve_args(parse(&["--config", "/etc/rl.yaml", "--runtime-root=/data"]).unwrap());
        assert_eq!(s.config_path(), PathBuf::from("/etc/rl.yaml"));
    }

    #[test]
    fn serve_subcommand_takes_the_same_flags() {
        let s = serve_args(
            parse(&[
                "serve",
                "--grpc-port",
                "0",
                "--port=0",
                "--shadow-mode",
                "--shutdown-grace",
                "1m30s",
                "--log-level=warning",
            ])
            .unwrap(),
        );
        assert_eq!(s.grpc_port, 0);
        assert_eq!(s.port, 0);
        assert!(s.shadow_mode);
        assert_eq!(s.shutdown_grace, Duration::from_secs(90));
    }

    #[test]
    fn bad_values_are_rejected() {
        assert!(parse(&["--shadow-mode=yes"]).is_err());
        assert!(parse(&["--log-level=verbose"]).is_err());
        assert!(parse(&["--log-format=xml"]).is_err());
        assert!(parse(&["--shutdown-grace=soon"]).is_err());
        assert!(parse(&["--grpc-port=70000"]).is_err());
        for (v, want) in [
            ("warning", LogLevel::Warn),
            ("Error", LogLevel::Error),
            ("fatal", LogLevel::Error),
            ("TRACE", LogLevel::Trace),
        ] {
            let cli = parse(&[&format!("--log-level={v}")]).unwrap();
            assert_eq!(cli.log.log_level, want);
        }
    }

    #[test]
    fn check_subcommand() {
        let cli = parse(&["check", "/etc/rl", "--ignore-dotfiles"]).unwrap();
        match cli.into_command().0 {
            Command::Check(c) => {
                assert_eq!(c.path, PathBuf::from("/etc/rl"));
                assert!(c.ignore_dotfiles);
            }
            other => panic!("expected check, got {other:?}"),
        }
        assert!(parse(&["check"]).is_err(), "PATH is required");
        // Serve flags belong to serve.
        assert!(parse(&["--port=1", "check", "/etc/rl"]).is_err());
    }

    fn redis_settings(args: &[&str]) -> Result<Option<RedisSettings>, SettingsError> {
        serve_args(parse(args).unwrap()).redis.settings()
    }

    fn urls(args: &[&str]) -> Vec<String> {
        redis_settings(args).unwrap().unwrap().urls
    }

    #[test]
    fn redis_url_forms() {
        // envoyproxy's plain host:port (Istio's sample: REDIS_URL=redis:6379).
        assert_eq!(urls(&["--redis-url=redis:6379"]), ["redis://redis:6379"]);
        assert_eq!(urls(&["--redis-url=[::1]:6379"]), ["redis://[::1]:6379"]);
        assert_eq!(
            urls(&["--redis-url=redis://:pw@10.0.0.1:6380/2"]),
            ["redis://:pw@10.0.0.1:6380/2"]
        );
        assert_eq!(urls(&["--redis-url=REDIS://r:1"]), ["redis://r:1"]);
        // A Cluster's seeds, plain or URLs, spaces and a trailing comma tolerated.
        assert_eq!(
            urls(&[
                "--redis-type=cluster",
                "--redis-url=a:7000, redis://b:7001 ,c:7002,"
            ]),
            ["redis://a:7000", "redis://b:7001", "redis://c:7002"]
        );
        // REDIS_TYPE is case-insensitive (envoyproxy writes SINGLE / CLUSTER).
        for t in ["CLUSTER", "Cluster", "cluster"] {
            let r = redis_settings(&[&format!("--redis-type={t}"), "--redis-url=a:1,b:2"])
                .unwrap()
                .unwrap();
            assert_eq!(r.kind, RedisKind::Cluster);
        }
        let r = redis_settings(&["--redis-type=SINGLE", "--redis-url=a:1"])
            .unwrap()
            .unwrap();
        assert_eq!(r.kind, RedisKind::Single);
    }

    #[test]
    fn sentinel_url_is_the_master_name_then_the_sentinels() {
        let r = redis_settings(&[
            "--redis-type=SENTINEL",
            "--redis-url=mymaster, 10.0.0.1:26379,s2:26379",
            "--redis-sentinel-auth=sentinel-pw",
            "--redis-auth=master-pw",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(r.kind, RedisKind::Sentinel);
        assert_eq!(r.urls, ["redis://10.0.0.1:26379", "redis://s2:26379"]);
        let s = r.sentinel.clone().expect("sentinel settings");
        assert_eq!(s.master_name, "mymaster");
        assert_eq!(s.auth.as_deref(), Some("sentinel-pw"));
        assert_eq!(
            r.auth.as_deref(),
            Some("master-pw"),
            "REDIS_AUTH stays the master's"
        );
        let shown = format!("{r:?}");
        assert!(!shown.contains("-pw"), "no password in Debug: {shown}");
        // The first item must be a name, and at least one sentinel must follow it.
        for bad in [
            "10.0.0.1:26379,10.0.0.2:26379",
            "mymaster",
            "mymaster,",
            ",s1:26379",
        ] {
            let e = redis_settings(&["--redis-type=sentinel", &format!("--redis-url={bad}")])
                .expect_err(bad);
            assert!(e.to_string().contains("master"), "{bad}: {e}");
        }
        // Other types ignore REDIS_SENTINEL_AUTH and have no sentinel settings.
        let r = redis_settings(&["--redis-url=a:1", "--redis-sentinel-auth=x"])
            .unwrap()
            .unwrap();
        assert!(r.sentinel.is_none());
    }

    #[test]
    fn redis_tls_urls_and_certificates() {
        assert_eq!(
            normalize_redis_urls("r:6379,redis://s:1,rediss://t:2", true).unwrap(),
            ["rediss://r:6379", "rediss://s:1", "rediss://t:2"]
        );
        assert_eq!(
            normalize_redis_urls("rediss://t:2", false).unwrap(),
            ["rediss://t:2"]
        );
        // redis-rs's `#insecure` would silently turn off certificate checks.
        let e = normalize_redis_urls("rediss://:pw@t:2/#insecure", false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION"), "{e}");
        assert!(!e.contains("pw"), "{e}");
        // REDIS_TLS or a rediss:// URL: TLS on the system roots, no client certificate.
        for args in [
            &["--redis-url=redis:6379", "--redis-tls"][..],
            &["--redis-url=redis:6379", "--redis-tls=true"][..],
            &["--redis-url=rediss://redis:6379"][..],
        ] {
            let r = redis_settings(args).unwrap().unwrap();
            assert_eq!(r.urls, ["rediss://redis:6379"], "{args:?}");
            assert_eq!(r.tls, RedisTlsSettings::default(), "{args:?}");
        }
        let r = redis_settings(&[
            "--redis-url=a:7000,b:7000",
            "--redis-type=cluster",
            "--redis-tls=1",
            "--redis-tls-cacert=/etc/redis-tls/ca.crt",
            "--redis-tls-client-cert=/etc/redis-tls/tls.crt",
            "--redis-tls-client-key=/etc/redis-tls/tls.key",
            "--redis-tls-skip-hostname-verification=True",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(r.urls, ["rediss://a:7000", "rediss://b:7000"]);
        assert_eq!(
            r.tls,
            RedisTlsSettings {
                ca_cert: Some("/etc/redis-tls/ca.crt".into()),
                client_cert: Some("/etc/redis-tls/tls.crt".into()),
                client_key: Some("/etc/redis-tls/tls.key".into()),
                skip_hostname_verification: true,
            }
        );
        // Paths are shown, never file contents (they are read only when the store is built).
        let dbg = format!("{r:?}");
        assert!(dbg.contains("/etc/redis-tls/tls.key"), "{dbg}");
        // An empty path is refused (an empty env var counts as unset instead).
        assert!(parse(&["--redis-tls-cacert="]).is_err());
        // A client certificate needs its key and the other way round.
        for half in [
            "--redis-tls-client-cert=/c.crt",
            "--redis-tls-client-key=/c.key",
        ] {
            let e = redis_settings(&["--redis-url=rediss://r:1", half]).unwrap_err();
            assert!(matches!(e, SettingsError::Redis(_)), "{half}: {e}");
            assert!(e
                .to_string()
                .contains("REDIS_TLS_CLIENT_CERT and REDIS_TLS_CLIENT_KEY"));
        }
        // Certificate settings without TLS are ignored (with a warning), as envoyproxy does.
        let r = redis_settings(&["--redis-url=r:1", "--redis-tls-cacert=/ca.crt"])
            .unwrap()
            .unwrap();
        assert_eq!(r.urls, ["redis://r:1"]);
        assert!(parse(&["--redis-tls-skip-hostname-verification=yes"]).is_err());
        // REDIS_TLS without REDIS_URL changes nothing: memory store.
        assert!(redis_settings(&["--redis-tls"]).unwrap().is_none());
    }

    fn grpc_tls(args: &[&str]) -> Result<Option<TlsSettings>, SettingsError> {
        serve_args(parse(args).unwrap()).tls.grpc_tls()
    }

    #[test]
    fn grpc_tls_settings() {
        assert_eq!(grpc_tls(&[]).unwrap(), None, "plaintext by default");
        let t = grpc_tls(&[
            "--grpc-server-use-tls",
            "--grpc-server-tls-cert=/tls/tls.crt",
            "--grpc-server-tls-key=/tls/tls.key",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(t, TlsSettings::new("/tls/tls.crt", "/tls/tls.key"));
        assert_eq!(t.client_ca, None);
        assert_eq!(
            t.reload_interval,
            crate::server::tls::DEFAULT_RELOAD_INTERVAL
        );
        // A client CA makes it mutual TLS.
        let t = grpc_tls(&[
            "--grpc-server-use-tls=T",
            "--grpc-server-tls-cert=/tls/tls.crt",
            "--grpc-server-tls-key=/tls/tls.key",
            "--grpc-client-tls-cacert=/tls/ca.crt",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(t.client_ca, Some(PathBuf::from("/tls/ca.crt")));
        // TLS without a certificate or a key cannot work.
        for args in [
            &["--grpc-server-use-tls"][..],
            &["--grpc-server-use-tls", "--grpc-server-tls-cert=/c"][..],
            &["--grpc-server-use-tls", "--grpc-server-tls-key=/k"][..],
        ] {
            let e = grpc_tls(args).unwrap_err();
            assert!(matches!(e, SettingsError::Tls(_)), "{args:?}: {e}");
            assert!(e.to_string().contains("GRPC_SERVER_TLS_CERT"), "{e}");
        }
        // mTLS asked for but TLS off: refused rather than served in plaintext.
        let e = grpc_tls(&["--grpc-client-tls-cacert=/tls/ca.crt"]).unwrap_err();
        assert!(e.to_string().contains("GRPC_SERVER_USE_TLS"), "{e}");
        // A certificate without GRPC_SERVER_USE_TLS is ignored, as envoyproxy does.
        assert_eq!(
            grpc_tls(&["--grpc-server-tls-cert=/c", "--grpc-server-tls-key=/k"]).unwrap(),
            None
        );
        assert_eq!(
            grpc_tls(&["--grpc-server-use-tls=false", "--grpc-server-tls-cert=/c"]).unwrap(),
            None
        );
        assert!(parse(&["--grpc-server-use-tls=yes"]).is_err());
        // `serve` takes the same flags.
        let s = serve_args(
            parse(&[
                "serve",
                "--grpc-server-use-tls",
                "--grpc-server-tls-cert=/c",
                "--grpc-server-tls-key=/k",
            ])
            .unwrap(),
        );
        assert!(s.tls.grpc_tls().unwrap().is_some());
    }

    #[tokio::test]
    async fn grpc_tls_reaches_the_server_config() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.yaml");
        std::fs::write(&path, "domain: d\n").unwrap();
        let config = format!("--config={}", path.display());
        let s = serve_args(
            parse(&[
                "--grpc-port=0",
                "--port=0",
                &config,
                "--grpc-server-use-tls",
                "--grpc-server-tls-cert=/tls/tls.crt",
                "--grpc-server-tls-key=/tls/tls.key",
            ])
            .unwrap(),
        );
        // The files are read when the server starts, not here.
        let c = s.server_config().unwrap();
        assert_eq!(
            c.grpc_tls,
            Some(TlsSettings::new("/tls/tls.crt", "/tls/tls.key"))
        );
        let s = serve_args(parse(&["--grpc-port=0", "--port=0", &config]).unwrap());
        assert_eq!(s.server_config().unwrap().grpc_tls, None);
        let s = serve_args(parse(&["--grpc-server-use-tls", &config]).unwrap());
        assert!(matches!(s.server_config(), Err(SettingsError::Tls(_))));
    }

    #[test]
    fn bad_redis_urls_are_refused_without_printing_secrets() {
        for bad in [
            "redis",
            "redis:port",
            "redis:70000",
            ":6379",
            "http://redis:6379",
            "redis://",
            " , ",
            "user:hunter2@redis",
        ] {
            let e = redis_settings(&[&format!("--redis-url={bad}")]).unwrap_err();
            assert!(matches!(e, SettingsError::Redis(_)), "{bad:?}: {e}");
            assert!(!e.to_string().contains("hunter2"), "{e}");
        }
        let e = redis_settings(&["--redis-url=http://u:hunter2@redis:1"]).unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
        // More than one address needs REDIS_TYPE=cluster.
        let e = redis_settings(&["--redis-url=a:1,b:2"]).unwrap_err();
        assert!(e.to_string().contains("REDIS_TYPE=cluster"), "{e}");
    }

    #[test]
    fn redis_tuning_and_service_switches() {
        let s = serve_args(
            parse(&[
                "--redis-url=redis:6379",
                "--redis-auth=svc:hunter2",
                "--redis-pool-size=3",
                "--redis-timeout=250ms",
                "--cache-key-prefix=rl_",
                "--redis-breaker-threshold=5",
                "--redis-breaker-open=2s",
                "--local-cache-size-in-bytes=1048576",
                "--failure-mode=DENY",
            ])
            .unwrap(),
        );
        let chain = s.store_chain().unwrap().unwrap();
        assert_eq!(chain.redis.urls, ["redis://redis:6379"]);
        assert_eq!(chain.redis.auth.as_deref(), Some("svc:hunter2"));
        assert_eq!(chain.redis.pool_size, 3);
        assert_eq!(chain.redis.timeout, Duration::from_millis(250));
        assert_eq!(chain.redis.key_prefix, "rl_");
        assert_eq!(
            chain.breaker,
            BreakerSettings {
                failure_threshold: 5,
                open_for: Duration::from_secs(2)
            }
        );
        assert_eq!(chain.local_cache_bytes, 1 << 20);
        assert_eq!(s.failure_mode, Some(FailureMode::Deny));
        assert_eq!(
            serve_args(parse(&["--failure-mode=allow"]).unwrap()).failure_mode,
            Some(FailureMode::Allow)
        );
        // An empty REDIS_AUTH is no password.
        let r = redis_settings(&["--redis-url=r:1", "--redis-auth="])
            .unwrap()
            .unwrap();
        assert_eq!(r.auth, None);
        assert!(parse(&["--failure-mode=open"]).is_err());
        assert!(parse(&["--redis-pool-size=0"]).is_err());
        assert!(parse(&["--redis-breaker-threshold=0"]).is_err());
        assert!(parse(&["--redis-timeout=soon"]).is_err());
        assert!(parse(&["--local-cache-size-in-bytes=-1"]).is_err());
    }

    #[test]
    fn redis_secrets_are_never_printed() {
        let s = serve_args(
            parse(&[
                "--redis-url=redis://:hunter2@redis:6379",
                "--redis-auth=admin:swordfish",
            ])
            .unwrap(),
        );
        let dbg = format!("{s:?}");
        assert!(!dbg.contains("hunter2"), "{dbg}");
        assert!(!dbg.contains("swordfish"), "{dbg}");
        assert!(dbg.contains("redacted"), "{dbg}");
        let chain = format!("{:?}", s.store_chain().unwrap().unwrap());
        assert!(!chain.contains("hunter2"), "{chain}");
        assert!(!chain.contains("swordfish"), "{chain}");
        for long in ["redis-url", "redis-auth"] {
            let hidden = Cli::command()
                .get_arguments()
                .find(|a| a.get_long() == Some(long))
                .map(|a| a.is_hide_env_values_set());
            assert_eq!(hidden, Some(true), "--help must not print {long}'s value");
        }
        // Set but empty counts as unset: the memory store.
        let s = serve_args(parse(&["--redis-url="]).unwrap());
        assert!(s.store_chain().unwrap().is_none());
    }

    #[tokio::test]
    async fn an_unreachable_redis_still_gives_a_server_config() {
        // Port 1 on loopback: nothing listens. Building the store never touches the network.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.yaml");
        std::fs::write(&path, "domain: d\n").unwrap();
        let s = serve_args(
            parse(&[
                "--redis-url=127.0.0.1:1",
                "--local-cache-size-in-bytes=4096",
                "--failure-mode=allow",
                "--grpc-port=0",
                "--port=0",
                &format!("--config={}", path.display()),
            ])
            .unwrap(),
        );
        let config = s.server_config().unwrap();
        assert!(config.store.is_some());
        assert_eq!(config.options.failure_mode, Some(FailureMode::Allow));
    }

    #[test]
    fn go_bools() {
        for t in ["1", "t", "T", "true", "TRUE", "True"] {
            assert_eq!(parse_go_bool(t), Ok(true));
        }
        for f in ["0", "f", "F", "false", "FALSE", "False"] {
            assert_eq!(parse_go_bool(f), Ok(false));
        }
        for bad in ["yes", "", "tRUE", "2"] {
            assert!(parse_go_bool(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("15s"), Ok(Duration::from_secs(15)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("250us"), Ok(Duration::from_micros(250)));
        for bad in ["", "s", "15x", "1..5s", "-1s", "ms15", "1e3s"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
