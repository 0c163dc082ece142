//! Real Envoy (1.40) in front of real sluice processes, on the shipped configs of
//! `config/examples/envoy/` (ports substituted): request-phase limits and the headers Envoy
//! builds, cost per request, token budgets reported when a response is done (in the shapes
//! AI Gateway and Envoy Gateway generate), exact concurrency through Envoy on Redis and Cluster,
//! Envoy's failure modes, a rolling restart under load, a burst, and a Unix socket.
//!
//! Nothing here times anything: Envoy runs on its own clock, so the tests wait on counts
//! (Envoy's `/stats`, sluice's answers) and assert on counts.

use crate::support::binary::{self, SluiceProcess};
use crate::support::envoy::{self, Backend, EnvoyProcess};
use crate::support::redis::{start_cluster, start_redis};
use crate::support::*;
use std::net::SocketAddr;

/// The Envoy examples' sluice rules.
fn rules_dir() -> std::path::PathBuf {
    envoy::example("sluice")
}

pub(super) async fn sluice(envs: &[(&str, &str)]) -> SluiceProcess {
    let mut cmd = binary::serve(rules_dir());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    SluiceProcess::spawn(cmd).await
}

/// Envoy on the shipped `envoy.yaml`: the backend and the two sluice endpoints substituted.
pub(super) async fn front(backend: &Backend, a: SocketAddr, b: SocketAddr) -> EnvoyProcess {
    EnvoyProcess::start(
        &envoy::example("envoy.yaml"),
        &[
            (envoy::BACKEND_PORT, backend.port),
            (envoy::SLUICE_PORTS[0], a.port()),
            (envoy::SLUICE_PORTS[1], b.port()),
        ],
    )
    .await
}

/// RLS calls Envoy made to sluice that completed (request phase and stream done alike; active
/// health checks are counted apart).
pub(super) const RLS_OK: &str = "cluster.sluice.upstream_rq_completed";

/// One request; for a token route, waits until Envoy's report at stream end has been answered
/// (`calls` more RLS calls than before), so the next request sees it recorded.
pub(super) async fn request_then_wait(
    e: &EnvoyProcess,
    path: &str,
    headers: &[(&str, &str)],
    calls: u64,
) -> u16 {
    let before = e.stat(RLS_OK).await;
    let (status, _) = e.get(path, headers).await;
    let want = before + if status == 200 { calls } else { 1 };
    eventually(&format!("{path}: {want} RLS calls answered"), || async {
        e.stat(RLS_OK).await >= want
    })
    .await;
    status
}

async fn sequence(e: &EnvoyProcess, path: &str, headers: &[(&str, &str)], n: usize) -> Vec<u16> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(request_then_wait(e, path, headers, 2).await);
    }
    out
}

pub(super) async fn wait_healthy(e: &EnvoyProcess, n: u64) {
    eventually(&format!("Envoy sees {n} healthy sluice hosts"), || async {
        e.healthy_hosts("sluice").await == n
    })
    .await;
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_route_limits_429_and_rate_limit_headers_through_envoy() {
    let backend = Backend::start().await;
    let s = sluice(&[("LIMIT_RESPONSE_HEADERS_ENABLED", "true")]).await;
    let e = front(&backend, s.grpc, s.grpc).await;
    let acme = [("x-tenant", "acme")];
    let mut statuses = Vec::new();
    let mut heads = Vec::new();
    for _ in 0..4 {
        let (status, head) = e.get("/api/login", &acme).await;
        statuses.push(status);
        heads.push(head);
    }
    assert_eq!(statuses, [200, 200, 200, 429], "3 per minute on /api/login");
    // Envoy's draft-03 headers, built from sluice's statuses.
    assert_eq!(
        header(&heads[0], "x-ratelimit-limit").map(|v| v.starts_with('3')),
        Some(true),
        "{}",
        heads[0]
    );
    assert_eq!(
        header(&heads[0], "x-ratelimit-remaining"),
        Some("2"),
        "{}",
        heads[0]
    );
    assert!(
        header(&heads[0], "x-ratelimit-reset").is_some(),
        "{}",
        heads[0]
    );
    // sluice's own RateLimit-* headers, passed through by Envoy.
    assert_eq!(
        header(&heads[1], "ratelimit-limit"),
        Some("3"),
        "{}",
        heads[1]
    );
    assert_eq!(
        header(&heads[1], "ratelimit-remaining"),
        Some("1"),
        "{}",
        heads[1]
    );
    // The denial.
    assert_eq!(
        header(&heads[3], "x-envoy-ratelimited"),
        Some("true"),
        "{}",
        heads[3]
    );
    assert_eq!(
        header(&heads[3], "x-ratelimit-remaining"),
        Some("0"),
        "{}",
        heads[3]
    );
    // Another path of the same tenant has its own limit; another tenant its own counter.
    assert_eq!(e.get("/api/orders", &acme).await.0, 200);
    assert_eq!(e.get("/api/login", &[("x-tenant", "globex")]).await.0, 200);
    assert_eq!(e.stat("cluster.backend.ratelimit.over_limit").await, 1);
    assert_eq!(e.stat("cluster.backend.ratelimit.error").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_per_request_from_a_header_by_counting() {
    let backend = Backend::start().await;
    let s = sluice(&[]).await;
    let e = front(&backend, s.grpc, s.grpc).await;
    let cost = |c: &'static str| [("x-tenant", "acme"), ("x-cost", c)];
    // envoyproxy counting: 4 + 4 fit the 10; the third 4 is denied and still recorded (12),
    // so a request of 1 is denied too.
    let mut got = Vec::new();
    for c in ["4", "4", "4", "1"] {
        got.push(e.get("/cost", &cost(c)).await.0);
    }
    assert_eq!(got, [200, 200, 429, 429], "envoyproxy counting");
    // all_or_nothing: the denied 4 charges nothing, so 2 still fit (8 + 2 = 10).
    let mut got = Vec::new();
    for c in ["4", "4", "4", "2", "1"] {
        got.push(e.get("/aon/cost", &cost(c)).await.0);
    }
    assert_eq!(got, [200, 200, 429, 200, 429], "all_or_nothing counting");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_budgets_reported_at_stream_end_are_never_lost() {
    let backend = Backend::start().await;
    let s = sluice(&[]).await;
    let e = front(&backend, s.grpc, s.grpc).await;
    let user = |u: &'static str, tokens: &'static str| [("x-user", u), ("x-tokens", tokens)];
    // AI Gateway: check (hits 0) at request time, tokens at stream end. Budget 1000.
    assert_eq!(
        sequence(&e, "/ai", &user("u400", "400"), 6).await,
        [200, 200, 200, 429, 429, 429],
        "AI Gateway shape, responses of 400"
    );
    assert_eq!(
        sequence(&e, "/ai", &user("u250", "250"), 7).await,
        [200, 200, 200, 200, 200, 429, 429],
        "AI Gateway shape, responses of 250: the check at exactly 1000 passes"
    );
    // Envoy Gateway's default: 1 at request time, tokens at stream end (401, 802, 1203).
    assert_eq!(
        sequence(&e, "/eg", &user("u400", "400"), 6).await,
        [200, 200, 200, 429, 429, 429],
        "Envoy Gateway shape"
    );
    // The budget as a record_usage limit under a resource limit, in an all_or_nothing domain.
    assert_eq!(
        sequence(&e, "/aon/ai", &user("u400", "400"), 6).await,
        [200, 200, 200, 429, 429, 429],
        "record_usage in an all_or_nothing hierarchy, 400"
    );
    assert_eq!(
        sequence(&e, "/aon/ai", &user("u250", "250"), 7).await,
        [200, 200, 200, 200, 200, 429, 429],
        "record_usage in an all_or_nothing hierarchy, 250"
    );
    // QuotaPolicy: quota_mode limits on backends a and b, a hit on each at request time, the
    // tokens on a. A is over after the third response, b never: as in envoyproxy, a request
    // is denied only when every quota limit is, so all pass; a's usage is all recorded.
    assert_eq!(
        sequence(&e, "/quota", &user("uq", "400"), 5).await,
        [200, 200, 200, 200, 200],
        "QuotaPolicy shape"
    );
    let mut peek = desc(&[("quota_user", "uq"), ("backend", "a")]);
    peek.hits_addend = Some(0);
    let mut client =
        sluice::proto::rate_limit_service_client::RateLimitServiceClient::connect(s.grpc_url())
            .await
            .expect("connect");
    let r = client
        .should_rate_limit(request("edge", vec![peek]))
        .await
        .expect("answer")
        .into_inner();
    assert_eq!(r.statuses[0].limit_remaining, 0, "a holds 5 x 401 > 1000");
    assert_eq!(e.stat("cluster.backend.ratelimit.error").await, 0);
}

/// 120 concurrent requests through Envoy against a limit of 5, two sluice replicas sharing one
/// store: exactly 5 get through. What is tested is exactness under concurrency, not how fast a
/// debug build talks to Redis on two busy cores: the store's own budget (`REDIS_TIMEOUT`, 100 ms
/// by default) is raised to Envoy's 1 s, so a slow machine cannot turn a decision into
/// UNAVAILABLE (seen once on a clean clone: one `ratelimit.error` in the Cluster case while
/// another suite ran beside it).
async fn exactly_five(envs: &[(&str, &str)]) {
    let backend = Backend::start().await;
    let mut envs = envs.to_vec();
    envs.push(("REDIS_TIMEOUT", "1s"));
    let a = sluice(&envs).await;
    let b = sluice(&envs).await;
    let e = front(&backend, a.grpc, b.grpc).await;
    wait_healthy(&e, 2).await;
    // Both replicas decide on their store (a Cluster client connects on first use) before the
    // burst, so the burst measures decisions, not connection set-up.
    for s in [&a, &b] {
        decides(s).await;
    }
    let mut tasks = Vec::new();
    for _ in 0..120 {
        let front = e.front;
        tasks.push(tokio::spawn(async move {
            http_request(front, "GET", "/burst", &[], "").await.0
        }));
    }
    let mut ok = 0;
    let mut denied = 0;
    for t in tasks {
        match t.await.expect("request") {
            200 => ok += 1,
            429 => denied += 1,
            other => panic!("unexpected status {other}"),
        }
    }
    let errors = e.stat("cluster.backend.ratelimit.error").await;
    assert_eq!(errors, 0, "replica logs:\n{}\n{}", a.log(), b.log());
    assert_eq!((ok, denied), (5, 115));
}

/// Polls until `s` answers a decision (on the never-denying `load` key).
async fn decides(s: &SluiceProcess) {
    let url = s.grpc_url();
    poll_until("sluice decides on its store", || {
        let url = url.clone();
        async move {
            let mut c =
                sluice::proto::rate_limit_service_client::RateLimitServiceClient::connect(url)
                    .await
                    .map_err(|e| e.to_string())?;
            c.should_rate_limit(one("edge", &[("load", "warm-up")]))
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_through_envoy_admit_exactly_the_limit_on_redis() {
    let redis = start_redis(&[]).await;
    exactly_five(&[("REDIS_URL", redis.url().as_str())]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_through_envoy_admit_exactly_the_limit_on_a_cluster() {
    let cluster = start_cluster().await;
    let seeds = cluster.seeds().join(",");
    exactly_five(&[("REDIS_TYPE", "cluster"), ("REDIS_URL", seeds.as_str())]).await;
}

/// sluice unreachable: `failure_mode_deny: false` (the shipped file) lets requests through,
/// `true` gives Envoy's 500; once sluice is back, Envoy decides through it again, unrestarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_modes_and_recovery_without_restarting_envoy() {
    let backend = Backend::start().await;
    let (guard, gone) = binary::refused_addr();
    let shipped = std::fs::read_to_string(envoy::example("envoy.yaml")).expect("read envoy.yaml");
    let subst = |yaml: &str| {
        yaml.replace("port_value: 9901 ", "port_value: 0 ")
            .replace("port_value: 10000 ", "port_value: 0 ")
            .replace(
                "port_value: 10001 ",
                &format!("port_value: {} ", backend.port),
            )
            .replace(
                "port_value: 8081 ",
                &format!("port_value: {} ", gone.port()),
            )
            .replace(
                "port_value: 8082 ",
                &format!("port_value: {} ", gone.port()),
            )
    };
    let allow = EnvoyProcess::start_yaml(&subst(&shipped)).await;
    // The one knob this scenario turns besides ports.
    let deny_yaml = shipped.replace("failure_mode_deny: false", "failure_mode_deny: true");
    assert_ne!(deny_yaml, shipped);
    let deny = EnvoyProcess::start_yaml(&subst(&deny_yaml)).await;
    let acme = [("x-tenant", "acme")];
    for _ in 0..3 {
        assert_eq!(allow.get("/api/login", &acme).await.0, 200);
        assert_eq!(deny.get("/api/login", &acme).await.0, 500);
    }
    assert_eq!(
        allow
            .stat("cluster.backend.ratelimit.failure_mode_allowed")
            .await,
        3
    );
    assert_eq!(deny.stat("cluster.backend.ratelimit.error").await, 3);
    // sluice comes up on the address Envoy knows.
    drop(guard);
    let port = gone.port().to_string();
    let _s = sluice(&[("GRPC_PORT", port.as_str())]).await;
    for e in [&allow, &deny] {
        wait_healthy(e, 2).await;
        let mut got = Vec::new();
        for _ in 0..4 {
            got.push(e.get("/api/login", &acme).await.0);
        }
        // One sluice behind both Envoys: the first Envoy used the 3 of this minute.
        if std::ptr::eq(e, &allow) {
            assert_eq!(got, [200, 200, 200, 429], "decisions resume");
        } else {
            assert_eq!(
                got,
                [429, 429, 429, 429],
                "decisions resume, the same counter"
            );
        }
    }
}

/// h2load through Envoy (h2c, many streams): every request reaches a decision, none fails.
async fn burst(s: &SluiceProcess, requests: usize) {
    decides(s).await;
    let backend = Backend::start().await;
    let e = front(&backend, s.grpc, s.grpc).await;
    let url = format!("http://{}/load", e.front);
    let n = requests.to_string();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("h2load")
            .args(["-n", &n, "-c", "10", "-m", "10", &url])
            .output()
            .expect("h2load (scripts/test.sh installs nghttp2-client)")
    })
    .await
    .expect("join");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(&format!("{requests} succeeded"))
            || text.contains(&format!("{requests} 2xx")),
        "{text}"
    );
    let ok = e.stat("cluster.backend.ratelimit.ok").await;
    if ok != requests as u64 {
        let errors = e.stat("cluster.backend.ratelimit.error").await;
        let (_, metrics) = http(s.http, "GET", "/metrics", "").await;
        let store: Vec<&str> = metrics
            .lines()
            .filter(|l| l.starts_with("sluice_store_errors_total"))
            .collect();
        panic!(
            "ratelimit.ok {ok} of {requests}, ratelimit.error {errors}, sluice {store:?}\n{text}\n\
             sluice logged:\n{}",
            s.log()
        );
    }
    assert_eq!(e.stat("cluster.backend.ratelimit.error").await, 0);
    assert_eq!(
        e.stat("cluster.backend.ratelimit.failure_mode_allowed")
            .await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_20000_through_envoy_has_no_rate_limit_errors_on_memory() {
    let s = sluice(&[]).await;
    burst(&s, 20_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_20000_through_envoy_has_no_rate_limit_errors_on_redis() {
    let redis = start_redis(&[]).await;
    // The store's deadline as long as Envoy's own (the example's `timeout: 1s`): what this
    // checks is that every call is decided, not that the suite's other tests, sharing two
    // cores, never hold a Redis call past the default 100 ms. Two clean runs (`5051785`,
    // `585f88e`) had 809 and 1 293 of 20 000 calls not `ratelimit.ok`, h2load crawling at
    // 1 145 requests/s the second time; store timeouts are the likely cause (the failure now
    // prints Envoy's error count and sluice's store errors and log). REDIS_TIMEOUT's own
    // behaviour is tested in redis_faults.rs.
    let s = sluice(&[("REDIS_URL", redis.url().as_str()), ("REDIS_TIMEOUT", "1s")]).await;
    burst(&s, 20_000).await;
}

/// A rolling restart under load: one of two replicas (Redis) gets SIGTERM while h2load drives
/// Envoy, and comes back on its port. sluice reports NOT_SERVING while still answering for its
/// drain delay, Envoy's health checks take it out first: no decision fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_restarted_under_load_gives_no_rate_limit_errors() {
    let redis = start_redis(&[]).await;
    let url = redis.url();
    // Longer than the shipped health check's interval x unhealthy threshold (1 s x 2).
    let delay = [("SHUTDOWN_DRAIN_DELAY", "4s")];
    // The store's deadline as long as Envoy's own (the example's `timeout: 1s`), as in the
    // burst tests: a debug build on two busy cores must not turn a slow Redis reply into an
    // error this test would blame on the restart.
    let env = |extra: &[(&'static str, String)]| {
        let mut v: Vec<(&'static str, String)> = vec![
            ("REDIS_URL", url.clone()),
            (delay[0].0, delay[0].1.into()),
            ("REDIS_TIMEOUT", "1s".into()),
        ];
        v.extend_from_slice(extra);
        v
    };
    let start = |vars: Vec<(&'static str, String)>| async move {
        let pairs: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        sluice(&pairs).await
    };
    let a = start(env(&[])).await;
    let b = start(env(&[])).await;
    let backend = Backend::start().await;
    let e = front(&backend, a.grpc, b.grpc).await;
    wait_healthy(&e, 2).await;
    for s in [&a, &b] {
        decides(s).await;
    }

    // Load in the background until told to stop: h2load runs back to back.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load_url = format!("http://{}/load", e.front);
    let flag = stop.clone();
    let load = tokio::task::spawn_blocking(move || {
        let mut runs = 0;
        while !flag.load(std::sync::atomic::Ordering::SeqCst) || runs == 0 {
            let out = std::process::Command::new("h2load")
                .args(["-n", "2000", "-c", "4", "-m", "4", &load_url])
                .output()
                .expect("h2load");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stdout)
            );
            runs += 1;
        }
        runs
    });
    // Some load before, then the restart of `a` on the same port.
    eventually("load reaches sluice", || async {
        e.stat("cluster.backend.ratelimit.ok").await > 2000
    })
    .await;
    let port = a.grpc.port().to_string();
    let mut a = a;
    a.sigterm();
    let (status, log) = a.exit().await;
    assert_eq!(status, Some(0), "{log}");
    let _a2 = start(env(&[("GRPC_PORT", port)])).await;
    wait_healthy(&e, 2).await;
    let after = e.stat("cluster.backend.ratelimit.ok").await;
    eventually("load goes on after the restart", || async {
        e.stat("cluster.backend.ratelimit.ok").await > after + 2000
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let runs = load.await.expect("load");
    assert!(runs >= 2, "the load spanned the restart");
    // What the restart controls: no call Envoy made to sluice was refused, reset or cut (the
    // drain answers everything in flight, and health checks take the replica out first).
    let cut = [
        "cluster.sluice.upstream_cx_connect_fail",
        "cluster.sluice.upstream_rq_rx_reset",
        "cluster.sluice.upstream_rq_tx_reset",
        "cluster.sluice.upstream_rq_pending_failure_eject",
    ];
    let (_, stats) = crate::support::http(e.admin, "GET", "/stats", "").await;
    for stat in cut.iter().chain(&["cluster.sluice.upstream_rq_timeout"]) {
        assert!(
            stats.contains(&format!("\n{stat}: ")),
            "Envoy has no stat {stat}"
        );
    }
    for stat in cut {
        assert_eq!(e.stat(stat).await, 0, "{stat}: the restart cut RLS calls");
    }
    // An error is otherwise only Envoy giving up on its own 1 s timer (a debug sluice on two
    // busy cores: seen 3 of ~10 000 under `stress-ng --cpu 2` beside the suite), never an
    // answer sluice failed: every error is one of Envoy's timeouts.
    let errors = e.stat("cluster.backend.ratelimit.error").await;
    let allowed = e
        .stat("cluster.backend.ratelimit.failure_mode_allowed")
        .await;
    let timeouts = e.stat("cluster.sluice.upstream_rq_timeout").await;
    assert!(
        errors <= timeouts && allowed <= timeouts,
        "{errors} rate-limit errors ({allowed} allowed by failure mode), only {timeouts} of \
         them Envoy's own timeouts"
    );
    drop(b);
}

/// Envoy reaching sluice over `GRPC_UDS` (a `pipe` address in the shipped envoy-uds.yaml).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_over_a_unix_socket() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("sluice.sock");
    let sock_str = sock.to_str().expect("utf-8").to_string();
    let _s = sluice(&[("GRPC_UDS", sock_str.as_str())]).await;
    let backend = Backend::start().await;
    let yaml = std::fs::read_to_string(envoy::example("envoy-uds.yaml"))
        .expect("read envoy-uds.yaml")
        .replace("port_value: 9901 ", "port_value: 0 ")
        .replace("port_value: 10000 ", "port_value: 0 ")
        .replace(
            "port_value: 10001 ",
            &format!("port_value: {} ", backend.port),
        )
        .replace("path: /tmp/sluice.sock", &format!("path: {sock_str}"));
    let e = EnvoyProcess::start_yaml(&yaml).await;
    let mut got = Vec::new();
    for _ in 0..4 {
        got.push(e.get("/api/login", &[("x-tenant", "acme")]).await.0);
    }
    assert_eq!(got, [200, 200, 200, 429]);
    assert_eq!(e.stat("cluster.backend.ratelimit.error").await, 0);
}
