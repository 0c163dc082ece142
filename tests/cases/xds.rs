//! Config over xDS as Envoy Gateway runs it: the sluice binary started with exactly the
//! environment of Envoy Gateway's rate-limit Deployment, a real redis-server, and a real ADS
//! server (tonic, mutual TLS) pushing `RateLimitConfig` resources; decisions asked through
//! Envoy's generated Python client over TLS.

use crate::support::ads::{AdsServer, AdsState, AdsTls, Seen};
use crate::support::binary::{SluiceProcess, BIN};
use crate::support::certs::{write, Ca};
use crate::support::eventually;
use crate::support::redis::RedisServer;
use serde_json::Value as Json;
use sluice::proto::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;

/// The container environment of Envoy Gateway's rate-limit Deployment, in its order
/// (envoyproxy/gateway `internal/infrastructure/kubernetes/ratelimit/testdata/deployments/
/// default.yaml`, commit d32f282). Values in `<...>` are filled in at run time: the
/// certificate paths, the Redis address and the xDS server address.
const ENVOY_GATEWAY_ENV: &[(&str, &str)] = &[
    ("RUNTIME_ROOT", "/data"),
    ("RUNTIME_SUBDIRECTORY", "ratelimit"),
    ("RUNTIME_IGNOREDOTFILES", "true"),
    ("RUNTIME_WATCH_ROOT", "false"),
    ("LOG_LEVEL", "info"),
    ("USE_STATSD", "false"),
    ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
    ("CONFIG_GRPC_XDS_SERVER_URL", "<xds>"),
    ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
    ("GRPC_SERVER_USE_TLS", "true"),
    ("GRPC_SERVER_TLS_CERT", "<certs>/tls.crt"),
    ("GRPC_SERVER_TLS_KEY", "<certs>/tls.key"),
    ("GRPC_SERVER_TLS_CA_CERT", "<certs>/ca.crt"),
    ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
    ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "<certs>/tls.crt"),
    ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "<certs>/tls.key"),
    ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "<certs>/ca.crt"),
    ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
    ("REDIS_SOCKET_TYPE", "tcp"),
    ("REDIS_URL", "<redis>"),
    ("USE_PROMETHEUS", "true"),
    ("PROMETHEUS_ADDR", ":19001"),
    ("PROMETHEUS_MAPPER_YAML", "/etc/statsd-exporter/conf.yaml"),
];

/// The ports the Deployment's container uses (sluice's defaults, as envoyproxy's).
const GRPC: &str = "localhost:8081";
const HEALTH: ([u8; 4], u16) = ([127, 0, 0, 1], 8080);

const DOMAIN: &str = "default/eg/http";
const ROUTE: &str = "httproute/default/backend/rule/0/match/0";

fn limit(unit: RateLimitUnit, requests_per_unit: u32) -> Option<RateLimitPolicy> {
    Some(RateLimitPolicy {
        unit: unit as i32,
        requests_per_unit,
        ..Default::default()
    })
}

/// What Envoy Gateway generates for a BackendTrafficPolicy: the route's match, then per-client
/// limits below it (`x-user-id`, and from version 2 on `x-team`).
fn config(user_limit: u32, team: bool) -> Vec<RateLimitConfig> {
    let mut below = vec![RateLimitDescriptor {
        key: "x-user-id".into(),
        rate_limit: limit(RateLimitUnit::Hour, user_limit),
        ..Default::default()
    }];
    if team {
        below.push(RateLimitDescriptor {
            key: "x-team".into(),
            rate_limit: limit(RateLimitUnit::Hour, 1),
            ..Default::default()
        });
    }
    vec![RateLimitConfig {
        name: DOMAIN.into(),
        domain: DOMAIN.into(),
        descriptors: vec![RateLimitDescriptor {
            key: ROUTE.into(),
            value: ROUTE.into(),
            descriptors: below,
            ..Default::default()
        }],
    }]
}

/// A config the loader refuses: a limit without a unit.
fn broken() -> Vec<RateLimitConfig> {
    let mut c = config(3, true);
    c[0].descriptors[0].descriptors[0].rate_limit = limit(RateLimitUnit::Unknown, 7);
    c
}

fn call(key: &str, value: &str) -> String {
    serde_json::json!({
        "domain": DOMAIN,
        "descriptors": [[[ROUTE, ROUTE], [key, value]]],
    })
    .to_string()
}

/// Runs the calls through Envoy's generated Python client over TLS, one process per batch;
/// returns each call's overall code (or error code).
fn decide(ca: &Path, calls: &[String]) -> Vec<String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/rls_client.py");
    let mut child = std::process::Command::new("python3")
        .args([script, GRPC, ca.to_str().expect("utf-8 path")])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 (scripts/test.sh installs xds-protos and grpcio)");
    let mut stdin = child.stdin.take().expect("stdin");
    for c in calls {
        writeln!(stdin, "{c}").expect("write a call");
    }
    drop(stdin);
    let out = child.wait_with_output().expect("the client ran");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "rls_client.py failed: {stderr}");
    let answers: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: Json = serde_json::from_str(l).expect("JSON answer");
            v.get("code")
                .or_else(|| v.get("error"))
                .and_then(Json::as_str)
                .unwrap_or("?")
                .to_string()
        })
        .collect();
    assert_eq!(answers.len(), calls.len(), "one answer per call: {stderr}");
    answers
}

fn codes(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

async fn healthcheck() -> Option<u16> {
    let addr = SocketAddr::from(HEALTH);
    tokio::net::TcpStream::connect(addr).await.ok()?;
    Some(
        crate::support::http(addr, "GET", "/healthcheck", "")
            .await
            .0,
    )
}

/// Waits until `state` has seen a request matching `what`, and returns it.
async fn wait_seen(state: &AdsState, what: &str, f: impl Fn(&Seen) -> bool) -> Seen {
    eventually(what, || async { state.seen().iter().any(&f) }).await;
    state.seen().into_iter().find(f).expect("seen")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_gateway_deployment_follows_its_xds_server() {
    // The Secret Envoy Gateway mounts at /certs: one CA, the rate-limit service's certificate
    // (its gRPC server certificate and its xDS client certificate), and the xDS server's own.
    let ca = Ca::new("envoy-gateway test CA");
    let ratelimit = ca.server();
    let control_plane = ca.server_named("localhost");
    let dir = tempfile::tempdir().expect("temp dir");
    let certs = dir.path().join("certs");
    std::fs::create_dir(&certs).expect("certs dir");
    write(&certs, "tls.crt", &ratelimit.cert_pem);
    write(&certs, "tls.key", &ratelimit.key_pem);
    let ca_file = write(&certs, "ca.crt", &ca.pem);
    let ads_tls = AdsTls {
        cert_pem: control_plane.cert_pem.clone(),
        key_pem: control_plane.key_pem.clone(),
        client_ca_pem: ca.pem.clone(),
    };

    let redis = RedisServer::start();
    let state = AdsState::new("1", config(3, false));
    let mut ads = AdsServer::start(
        "127.0.0.1:0".parse().expect("addr"),
        state.clone(),
        ads_tls.clone(),
        0,
    );
    let ads_addr = ads.addr;

    let mut cmd = tokio::process::Command::new(BIN);
    cmd.env_clear();
    for (k, v) in ENVOY_GATEWAY_ENV {
        let v = v
            .replace("<certs>", certs.to_str().expect("utf-8 path"))
            .replace("<redis>", &format!("127.0.0.1:{}", redis.port()))
            .replace("<xds>", &format!("localhost:{}", ads_addr.port()));
        cmd.env(k, v);
    }
    let mut sluice = SluiceProcess::spawn(cmd).await;

    // The first push is ACKed, over mutual TLS, by the node Envoy Gateway names.
    let ack = wait_seen(&state, "ACK of version 1", |s| s.acks("1")).await;
    assert_eq!(ack.node_id, "envoy-ratelimit");
    assert_eq!(ack.type_url, sluice::server::xds::RATE_LIMIT_CONFIG_TYPE);
    assert!(ack.client_cert, "sluice presented its client certificate");
    // The readiness probe Envoy Gateway sets (GET :8080/healthcheck) passes with config in.
    eventually("/healthcheck answers 200", || async {
        healthcheck().await == Some(200)
    })
    .await;

    let alice = call("x-user-id", "alice");
    let four_alice = vec![alice.clone(); 4];
    assert_eq!(
        decide(&ca_file, &four_alice),
        codes(&["OK", "OK", "OK", "OVER_LIMIT"]),
        "3 per hour for each user"
    );
    assert_eq!(
        decide(&ca_file, &[call("x-user-id", "bob")]),
        codes(&["OK"])
    );
    assert!(
        redis
            .cli(&["DBSIZE"])
            .trim()
            .parse::<u64>()
            .expect("DBSIZE")
            >= 2,
        "the counters live in the Redis of REDIS_URL"
    );

    // USE_PROMETHEUS=true, PROMETHEUS_ADDR=:19001: envoyproxy's series, where the Deployment's
    // `prometheus.io/port` annotation sends the scraper.
    let (code, body) =
        crate::support::http(([127, 0, 0, 1], 19001).into(), "GET", "/metrics", "").await;
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains("ratelimit_service_config_load_success 1"),
        "{body}"
    );
    let over = format!(
        "ratelimit_service_rate_limit_over_limit{{domain=\"{DOMAIN}\",key1=\"{ROUTE}_{ROUTE}\",key2=\"x-user-id\"}} 1"
    );
    assert!(body.contains(&over), "{over} in {body}");

    // Version 2 adds a team limit and keeps the user limit: the new limit applies, and alice's
    // counter survives the push.
    state.push("2", config(3, true));
    wait_seen(&state, "ACK of version 2", |s| s.acks("2")).await;
    let team = call("x-team", "payments");
    assert_eq!(
        decide(&ca_file, &[team.clone(), team.clone(), alice.clone()]),
        codes(&["OK", "OVER_LIMIT", "OVER_LIMIT"])
    );

    // Version 3 is broken: NACKed with the loader's error, naming the resource; version 2 stays.
    state.push("3", broken());
    let nack = wait_seen(&state, "NACK of version 3", |s| s.error.is_some()).await;
    assert_eq!(
        nack.version_info, "2",
        "a NACK names the version still in force"
    );
    let error = nack.error.unwrap_or_default();
    assert!(error.contains(DOMAIN), "the resource is named: {error}");
    assert!(error.contains("unit"), "the problem is named: {error}");
    assert_eq!(
        decide(
            &ca_file,
            &[team.clone(), alice.clone(), call("x-user-id", "carol")]
        ),
        codes(&["OVER_LIMIT", "OVER_LIMIT", "OK"]),
        "the old limits still apply"
    );
    assert_eq!(healthcheck().await, Some(200));

    // The xDS server goes away: sluice keeps deciding on the rules it has.
    ads.stop();
    assert_eq!(
        decide(&ca_file, &[alice.clone(), call("x-user-id", "dave")]),
        codes(&["OVER_LIMIT", "OK"]),
        "decisions go on while the xDS server is down"
    );
    assert_eq!(healthcheck().await, Some(200));
    // It comes back on the same address with version 4 (users get 10 per hour): sluice
    // reconnects by itself, says it runs version 2, and takes version 4.
    state.push("4", config(10, true));
    let mut ads = AdsServer::start(ads_addr, state.clone(), ads_tls, 1);
    let hello = wait_seen(&state, "a new stream after the restart", |s| s.run == 1).await;
    assert_eq!(
        hello.version_info, "2",
        "the first request after a reconnect"
    );
    wait_seen(&state, "ACK of version 4", |s| s.run == 1 && s.acks("4")).await;
    // A changed limit is a new counter (as with a file reload): alice gets 10 more.
    let eleven_alice = vec![alice.clone(); 11];
    let mut expected = vec!["OK"; 10];
    expected.push("OVER_LIMIT");
    assert_eq!(decide(&ca_file, &eleven_alice), codes(&expected));

    sluice.child.start_kill().expect("stop sluice");
    let _ = sluice.exit().await;
    ads.stop();
}

/// Before the first push: requests get UNAVAILABLE (Envoy's failure_mode_deny decides) and,
/// without FORCE_START_WITHOUT_INITIAL_CONFIG (or with HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED),
/// readiness fails until a config is in; with it, readiness passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_the_first_push_requests_are_unavailable_and_readiness_follows_the_settings() {
    use sluice::server::xds::{Backoff, XdsSettings};
    use sluice::server::ServerConfig;
    use sluice::service::ServiceOptions;
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").expect("port");
    let url = nobody.local_addr().expect("addr").to_string();
    drop(nobody);
    for ready_needs_config in [true, false] {
        let clock = sluice::clock::ManualClock::new(crate::support::T0);
        let config = ServerConfig {
            xds: Some(XdsSettings {
                server_url: url.clone(),
                node_id: "n".into(),
                node_metadata: Vec::new(),
                headers: Vec::new(),
                connect_retry_interval: std::time::Duration::from_secs(3600),
                tls: None,
                backoff: Backoff::default(),
                max_message_bytes: None,
                merge_domains: false,
                calendar_months: false,
            }),
            ..ServerConfig::from_ingredients(sluice::app::Ingredients {
                rules: None,
                options: ServiceOptions {
                    ready_needs_config,
                    ..ServiceOptions::default()
                },
                ..sluice::app::Ingredients::for_tests(
                    sluice::config::RuleSet::empty(),
                    std::sync::Arc::new(clock.clone()),
                )
            })
        };
        let s = crate::support::TestServer::start_config(config, clock).await;
        let e = s
            .client()
            .await
            .should_rate_limit(crate::support::one("d", &[("k", "v")]))
            .await
            .expect_err("no config yet");
        assert_eq!(e.code(), tonic::Code::Unavailable);
        assert!(
            e.message()
                .contains("no rate limit configuration loaded yet"),
            "{e:?}"
        );
        let (code, body) = crate::support::http(s.http_addr, "GET", "/healthcheck", "").await;
        if ready_needs_config {
            assert_eq!(
                (code, body.trim()),
                (500, "no rate limit configuration loaded yet")
            );
        } else {
            assert_eq!(code, 200, "{body}");
        }
        s.stop().await;
    }
}
