//! Command line and environment settings. Every flag falls back to the environment variable that
//! envoyproxy/ratelimit reads, so sluice runs as a drop-in for `/bin/ratelimit` configured by env
//! vars only. This module parses and checks those raw values, and nothing else; `app.rs` builds
//! the parts (store, options, the `ServerConfig`) from them.

use crate::config::{ConfigErrors, LoadOptions};
use crate::duration::format_go;
use crate::service::{FailureMode, RequestCaps};
use crate::store::fallback::LocalSettings;
use crate::store::LocalChain;
use crate::store::StoreChain;
use crate::store::StoreError;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::time::Duration;

mod admin;
mod check;
mod decide;
mod decision_log;
mod global;
mod http2;
mod json;
mod observe;
mod parse;
mod redis;
mod replay;
mod rlqs;
mod runtime;
pub mod stats;
mod tls;
pub mod xds;

pub use admin::AdminServeArgs;
pub use check::{CheckArgs, LoadFlags};
pub use decide::DecideFlags;
pub use decision_log::{parse_bytes, DecisionLogArgs};
pub use global::GlobalArgs;
pub use observe::{
    parse_exporter_protocol, parse_header_name, parse_ratio, HeadersDraft, ObserveArgs,
};
pub(crate) use parse::{key_value_list, parse_max_counters, resolve};
pub use parse::{parse_duration, parse_go_bool, Secret};
pub use redis::{normalize_redis_urls, parse_failure_mode, RedisArgs};
pub use replay::ReplayArgs;
pub use runtime::{ignore_empty_env, RuntimeArgs};
pub use tls::TlsArgs;

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
    ///
    /// `extra` are subcommands the binary adds (its load generator, `bench`): one of them is
    /// handed back by name with its matches, the logging flags parsed.
    pub fn parse_args_with(extra: impl IntoIterator<Item = clap::Command>) -> Parsed {
        let cmd = ignore_empty_env(Cli::command().subcommands(extra), &|name| {
            std::env::var_os(name).is_some_and(|v| v.is_empty())
        });
        let matches = cmd.get_matches();
        if let Some((name, sub)) = matches.subcommand() {
            if !Command::has_subcommand(name) {
                let log = LogArgs::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
                return Parsed::Extra {
                    name: name.to_string(),
                    matches: sub.clone(),
                    log,
                };
            }
        }
        Parsed::Cli(Box::new(
            Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit()),
        ))
    }

    /// The command to run, with `serve` as the default.
    pub fn into_command(self) -> (Command, LogArgs) {
        let command = self.command.unwrap_or(Command::Serve(self.serve));
        (command, self.log)
    }
}

/// What the command line asked for (see [`Cli::parse_args_with`]).
#[derive(Debug)]
pub enum Parsed {
    Cli(Box<Cli>),
    /// A subcommand the binary added, by name, with its own matches.
    Extra {
        name: String,
        matches: clap::ArgMatches,
        log: LogArgs,
    },
}

// Parsed once at start; boxing `ServeArgs` would buy nothing and cost every match a deref.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the RLS gRPC API and the HTTP admin endpoints (the default).
    Serve(ServeArgs),
    /// Validate a config file or directory: print every error, exit 1 if there is any.
    Check(CheckArgs),
    /// Call a running sluice's admin API: inspect, reset, override limits.
    Admin(crate::admin::client::AdminArgs),
    /// Replay a decision log (DECISION_LOG) against a config, or two side by side, on the
    /// embedded store with a virtual clock: who would have been admitted and denied.
    Replay(ReplayArgs),
}

/// Logging, shared by every command.
#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Minimum log level (envoyproxy names: trace, debug, info, warn, error; case-insensitive).
    /// `RUST_LOG`, when set, refines it per module (`sluice::store=debug`); a bare level in
    /// `RUST_LOG` replaces it.
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

    /// Candidate limits: a config file or directory in the same YAML, decided beside the
    /// enforced config on every request it matches and never changing an answer (`sluice
    /// admin candidates`, `/metrics`). Reloaded like the config; off when unset.
    #[arg(long, env = "CANDIDATE_CONFIG")]
    pub candidate_config: Option<PathBuf>,

    #[command(flatten)]
    pub runtime: RuntimeArgs,

    #[command(flatten)]
    pub load: LoadFlags,

    #[command(flatten)]
    pub source: xds::ConfigSourceArgs,

    #[command(flatten)]
    pub stats: stats::StatsArgs,

    #[command(flatten)]
    pub decide: DecideFlags,

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
        default_value = format_go(crate::server::DEFAULT_SHUTDOWN_GRACE),
        value_parser = parse_duration
    )]
    pub shutdown_grace: Duration,

    /// After SIGTERM, how long sluice reports NOT_SERVING (gRPC health, `/healthcheck`) while
    /// still accepting and answering, before it sends GOAWAY and drains: time for Envoy's health
    /// checks and Kubernetes' endpoint removal to take it out, so a rolling restart fails no call.
    #[arg(
        long,
        env = "SHUTDOWN_DRAIN_DELAY",
        default_value = format_go(crate::server::DEFAULT_DRAIN_DELAY),
        value_parser = parse_duration
    )]
    pub shutdown_drain_delay: Duration,

    /// How long a gRPC connection may live before the server asks the client to reconnect (an
    /// HTTP/2 GOAWAY), so clients spread over new replicas; ±10% jitter; `0` never ages one.
    #[arg(
        long,
        env = "GRPC_MAX_CONNECTION_AGE",
        default_value = "24h",
        value_parser = crate::server::ConnectionAge::parse
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

    #[command(flatten)]
    pub global: GlobalArgs,

    #[command(flatten)]
    pub rlqs: rlqs::RlqsArgs,

    #[command(flatten)]
    pub http2: http2::Http2Args,

    #[command(flatten)]
    pub json: json::JsonArgs,

    /// Counters the in-memory store holds at most (used when no `REDIS_URL` is set): about 100
    /// bytes each when full. Past it, the counter closest to expiry is evicted (it starts
    /// afresh, which can only ever admit more) and `sluice_memory_evictions_total` counts it.
    /// Candidate limits (`CANDIDATE_CONFIG`) have as many again of their own.
    #[arg(long, env = "MEMORY_MAX_COUNTERS", default_value_t = crate::store::memory::DEFAULT_MAX_COUNTERS,
        value_parser = parse_max_counters)]
    pub memory_max_counters: usize,

    /// Slices of leased limits one replica holds at most (`leased:`); a new one past it evicts
    /// the least recently used, whose unspent units go back to the store.
    #[arg(long, env = "LEASED_MAX_COUNTERS", default_value_t = crate::store::slices::DEFAULT_MAX_SLICES,
        value_parser = parse_max_counters)]
    pub leased_max_counters: usize,

    /// Bytes of the local deny cache (0 = off): a counter known to be over its limit is denied
    /// locally until its window resets, without a Redis call.
    #[arg(long, env = "LOCAL_CACHE_SIZE_IN_BYTES", default_value_t = 0)]
    pub local_cache_size_in_bytes: usize,

    /// What to answer when the counter store fails: `allow` (OK), `deny` (OVER_LIMIT), or
    /// `local` (this replica decides against its share of each limit, answers before the
    /// caller's deadline, and writes back when the store returns). Unset, sluice answers gRPC
    /// UNAVAILABLE and Envoy's `failure_mode_deny` decides.
    #[arg(long, env = "FAILURE_MODE", value_parser = parse_failure_mode)]
    pub failure_mode: Option<FailureMode>,

    /// `FAILURE_MODE=local`: counters kept locally at most (the local store, what the store
    /// last said of each counter, what is owed to it: each bounded by this).
    #[arg(long, env = "LOCAL_MAX_COUNTERS", default_value_t = crate::store::fallback::DEFAULT_MAX_COUNTERS,
        value_parser = parse_max_counters)]
    pub local_max_counters: usize,

    /// `FAILURE_MODE=local`: a request is decided locally this long before its gRPC deadline
    /// if the store has not answered (no deadline: after `REDIS_TIMEOUT`).
    #[arg(long, env = "LOCAL_DEADLINE_MARGIN",
        default_value = format_go(crate::store::fallback::DEFAULT_MARGIN),
        value_parser = parse_duration)]
    pub local_deadline_margin: std::time::Duration,

    /// `FAILURE_MODE=local`: replicas assumed to share the store until the first heartbeat
    /// answers (a replica that starts while the store is away; the chart sets its replica
    /// count).
    #[arg(long, env = "LOCAL_REPLICAS", default_value_t = 1)]
    pub local_replicas: u32,

    /// `FAILURE_MODE=local`: how long a store call answered locally is still awaited, to learn
    /// whether the store charged it (so the write-back neither misses nor doubles it).
    #[arg(long, env = "LOCAL_STORE_PATIENCE",
        default_value = format_go(crate::store::fallback::DEFAULT_PATIENCE),
        value_parser = parse_duration)]
    pub local_store_patience: std::time::Duration,

    /// `FAILURE_MODE=local`: store calls awaited that way at most; past them a call that
    /// misses its caller's deadline is dropped (a Cluster master that hangs cannot send the
    /// healthy masters' requests local).
    #[arg(long, env = "LOCAL_MAX_LATE_CALLS",
        default_value_t = crate::store::fallback::DEFAULT_MAX_LATE_CALLS as u32,
        value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub local_max_late_calls: u32,

    #[command(flatten)]
    pub observe: ObserveArgs,

    #[command(flatten)]
    pub tls: TlsArgs,

    #[command(flatten)]
    pub admin: AdminServeArgs,

    #[command(flatten)]
    pub decision_log: DecisionLogArgs,
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
    /// A part could not be built (the metrics registry, the trace export).
    #[error(transparent)]
    Start(#[from] crate::server::ServerError),
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
            global_store: self.global.is_set(),
            ..self.load.options()
        }
    }

    /// The one place that decides which counter store `serve` uses: `None` for the memory
    /// store (no `REDIS_URL`), else the Redis store behind its circuit breaker and, with
    /// `LOCAL_CACHE_SIZE_IN_BYTES` > 0, the local deny cache. Never touches the network, so an
    /// unreachable Redis is a health state, not a start-up failure.
    pub fn store_chain(&self) -> Result<Option<StoreChain>, SettingsError> {
        Ok(self.redis.settings()?.map(|redis| StoreChain {
            local: (self.failure_mode == Some(FailureMode::Local)).then(|| LocalChain {
                settings: LocalSettings {
                    max_counters: self.local_max_counters,
                    margin: self.local_deadline_margin,
                    budget: redis.timeout,
                    replicas: self.local_replicas,
                    retry_every: self.redis.redis_breaker_open,
                    whole_store: redis.kind != crate::store::redis::RedisKind::Cluster,
                    max_late_calls: self.local_max_late_calls as usize,
                },
                patience: self.local_store_patience,
            }),
            redis,
            breaker: self.redis.breaker(),
            local_cache_bytes: self.local_cache_size_in_bytes,
        }))
    }
}

#[cfg(test)]
mod tests;
