use super::*;
use crate::app::server_config;
use crate::server::tls::TlsSettings;
use crate::service::headers::HeaderOptions;
use crate::store::breaker::BreakerSettings;
use crate::store::redis::{RedisKind, RedisSettings, RedisTlsSettings, DEFAULT_POOL_SIZE};
use crate::telemetry::trace::TraceSettings;
use std::net::SocketAddr;

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
    assert!(!s.decide.shadow_mode);
    assert!(!s.load.runtime_ignoredotfiles);
    assert_eq!(s.shutdown_grace, Duration::from_secs(15));
    assert_eq!(
        s.config_path(),
        PathBuf::from("/srv/runtime_data/current/config")
    );
    // No REDIS_URL: the memory store.
    assert!(s.store_chain().unwrap().is_none());
    let r = &s.redis;
    assert_eq!(r.redis_type, RedisKind::Single);
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
    assert!(s.decide.shadow_mode);
    assert!(s.decide.quota_mode);
    assert!(s.load.runtime_ignoredotfiles);
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
    assert!(s.decide.shadow_mode);
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
            assert!(c.load.runtime_ignoredotfiles);
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
        crate::server::reload::DEFAULT_RELOAD_INTERVAL
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
    let c = server_config(&s).unwrap();
    assert_eq!(
        c.grpc_tls,
        Some(TlsSettings::new("/tls/tls.crt", "/tls/tls.key"))
    );
    let s = serve_args(parse(&["--grpc-port=0", "--port=0", &config]).unwrap());
    assert_eq!(server_config(&s).unwrap().grpc_tls, None);
    let s = serve_args(parse(&["--grpc-server-use-tls", &config]).unwrap());
    assert!(matches!(server_config(&s), Err(SettingsError::Tls(_))));
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
            open_for: Duration::from_secs(2),
            patience: Duration::from_millis(250),
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
    let config = server_config(&s).unwrap();
    let limiter = &config.parts.limiter;
    assert!(format!("{:?}", limiter.store()).starts_with("LocalDenyCache"));
    assert_eq!(limiter.options().failure_mode, Some(FailureMode::Allow));
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
