//! envoyproxy/ratelimit's stats: the statsd lines a `statsd_exporter` sidecar receives (read
//! here on a real UDP socket) and the series `USE_PROMETHEUS` serves, for one sequence of
//! decisions, against envoyproxy's names.

use crate::support::*;
use sluice::clock::ManualClock;
use sluice::server::{EnvoyStatsSettings, ServerConfig};
use sluice::telemetry::envoy_stats::StatsdSettings;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const RULES: &str = r#"
domain: edge
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 2}
    descriptors:
      - key: path
        value: /login
        rate_limit: {unit: minute, requests_per_unit: 1}
  - key: remote_address
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 1}
"#;

/// Sums of every statsd counter received, by name.
type Received = Arc<Mutex<BTreeMap<String, u64>>>;

async fn statsd_listener() -> (u16, Received) {
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0")
        .await
        .expect("UDP");
    let port = socket.local_addr().expect("addr").port();
    let received: Received = Arc::default();
    let sums = received.clone();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65_536];
        while let Ok(n) = socket.recv(&mut buf).await {
            let text = String::from_utf8_lossy(&buf[..n]).to_string();
            for line in text.lines() {
                let (name, rest) = line.rsplit_once(':').expect("name:value|c");
                let (value, kind) = rest.split_once('|').expect("value|type");
                assert_eq!(kind, "c", "{line}");
                *sums
                    .lock()
                    .expect("sums")
                    .entry(name.to_string())
                    .or_default() += value.parse::<u64>().expect("a count");
            }
        }
    });
    (port, received)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statsd_and_use_prometheus_carry_envoyproxy_names_and_values() {
    let (port, received) = statsd_listener().await;
    let clock = ManualClock::new(T0);
    let config = ServerConfig {
        envoy_stats: Some(EnvoyStatsSettings {
            statsd: Some(StatsdSettings {
                host: "127.0.0.1".into(),
                port,
                flush_interval: Duration::from_millis(20),
            }),
            prometheus: Some(("127.0.0.1:0".parse().expect("addr"), "/metrics".into())),
            tags: vec![("env".into(), "test".into())],
        }),
        ..ServerConfig::for_tests(rules(RULES), Arc::new(clock.clone()))
    };
    let s = TestServer::start_config(config, clock).await;

    // alice: 3 hits on a limit of 2 (the second is near the limit at NEAR_LIMIT_RATIO 0.8, the
    // third over); bob on /login: 2 hits on a limit of 1; an IP with detailed_metric: 1 hit.
    for _ in 0..3 {
        s.call(one("edge", &[("user", "alice")])).await;
    }
    for _ in 0..2 {
        s.call(one("edge", &[("user", "bob"), ("path", "/login")]))
            .await;
    }
    s.call(one("edge", &[("remote_address", "10.0.0.1")])).await;
    let invalid = s
        .client()
        .await
        .should_rate_limit(one("", &[("user", "x")]))
        .await;
    assert_eq!(
        invalid.map(|_| ()).map_err(|e| e.code()),
        Err(tonic::Code::InvalidArgument)
    );

    let p = "ratelimit.service.rate_limit";
    let tag = ".__env=test";
    let expected: BTreeMap<String, u64> = [
        (format!("{p}.edge.user.total_hits{tag}"), 3),
        (format!("{p}.edge.user.within_limit{tag}"), 2),
        (format!("{p}.edge.user.near_limit{tag}"), 1),
        (format!("{p}.edge.user.over_limit{tag}"), 1),
        (format!("{p}.edge.user.path_/login.total_hits{tag}"), 2),
        (format!("{p}.edge.user.path_/login.within_limit{tag}"), 1),
        // A limit of 1: its one allowed hit is already past floor(1 * 0.8) = 0.
        (format!("{p}.edge.user.path_/login.near_limit{tag}"), 1),
        (format!("{p}.edge.user.path_/login.over_limit{tag}"), 1),
        (
            format!("{p}.edge.remote_address_10_0_0_1.total_hits{tag}"),
            1,
        ),
        (
            format!("{p}.edge.remote_address_10_0_0_1.within_limit{tag}"),
            1,
        ),
        (
            format!("{p}.edge.remote_address_10_0_0_1.near_limit{tag}"),
            1,
        ),
        (format!("ratelimit.service.config_load_success{tag}"), 1),
        (
            format!("ratelimit.service.call.should_rate_limit.service_error{tag}"),
            1,
        ),
        (
            format!("ratelimit_server.ShouldRateLimit.total_requests{tag}"),
            7,
        ),
    ]
    .into_iter()
    .collect();
    // Flushes carry increases: once the last call's request count is in, so is the rest.
    let total = format!("ratelimit_server.ShouldRateLimit.total_requests{tag}");
    eventually("statsd received the request count", || {
        let r = received.clone();
        let total = total.clone();
        async move { r.lock().expect("sums").get(&total) == Some(&7) }
    })
    .await;
    assert_eq!(*received.lock().expect("sums"), expected);

    let addr = s
        .running
        .as_ref()
        .and_then(|r| r.envoy_metrics_addr())
        .expect("listener");
    let (code, body) = http(addr, "GET", "/metrics", "").await;
    assert_eq!(code, 200);
    let scrape = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string())))
        .expect("Prometheus text");
    let value = |name: &str, labels: &[(&str, &str)]| -> Option<f64> {
        scrape
            .samples
            .iter()
            .find(|s| {
                s.metric == name
                    && labels.iter().all(|(k, v)| s.labels.get(k) == Some(v))
                    && s.labels.get("env") == Some("test")
            })
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => v,
                _ => f64::NAN,
            })
    };
    let user = [("domain", "edge"), ("key1", "user")];
    assert_eq!(
        value("ratelimit_service_rate_limit_total_hits", &user),
        Some(3.0)
    );
    assert_eq!(
        value("ratelimit_service_rate_limit_within_limit", &user),
        Some(2.0)
    );
    assert_eq!(
        value("ratelimit_service_rate_limit_near_limit", &user),
        Some(1.0)
    );
    assert_eq!(
        value("ratelimit_service_rate_limit_over_limit", &user),
        Some(1.0)
    );
    let login = [
        ("domain", "edge"),
        ("key1", "user"),
        ("key2", "path_/login"),
    ];
    assert_eq!(
        value("ratelimit_service_rate_limit_total_hits", &login),
        Some(2.0)
    );
    assert_eq!(
        value("ratelimit_service_rate_limit_over_limit", &login),
        Some(1.0)
    );
    let ip = [("domain", "edge"), ("key1", "remote_address_10_0_0_1")];
    assert_eq!(
        value("ratelimit_service_rate_limit_total_hits", &ip),
        Some(1.0)
    );
    assert_eq!(
        value("ratelimit_service_config_load_success", &[]),
        Some(1.0)
    );
    assert_eq!(
        value(
            "ratelimit_service_should_rate_limit_error",
            &[("err_type", "service_error")]
        ),
        Some(1.0),
        "the request without a domain"
    );
    assert_eq!(
        value(
            "ratelimit_service_total_requests",
            &[("grpc_method", "ShouldRateLimit")]
        ),
        Some(7.0)
    );
    assert!(
        body.contains("ratelimit_service_response_time_seconds_count{grpc_method=\"ShouldRateLimit\",env=\"test\"} 7"),
        "{body}"
    );
    s.stop().await;
}
