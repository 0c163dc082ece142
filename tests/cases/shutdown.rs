//! SIGTERM with calls provably in flight, on the real binary and a real Redis. A test-owned
//! proxy between sluice and Redis holds every Redis script call, so the test knows (by counting
//! the held `EVALSHA`s, not by waiting) that all its calls are inside sluice waiting on Redis
//! when the signal arrives, and that shutdown has started (health NOT_SERVING, then the gRPC
//! listener refusing connections) before any of them can be answered. Nothing here depends on
//! wall time: every wait is for a condition, with a cap that only bounds a broken setup.

use crate::support::binary::{self, SluiceProcess};
use crate::support::proxy::RedisProxy;
use crate::support::redis::RedisServer;
use crate::support::*;
use sluice::proto::rate_limit_response::Code;
use sluice::proto::rate_limit_service_client::RateLimitServiceClient;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// Upper bound on waiting for any one condition; only there so a broken setup cannot hang.
const CAP: Duration = Duration::from_secs(60);

/// Every client value has its own counter of 10 per hour, so each call of the burst is admitted
/// (overall OK, 9 left) and no call depends on another.
const CONFIG: &str = "\
domain: shutdown
descriptors:
  - key: client
    rate_limit:
      unit: hour
      requests_per_unit: 10
";

/// The real `sluice serve`, its Redis behind `proxy`. Killed on drop.
struct Sluice {
    process: SluiceProcess,
    grpc: SocketAddr,
    _config: tempfile::TempDir,
}

impl Sluice {
    /// Starts sluice with `pool_size` Redis connections and `grace` as `SHUTDOWN_GRACE_PERIOD`,
    /// and waits until it is ready: gRPC health SERVING (its Redis PING went through the proxy)
    /// and one real decision answered OK (which also loads the script into Redis, so no call of
    /// the burst meets NOSCRIPT).
    async fn start(proxy: &RedisProxy, pool_size: usize, grace: &str) -> (Self, Channel) {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("shutdown.yaml");
        std::fs::write(&config, CONFIG).expect("write config");
        let mut command = binary::serve(&config);
        command
            .env("REDIS_URL", proxy.url())
            .env("REDIS_POOL_SIZE", pool_size.to_string())
            .env("REDIS_TIMEOUT", "30s")
            .env("SHUTDOWN_GRACE_PERIOD", grace);
        let process = SluiceProcess::spawn(command).await;
        let sluice = Self {
            grpc: process.grpc,
            process,
            _config: dir,
        };
        let channel = sluice.ready().await;
        (sluice, channel)
    }

    fn log(&self) -> String {
        self.process.log()
    }

    async fn ready(&self) -> Channel {
        let channel = Endpoint::from_shared(self.process.grpc_url())
            .expect("endpoint")
            .connect()
            .await
            .unwrap_or_else(|e| panic!("connect to a listening sluice: {e}\n{}", self.log()));
        let health = HealthClient::new(channel.clone());
        eventually("sluice is SERVING", || {
            let mut health = health.clone();
            async move {
                let status = health
                    .check(HealthCheckRequest {
                        service: String::new(),
                    })
                    .await
                    .map(|r| r.into_inner().status);
                matches!(status, Ok(s) if s == ServingStatus::Serving as i32)
            }
        })
        .await;
        let warm_up = RateLimitServiceClient::new(channel.clone())
            .should_rate_limit(one("shutdown", &[("client", "warm-up")]))
            .await
            .unwrap_or_else(|e| panic!("first decision failed: {e:?}\n{}", self.log()))
            .into_inner();
        assert_eq!(code(&warm_up), Code::Ok, "{warm_up:?}");
        channel
    }

    fn sigterm(&self) {
        self.process.sigterm();
    }

    /// Waits for the process to exit; returns its exit code and its whole stderr.
    async fn exit(&mut self) -> (Option<i32>, String) {
        self.process.exit().await
    }
}

/// A gRPC health `Watch` on its own connection, opened while sluice serves.
async fn watch_health(grpc: SocketAddr) -> tonic::Streaming<tonic_health::pb::HealthCheckResponse> {
    let channel = Endpoint::from_shared(format!("http://{grpc}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("health connection");
    let mut watch = HealthClient::new(channel)
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("health watch")
        .into_inner();
    let first = watch.message().await.expect("watch").expect("first status");
    assert_eq!(first.status, ServingStatus::Serving as i32);
    watch
}

/// Shutdown has started, established from sluice's side, in the order sluice does it: the
/// health watch reports NOT_SERVING (nothing else can turn it: the store answers PING through
/// the proxy and the pool has connections to spare), then a new TCP connection to the gRPC port
/// is refused (the listener is closed: the drain has begun). Consumes the watch, so it does not
/// keep a stream of its own open during the drain.
async fn shutdown_started(
    mut watch: tonic::Streaming<tonic_health::pb::HealthCheckResponse>,
    sluice: &Sluice,
) {
    let not_serving = tokio::time::timeout(CAP, async {
        loop {
            match watch.message().await {
                Ok(Some(m)) if m.status == ServingStatus::NotServing as i32 => return Ok(()),
                Ok(Some(_)) => continue,
                other => return Err(format!("{other:?}")),
            }
        }
    })
    .await;
    match not_serving {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!(
            "health watch ended before NOT_SERVING: {e}\n{}",
            sluice.log()
        ),
        Err(_) => panic!("no NOT_SERVING within {CAP:?}:\n{}", sluice.log()),
    }
    drop(watch);

    let refused = tokio::time::timeout(CAP, async {
        loop {
            match tokio::net::TcpStream::connect(sluice.grpc).await {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return,
                // Still accepting (or a transient error): close it and look again.
                _ => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        }
    })
    .await;
    assert!(
        refused.is_ok(),
        "the gRPC listener still accepted connections {CAP:?} after NOT_SERVING:\n{}",
        sluice.log()
    );
}

type CallResult = Result<sluice::proto::RateLimitResponse, tonic::Status>;

/// `n` concurrent ShouldRateLimit calls over one HTTP/2 connection, each on its own descriptor.
fn burst(channel: &Channel, n: usize) -> Vec<(String, JoinHandle<CallResult>)> {
    (0..n)
        .map(|i| {
            let value = format!("burst-{i}");
            let mut client = RateLimitServiceClient::new(channel.clone());
            let request = one("shutdown", &[("client", &value)]);
            let call = tokio::spawn(async move {
                client
                    .should_rate_limit(request)
                    .await
                    .map(|r| r.into_inner())
            });
            (value, call)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_during_a_burst_answers_every_in_flight_call_then_exits_zero() {
    const N: usize = 64;
    let redis = RedisServer::start();
    let proxy = RedisProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port()))).await;
    // sluice keeps at most 2 x REDIS_POOL_SIZE script calls outstanding (concurrent requests
    // go together in one); N + 4 connections let every call reach Redis, i.e. the proxy.
    let (mut sluice, channel) = Sluice::start(&proxy, N + 4, "30s").await;
    let watch = watch_health(sluice.grpc).await;

    proxy.hold();
    let calls = burst(&channel, N);
    // All N calls are inside sluice, waiting on script calls the proxy holds.
    let held = proxy
        .wait_for("all burst calls reaching Redis", CAP, |s| {
            s.requests_held >= N
        })
        .await;
    assert_eq!(held.requests_held, N, "{held:?}");
    assert_eq!(held.commands_held, held.scripts_held, "{held:?}");
    assert_eq!(held.unparsed_bytes, 0, "{held:?}");

    sluice.sigterm();
    shutdown_started(watch, &sluice).await;
    // Still nothing answered: the draining sluice is waiting on Redis for every call.
    assert_eq!(proxy.stats().requests_held, N);
    let finished: Vec<&str> = calls
        .iter()
        .filter(|(_, c)| c.is_finished())
        .map(|(v, _)| v.as_str())
        .collect();
    assert!(
        finished.is_empty(),
        "calls ended before Redis answered: {finished:?}\n{}",
        sluice.log()
    );

    proxy.release();
    let mut failures = Vec::new();
    for (value, call) in calls {
        let answer = match tokio::time::timeout(CAP, call).await {
            Ok(joined) => joined.expect("call task"),
            Err(_) => panic!(
                "call {value} got no answer within {CAP:?}:\n{}",
                sluice.log()
            ),
        };
        match answer {
            Ok(r) if code(&r) == Code::Ok && r.statuses.len() == 1 => {
                let status = &r.statuses[0];
                assert_eq!(status_code(status), Code::Ok, "{value}: {r:?}");
                assert_eq!(limit_of(status), Some((10, "HOUR".to_string())), "{value}");
                assert_eq!(status.limit_remaining, 9, "{value}: counted once");
            }
            other => failures.push(format!("{value}: {other:?}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {N} in-flight calls got no OK answer:\n{}\n--- sluice log ---\n{}",
        failures.len(),
        failures.join("\n"),
        sluice.log()
    );

    let (code, log) = sluice.exit().await;
    assert_eq!(code, Some(0), "sluice exits 0 after draining:\n{log}");
    assert!(
        log.contains("shutdown complete"),
        "the drain completed (not cut short by the grace period):\n{log}"
    );
    assert!(!log.contains("grace period elapsed"), "{log}");
    // The answers came from Redis: one counter per burst call, plus the warm-up's.
    let keys = tokio::task::block_in_place(|| redis.keys_with_ttl());
    assert_eq!(keys.len(), N + 1, "{keys:?}");
    drop(channel);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_with_calls_stuck_past_the_grace_period_still_exits_zero() {
    const N: usize = 8;
    let redis = RedisServer::start();
    let proxy = RedisProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port()))).await;
    let (mut sluice, channel) = Sluice::start(&proxy, N, "1s").await;
    let watch = watch_health(sluice.grpc).await;

    proxy.hold();
    let calls = burst(&channel, N);
    let held = proxy
        .wait_for("all stuck calls reaching Redis", CAP, |s| {
            s.requests_held >= N
        })
        .await;
    assert_eq!(held.requests_held, N, "{held:?}");

    sluice.sigterm();
    shutdown_started(watch, &sluice).await;
    // Redis never answers (the hold is never released): only the grace period ends the drain.
    let (code, log) = sluice.exit().await;
    assert_eq!(
        code,
        Some(0),
        "sluice exits 0 after the grace period:\n{log}"
    );
    assert!(
        log.contains("grace period elapsed"),
        "the drain was cut short by the grace period:\n{log}"
    );
    assert!(!log.contains("shutdown complete"), "{log}");
    assert_eq!(proxy.stats().requests_held, N, "nothing reached Redis");
    // No call got an answer (none was possible); each ends with a transport error instead of
    // hanging.
    for (value, call) in calls {
        let answer = match tokio::time::timeout(CAP, call).await {
            Ok(joined) => joined.expect("call task"),
            Err(_) => panic!("call {value} still pending after sluice exited"),
        };
        assert!(answer.is_err(), "{value} was answered: {answer:?}");
    }
    drop(channel);
}
