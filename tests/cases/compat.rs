//! The rest of envoyproxy/ratelimit's surface, one test each against its documented behaviour:
//! `MERGE_DOMAIN_CONFIG`, `GRPC_UDS`, the debug listener, `RESPONSE_DYNAMIC_METADATA`,
//! `quota_mode` and `QUOTA_MODE`.

use crate::support::*;
use sluice::clock::ManualClock;
use sluice::config::{load_path, LoadOptions};
use sluice::proto::rate_limit_response::Code;
use sluice::server::ServerConfig;
use std::sync::Arc;

fn options(merge_domains: bool) -> LoadOptions {
    LoadOptions {
        ignore_dotfiles: false,
        merge_domains,
        calendar_months: false,
        global_store: false,
    }
}

/// Two files of one domain: refused by default; with MERGE_DOMAIN_CONFIG each adds its
/// descriptors; a top-level descriptor in both is still refused, naming the second file.
#[tokio::test]
async fn merge_domain_config_merges_files_of_one_domain() {
    let dir = tempfile::tempdir().expect("dir");
    let write =
        |name: &str, text: &str| std::fs::write(dir.path().join(name), text).expect("write");
    write(
        "a.yaml",
        "domain: shop\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1}\n",
    );
    write(
        "b.yaml",
        "domain: shop\ndescriptors:\n  - key: path\n    value: /cart\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
    );
    let e = load_path(dir.path(), &options(false)).expect_err("a domain twice");
    assert!(e.to_string().contains("duplicate domain 'shop'"), "{e}");

    let rules = load_path(dir.path(), &options(true)).expect("merged");
    let clock = ManualClock::new(T0);
    let s = TestServer::start_config(
        ServerConfig::for_tests(rules, Arc::new(clock.clone())),
        clock,
    )
    .await;
    let user = one("shop", &[("user", "u1")]);
    let cart = one("shop", &[("path", "/cart")]);
    assert_eq!(code(&s.call(user.clone()).await), Code::Ok);
    assert_eq!(code(&s.call(user).await), Code::OverLimit, "a.yaml's limit");
    assert_eq!(code(&s.call(cart.clone()).await), Code::Ok);
    assert_eq!(code(&s.call(cart.clone()).await), Code::Ok);
    assert_eq!(code(&s.call(cart).await), Code::OverLimit, "b.yaml's limit");
    s.stop().await;

    write(
        "c.yaml",
        "domain: shop\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 9}\n",
    );
    let e = load_path(dir.path(), &options(true)).expect_err("user twice");
    let text = e.to_string();
    assert!(text.contains("c.yaml"), "{text}");
    assert!(
        text.contains("duplicate descriptor composite key 'shop.user'"),
        "{text}"
    );
}

/// `GRPC_UDS`: gRPC on a Unix socket (grpcurl, a real client, calls through it); a stale socket
/// file from an earlier run does not stop the start, and a clean stop removes the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_uds_serves_on_a_unix_socket() {
    let dir = tempfile::tempdir().expect("dir");
    let sock = dir.path().join("ratelimit.sock");
    drop(std::os::unix::net::UnixListener::bind(&sock).expect("a stale socket file"));
    assert!(sock.exists());
    let clock = ManualClock::new(T0);
    let config = ServerConfig {
        grpc_uds: Some(sock.clone()),
        ..ServerConfig::for_tests(
            rules("domain: uds\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1}\n"),
            Arc::new(clock.clone()),
        )
    };
    let s = TestServer::start_config(config, clock).await;
    let sock_arg = sock.to_str().expect("utf-8 path").to_string();
    // grpc-go (grpcurl) sends the socket path as :authority; sluice accepts it (uds_authority).
    let list_arg = sock_arg.clone();
    let target = format!("unix://{sock_arg}");
    let (ok, out, err) =
        tokio::task::spawn_blocking(move || grpcurl(&["-plaintext", "-unix", &list_arg, "list"]))
            .await
            .expect("grpcurl");
    assert!(ok, "grpcurl list over the socket: {err}");
    assert!(
        out.lines()
            .any(|l| l.trim() == "envoy.service.ratelimit.v3.RateLimitService"),
        "{out}"
    );
    let call = move || {
        grpcurl(&[
            "-plaintext",
            "-unix",
            "-d",
            r#"{"domain":"uds","descriptors":[{"entries":[{"key":"k","value":"v"}]}]}"#,
            &sock_arg,
            "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        ])
    };
    let first = tokio::task::spawn_blocking(call.clone())
        .await
        .expect("grpcurl");
    assert!(first.0, "{}", first.2);
    assert!(first.1.contains("\"overallCode\": \"OK\""), "{}", first.1);
    let second = tokio::task::spawn_blocking(call).await.expect("grpcurl");
    assert!(
        second.1.contains("\"overallCode\": \"OVER_LIMIT\""),
        "{}",
        second.1
    );
    // gRPC-core (Python grpcio, Envoy's generated stubs) over `unix://`: its :authority is the
    // %-encoded path, also accepted.
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/rls_client.py");
    let out = tokio::task::spawn_blocking(move || {
        let mut child = std::process::Command::new("python3")
            .args([script, &target])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("python3 (scripts/test.sh installs xds-protos and grpcio)");
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        writeln!(stdin, r#"{{"domain":"uds","descriptors":[[["k","w"]]]}}"#).expect("write");
        drop(stdin);
        child.wait_with_output().expect("the client ran")
    })
    .await
    .expect("join");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("\"code\": \"OK\""),
        "python over the socket: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The Rate Limit Quota Service on the same socket: grpcurl streams one usage report (the
    // key's counter is spent) and gets the bucket's assignment, DENY_ALL until the hour ends.
    let rlqs_sock = sock.to_str().expect("utf-8 path").to_string();
    let (ok, out, err) = tokio::task::spawn_blocking(move || {
        grpcurl(&[
            "-plaintext",
            "-unix",
            "-d",
            r#"{"domain":"uds","bucketQuotaUsages":[{"bucketId":{"bucket":{"k":"q"}},"numRequestsAllowed":"1"}]}"#,
            &rlqs_sock,
            "envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas",
        ])
    })
    .await
    .expect("grpcurl");
    assert!(ok, "RLQS over the socket: {err}");
    assert!(
        out.contains("\"blanketRule\": \"DENY_ALL\"") && out.contains("\"k\": \"q\""),
        "{out}"
    );
    s.stop().await;
    assert!(!sock.exists(), "the socket file is removed at a clean stop");
}

/// `DEBUG_HOST:DEBUG_PORT`: the index of endpoints, `/rlconfig`, `/stats` with envoyproxy's stat
/// names; a debug port that is taken is skipped, as in envoyproxy, not a failed start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_listener_lists_rlconfig_and_stats() {
    let yaml = "domain: dbg\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 5}\n";
    let clock = ManualClock::new(T0);
    let config = ServerConfig {
        debug_addr: Some("127.0.0.1:0".parse().expect("addr")),
        ..ServerConfig::for_tests(rules(yaml), Arc::new(clock.clone()))
    };
    let s = TestServer::start_config(config, clock).await;
    s.call(one("dbg", &[("k", "v")])).await;
    let addr = s
        .running
        .as_ref()
        .and_then(|r| r.debug_addr())
        .expect("debug listener");
    let (code, index) = http(addr, "GET", "/", "").await;
    assert_eq!(code, 200);
    assert!(
        index.contains("/rlconfig: ") && index.contains("/stats: "),
        "{index}"
    );
    let (code, config) = http(addr, "GET", "/rlconfig", "").await;
    assert_eq!(code, 200);
    assert!(
        config.contains("dbg.k: unit=HOUR requests_per_unit=5"),
        "{config}"
    );
    let (code, stats) = http(addr, "GET", "/stats", "").await;
    assert_eq!(code, 200);
    assert!(
        stats.contains("ratelimit.service.rate_limit.dbg.k.total_hits: 1\n"),
        "{stats}"
    );
    assert!(
        stats.contains("ratelimit.service.config_load_success: 1\n"),
        "{stats}"
    );
    s.stop().await;

    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a taken port");
    let clock = ManualClock::new(T0);
    let config = ServerConfig {
        debug_addr: Some(taken.local_addr().expect("addr")),
        ..ServerConfig::for_tests(rules(yaml), Arc::new(clock.clone()))
    };
    let s = TestServer::start_config(config, clock).await;
    assert_eq!(s.running.as_ref().and_then(|r| r.debug_addr()), None);
    assert_eq!(code_of(&s).await, Code::Ok, "the service runs without it");
    s.stop().await;
}

async fn code_of(s: &TestServer) -> Code {
    code(&s.call(one("dbg", &[("k", "v")])).await)
}

/// `RESPONSE_DYNAMIC_METADATA`: the domain, every descriptor's entries, the request's
/// hits_addend, and the config `metadata` of the descriptors that passed, merged in request
/// order (first value wins, mappings merge); a descriptor over its limit adds none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_dynamic_metadata_is_built_as_envoyproxy_builds_it() {
    use prost_types::value::Kind;
    let yaml = r#"
domain: meta
descriptors:
  - key: plan
    value: gold
    metadata: {tier: gold, team: {a: 1}, tags: [x, z]}
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: region
    metadata: {tier: silver, team: {b: true}}
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: blocked
    metadata: {denied: yes}
    rate_limit: {unit: hour, requests_per_unit: 0}
"#;
    let options = sluice::service::ServiceOptions {
        response_dynamic_metadata: true,
        ..Default::default()
    };
    let s = TestServer::start_with(yaml, options).await;
    let mut req = request(
        "meta",
        vec![
            desc(&[("plan", "gold")]),
            desc(&[("region", "eu")]),
            desc(&[("blocked", "1")]),
        ],
    );
    req.hits_addend = 2;
    let r = s.call(req).await;
    assert_eq!(code(&r), Code::OverLimit);
    let m = r.dynamic_metadata.expect("dynamic metadata");
    let json = |v: &prost_types::Value| -> serde_json::Value {
        fn conv(v: &prost_types::Value) -> serde_json::Value {
            match &v.kind {
                Some(Kind::StringValue(s)) => s.clone().into(),
                Some(Kind::NumberValue(n)) => (*n).into(),
                Some(Kind::BoolValue(b)) => (*b).into(),
                Some(Kind::ListValue(l)) => l.values.iter().map(conv).collect(),
                Some(Kind::StructValue(s)) => s
                    .fields
                    .iter()
                    .map(|(k, v)| (k.clone(), conv(v)))
                    .collect::<serde_json::Map<_, _>>()
                    .into(),
                _ => serde_json::Value::Null,
            }
        }
        conv(v)
    };
    let all = json(&prost_types::Value {
        kind: Some(Kind::StructValue(m)),
    });
    assert_eq!(
        all,
        serde_json::json!({
            "domain": "meta",
            "descriptors": [
                {"entries": ["plan=gold"]},
                {"entries": ["region=eu"]},
                {"entries": ["blocked=1"]},
            ],
            "hitsAddend": 2.0,
            "metadata": {"tier": "gold", "team": {"a": 1.0, "b": true}, "tags": ["x", "z"]},
        })
    );
    s.stop().await;
}

const QUOTA: &str = r#"
domain: quota
counting: all_or_nothing
descriptors:
  - key: plan
    value: free
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: plan
    value: burst
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: ip
    rate_limit: {unit: hour, requests_per_unit: 2}
"#;

/// `n` calls of a two-descriptor request: (overall, first status, second status, second's
/// remaining) each time.
async fn two_statuses(
    s: &TestServer,
    req: &sluice::proto::RateLimitRequest,
    n: usize,
) -> Vec<(Code, Code, Code, u32)> {
    let mut seen = Vec::new();
    for _ in 0..n {
        let r = s.call(req.clone()).await;
        seen.push((
            code(&r),
            status_code(&r.statuses[0]),
            status_code(&r.statuses[1]),
            r.statuses[1].limit_remaining,
        ));
    }
    seen
}

/// `quota_mode` as envoyproxy/ratelimit decides it (#1045/#1059): the request is over limit if
/// any normal limit is, or if every quota limit is; a quota descriptor over its limit still
/// reports OVER_LIMIT in its own status. sluice also charges nothing for a rejected request and
/// nothing on a quota limit that is already over.
#[tokio::test]
async fn quota_mode_is_over_limit_only_when_every_quota_limit_is() {
    let s = TestServer::start(QUOTA).await;
    let quotas = request(
        "quota",
        vec![desc(&[("plan", "free")]), desc(&[("plan", "burst")])],
    );
    assert_eq!(
        two_statuses(&s, &quotas, 4).await,
        [
            (Code::Ok, Code::Ok, Code::Ok, 2),
            (Code::Ok, Code::OverLimit, Code::Ok, 1),
            (Code::Ok, Code::OverLimit, Code::Ok, 0),
            (Code::OverLimit, Code::OverLimit, Code::OverLimit, 0),
        ]
    );

    // A lone quota limit that is over makes the request over limit (every quota limit is).
    let lone = request(
        "quota",
        vec![desc(&[("ip", "10.0.0.2")]), desc(&[("plan", "free")])],
    );
    let r = s.call(lone).await;
    assert_eq!(
        code(&r),
        Code::OverLimit,
        "free is spent and is the only quota limit"
    );
    assert_eq!(status_code(&r.statuses[0]), Code::Ok);
    assert_eq!(
        r.statuses[0].limit_remaining, 2,
        "and the rejected request charged no ip"
    );

    // A normal limit over its limit makes the request over limit even with quota to spare, and
    // the rejected request takes nothing from that quota.
    let fresh_quota = TestServer::start(QUOTA).await;
    let mixed = request(
        "quota",
        vec![desc(&[("ip", "10.0.0.3")]), desc(&[("plan", "burst")])],
    );
    assert_eq!(
        two_statuses(&fresh_quota, &mixed, 3).await,
        [
            (Code::Ok, Code::Ok, Code::Ok, 2),
            (Code::Ok, Code::Ok, Code::Ok, 1),
            // ip (2/hour) is over: over limit; burst keeps its 1.
            (Code::OverLimit, Code::OverLimit, Code::Ok, 1),
        ]
    );
    fresh_quota.stop().await;
    s.stop().await;
}

/// `QUOTA_MODE=true` makes every limit a quota-mode limit: one descriptor over its limit no
/// longer denies a request while another still has room.
#[tokio::test]
async fn global_quota_mode_treats_every_limit_as_quota() {
    let s = TestServer::start_with(
        QUOTA,
        sluice::service::ServiceOptions {
            global_quota_mode: true,
            ..Default::default()
        },
    )
    .await;
    let two = request(
        "quota",
        vec![desc(&[("ip", "10.0.0.4")]), desc(&[("plan", "free")])],
    );
    assert_eq!(code(&s.call(two.clone()).await), Code::Ok);
    let r = s.call(two.clone()).await;
    assert_eq!(
        code(&r),
        Code::Ok,
        "ip still has room although free is spent"
    );
    assert_eq!(status_code(&r.statuses[1]), Code::OverLimit);
    let r = s.call(two).await;
    assert_eq!(code(&r), Code::OverLimit, "now every limit is over");
    s.stop().await;
}

/// HTTP/2 frames as a minimal client sees them on one connection: it sends the preface and
/// empty SETTINGS, acknowledges the server's SETTINGS and PINGs (as every client does, and as
/// the server's graceful shutdown waits for), and records each GOAWAY's (last stream id, error
/// code) until the server closes the connection.
async fn goaways_until_close(mut tcp: tokio::net::TcpStream) -> std::io::Result<Vec<(u32, u32)>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const SETTINGS: u8 = 0x4;
    const PING: u8 = 0x6;
    const GOAWAY: u8 = 0x7;
    const ACK: u8 = 0x1;
    let frame = |kind: u8, flags: u8, payload: &[u8]| {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend_from_slice(&[kind, flags, 0, 0, 0, 0]);
        f.extend_from_slice(payload);
        f
    };
    tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await?;
    tcp.write_all(&frame(SETTINGS, 0, &[])).await?;
    let mut goaways = Vec::new();
    loop {
        let mut head = [0u8; 9];
        match tcp.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(goaways),
            Err(e) => return Err(e),
        }
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0u8; len];
        tcp.read_exact(&mut payload).await?;
        match (head[3], head[4] & ACK) {
            (SETTINGS, 0) => tcp.write_all(&frame(SETTINGS, ACK, &[])).await?,
            (PING, 0) => tcp.write_all(&frame(PING, ACK, &payload)).await?,
            (GOAWAY, _) => {
                let word = |at: usize| {
                    u32::from_be_bytes([
                        payload[at],
                        payload[at + 1],
                        payload[at + 2],
                        payload[at + 3],
                    ])
                };
                goaways.push((word(0) & 0x7fff_ffff, word(4)));
            }
            _ => {}
        }
    }
}

/// GRPC_MAX_CONNECTION_AGE as grpc-go applies it for envoyproxy: once a connection is past its
/// age the server sends GOAWAY (NO_ERROR: first "no new streams soon", then, after a PING round
/// trip, the last stream it took) and closes the idle connection cleanly; requests go on over
/// a new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_max_connection_age_sends_goaway_then_closes() {
    let yaml = "domain: age\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 5}\n";
    let clock = ManualClock::new(T0);
    let config = ServerConfig {
        connection_age: Some(sluice::server::ConnectionAge {
            max: std::time::Duration::from_millis(300),
        }),
        grpc_threads: 1,
        ..ServerConfig::for_tests(rules(yaml), Arc::new(clock.clone()))
    };
    let s = TestServer::start_config(config, clock).await;
    let tcp = tokio::net::TcpStream::connect(s.grpc_addr)
        .await
        .expect("connect");
    // The bound only keeps a broken build from hanging the suite.
    let goaways =
        tokio::time::timeout(std::time::Duration::from_secs(60), goaways_until_close(tcp))
            .await
            .expect("the server closed the aged connection")
            .expect("a clean close, not a reset");
    assert!(!goaways.is_empty(), "a GOAWAY before the close");
    assert!(
        goaways.iter().all(|&(_, code)| code == 0),
        "every GOAWAY says NO_ERROR: {goaways:?}"
    );
    assert_eq!(
        goaways.last().map(|g| g.0),
        Some(0),
        "no stream was taken: {goaways:?}"
    );

    let r = s.call(one("age", &[("k", "v")])).await;
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 4);
    s.stop().await;
}
