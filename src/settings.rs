//! Command line and environment settings. Every flag falls back to the environment variable that
//! envoyproxy/ratelimit reads, so sluice runs as a drop-in for `/bin/ratelimit` configured by env
//! vars only; this module turns those raw values into a [`ServerConfig`] and nothing else.

use crate::clock::{Clock, SystemClock};
use crate::config::{load_path, ConfigErrors, LoadOptions, RuleSet};
use crate::server::ServerConfig;
use crate::service::ServiceOptions;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use std::ffi::OsStr;
use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

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

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the RLS gRPC API and the HTTP admin endpoints (the default).
    Serve(ServeArgs),
    /// Validate a config file or directory: print every error, exit 1 if there is any.
    Check(CheckArgs),
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

    /// How long in-flight requests may run after SIGTERM/SIGINT (`15s`, `500ms`, `1m30s`).
    #[arg(
        long,
        env = "SHUTDOWN_GRACE_PERIOD",
        default_value = "15s",
        value_parser = parse_duration
    )]
    pub shutdown_grace: Duration,

    /// Redis address. Not supported by this version: set, it makes `serve` fail at start.
    // `hide_env_values`: `--help` must not print a URL that may hold a password.
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    pub redis_url: Option<Secret>,
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
    #[error(
        "REDIS_URL is set, but the Redis store is not available in this version of sluice; \
         unset REDIS_URL to use the in-memory store (counters are then per process)"
    )]
    RedisNotAvailable,
    #[error("cannot resolve {what} address {host}:{port}: {reason}")]
    Resolve {
        what: &'static str,
        host: String,
        port: u16,
        reason: String,
    },
    #[error("invalid config in {path}:\n{errors}")]
    Config { path: PathBuf, errors: ConfigErrors },
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
        }
    }

    /// The one place that decides which counter store `serve` uses. Today only the memory store
    /// exists, so a configured Redis is refused rather than silently ignored: an operator must
    /// never believe replicas share counters when they do not. The Redis store replaces this.
    pub fn check_store(&self) -> Result<(), SettingsError> {
        match &self.redis_url {
            Some(url) if !url.expose().trim().is_empty() => Err(SettingsError::RedisNotAvailable),
            _ => Ok(()),
        }
    }

    /// Resolves addresses, selects the store and loads the config: everything `serve` needs
    /// before it binds. Fails before any port is opened.
    pub fn server_config(&self) -> Result<ServerConfig, SettingsError> {
        self.check_store()?;
        let grpc_addr = resolve("gRPC", &self.grpc_host, self.grpc_port)?;
        let http_addr = resolve("HTTP", &self.host, self.port)?;
        let path = self.config_path();
        let rules = load_rules(&path, &self.load_options())?;
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        Ok(ServerConfig {
            grpc_addr,
            http_addr,
            rules,
            options: ServiceOptions {
                global_shadow_mode: self.shadow_mode,
            },
            clock,
            store: None,
            shutdown_grace: self.shutdown_grace,
            config_path: Some(path),
        })
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
            Command::Check(_) => panic!("expected serve"),
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
                ("shadow-mode", "SHADOW_MODE"),
                ("shutdown-grace", "SHUTDOWN_GRACE_PERIOD"),
                ("redis-url", "REDIS_URL"),
            ] {
                assert_eq!(env_of(c, long).as_deref(), Some(env), "--{long}");
            }
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
        assert!(s.check_store().is_ok());
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
            "--shutdown-grace=500ms",
            "--log-level=DEBUG",
            "--log-format=json",
        ])
        .unwrap();
        assert_eq!(cli.log.log_level, LogLevel::Debug);
        assert_eq!(cli.log.log_format, LogFormat::Json);
        let s = serve_args(cli);
        assert!(s.shadow_mode);
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
            Command::Serve(_) => panic!("expected check"),
        }
        assert!(parse(&["check"]).is_err(), "PATH is required");
        // Serve flags belong to serve.
        assert!(parse(&["--port=1", "check", "/etc/rl"]).is_err());
    }

    #[test]
    fn redis_url_is_refused_and_never_printed() {
        let s = serve_args(parse(&["--redis-url=redis://:hunter2@redis:6379"]).unwrap());
        assert!(matches!(
            s.check_store(),
            Err(SettingsError::RedisNotAvailable)
        ));
        // Refused before anything else is looked at (no config is loaded, no port resolved).
        assert!(matches!(
            s.server_config(),
            Err(SettingsError::RedisNotAvailable)
        ));
        let dbg = format!("{s:?}");
        let redis = Cli::command()
            .get_arguments()
            .find(|a| a.get_long() == Some("redis-url"))
            .map(|a| a.is_hide_env_values_set());
        assert_eq!(redis, Some(true), "--help must not print REDIS_URL's value");
        assert!(!dbg.contains("hunter2"), "{dbg}");
        assert!(dbg.contains("redacted"), "{dbg}");
        // Set but empty counts as unset.
        let s = serve_args(parse(&["--redis-url="]).unwrap());
        assert!(s.check_store().is_ok());
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
