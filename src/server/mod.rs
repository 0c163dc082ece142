//! Wiring of the running service: the gRPC server (RLS, RLQS, health, reflection) and the HTTP admin
//! server around one shared [`RateLimiter`], with a graceful, bounded drain on shutdown.
//! [`start`] binds both listeners before returning, so tests can ask for port 0 and read the
//! real addresses from [`Running`].

pub mod admin;
pub mod grpc;
pub mod http;
mod incoming;
mod listener;
pub mod reload;
pub mod signal;
pub mod tls;
mod workers;
pub mod xds;

use crate::config::RuleSet;
use crate::service::RateLimiter;
use signal::ShutdownHandle;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use tokio::task::JoinHandle;

pub use signal::shutdown_signal;

mod background;
mod config;
mod health;
mod rls_codec;
mod serve;
mod supervise;
mod uds_authority;

use background::Background;
pub use config::{
    ConnectionAge, EnvoyStatsSettings, Http2Limits, Parts, ServerConfig, ServerError,
    DEFAULT_DRAIN_DELAY, DEFAULT_HEALTH_INTERVAL, DEFAULT_SHUTDOWN_GRACE, HEALTH_SERVICE_NAME,
};
use health::start_health;
use listener::Listeners;
use serve::GrpcServing;
use supervise::Supervised;

/// A started service. Dropping it (with every [`ShutdownHandle`]) starts a graceful shutdown, so
/// a test that forgets to stop its server does not leak it.
#[derive(Debug)]
pub struct Running {
    grpc_addr: SocketAddr,
    http_addr: SocketAddr,
    envoy_metrics_addr: Option<SocketAddr>,
    debug_addr: Option<SocketAddr>,
    admin_addr: Option<SocketAddr>,
    limiter: Arc<RateLimiter>,
    shutdown: ShutdownHandle,
    supervisor: JoinHandle<Result<(), ServerError>>,
}

impl Running {
    /// The bound gRPC address (the real port when 0 was asked for).
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    /// The bound HTTP admin address (the real port when 0 was asked for).
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// The bound `USE_PROMETHEUS` listener, if any.
    pub fn envoy_metrics_addr(&self) -> Option<SocketAddr> {
        self.envoy_metrics_addr
    }

    /// The bound debug listener, if any.
    pub fn debug_addr(&self) -> Option<SocketAddr> {
        self.debug_addr
    }

    /// The bound admin API address, if it listens on TCP.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// `http://` URL of the gRPC server, for `tonic` clients (`Endpoint::from_shared`).
    pub fn grpc_url(&self) -> String {
        format!("http://{}", self.grpc_addr)
    }

    /// `http://` base URL of the admin server.
    pub fn http_url(&self) -> String {
        format!("http://{}", self.http_addr)
    }

    /// The decision engine both front ends share (e.g. to swap rules in a test).
    pub fn limiter(&self) -> &Arc<RateLimiter> {
        &self.limiter
    }

    /// A handle that starts the shutdown from anywhere (another task, a signal handler).
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.shutdown.clone()
    }

    /// Starts the graceful shutdown: health turns NOT_SERVING, both listeners close, in-flight
    /// calls finish within the grace period. Returns at once; use [`Running::wait`] to join.
    pub fn shutdown(&self) {
        self.shutdown.shutdown();
    }

    /// Waits until both servers have stopped: after a shutdown, `Ok` once drained (or once the
    /// grace period cut the drain short); an error if a server failed on its own.
    pub async fn wait(self) -> Result<(), ServerError> {
        // Keep the handle alive while waiting so only an explicit shutdown ends the servers.
        let _keep = self.shutdown;
        // The supervisor gives the slices back before the serving threads stop.
        match self.supervisor.await {
            Ok(r) => r,
            Err(source) => Err(ServerError::Task {
                what: "supervisor",
                source,
            }),
        }
    }

    /// [`Running::shutdown`] then [`Running::wait`].
    pub async fn stop(self) -> Result<(), ServerError> {
        self.shutdown();
        self.wait().await
    }
}

/// Binds both listeners, starts the gRPC and HTTP servers and returns once they accept
/// connections. Fails without leaving anything running if either address cannot be bound.
pub async fn start(config: ServerConfig) -> Result<Running, ServerError> {
    let listeners = Listeners::bind(&config).await?;
    let (grpc_addr, http_addr) = (listeners.grpc_addr, listeners.http_addr);
    let grpc_socket = listeners.grpc.path();
    let envoy_metrics_addr = listeners.envoy_metrics.as_ref().map(|(_, a, _)| *a);
    let debug_addr = listeners.debug.as_ref().map(|(_, a)| *a);
    // Everything that can fail is built before a task is spawned.
    let transcoder = http::Transcoder::new()?;
    let (threads, json) = (config.grpc_threads, config.json_policy());
    let tls = config.grpc_tls.as_ref();
    let mut grpc = GrpcServing::prepare(listeners.grpc, grpc_addr, tls, threads)?;
    let Parts { limiter, tracing } = config.parts;
    let (admin_server, admin_addr) =
        admin::Prepared::from_bound(listeners.admin, config.admin.as_ref(), &limiter)?;

    let (health, health_service, health_watch) =
        start_health(&limiter, config.health_interval).await;
    grpc.routes.add_service(health_service);
    let mut background = Background {
        envoy_stats: config.envoy_stats,
        envoy_metrics: listeners.envoy_metrics,
        debug: listeners.debug,
        xds: config.xds,
        reload: config.reload,
        loaded_fingerprint: config.loaded_fingerprint,
        candidate_reload: config.candidate_reload,
    }
    .spawn(&limiter);
    background.extend([health_watch, admin::start_poll(&limiter).await]);

    // `shutdown` is the caller's trigger (handles, signals, dropping `Running`); `drain` the
    // supervisor's, which the servers obey (an early failure stops the others; see supervise.rs).
    let (shutdown, trigger) = signal::channel();
    let (drain, draining) = signal::channel();
    let (grpc_task, workers) = grpc.spawn(
        &limiter,
        (config.connection_age, config.http2),
        config.quota,
        &draining,
    );
    background.extend(admin_server.map(|a| a.spawn(&draining)));
    // /healthcheck fails from the trigger on (the drain delay included), not from the drain.
    let app = http::router(
        Arc::clone(&limiter),
        (transcoder, json),
        trigger.clone(),
        config.quota.show_values,
    );
    let http_task = serve_http(listeners.http, app, &draining);

    log_listening(
        (grpc_addr, http_addr),
        threads,
        grpc_socket.as_deref(),
        admin_addr,
    );
    let supervisor = Supervised {
        trigger,
        drain,
        health,
        background,
        grace: config.shutdown_grace,
        drain_delay: config.drain_delay,
        workers,
        grpc_socket,
        tracing,
        limiter: Arc::clone(&limiter),
    }
    .spawn(grpc_task, http_task);
    Ok(Running {
        grpc_addr,
        http_addr,
        envoy_metrics_addr,
        debug_addr,
        admin_addr,
        limiter,
        shutdown,
        supervisor,
    })
}

/// The HTTP admin server on `listener` until the drain.
fn serve_http(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    draining: &signal::ShutdownWatch,
) -> JoinHandle<std::io::Result<()>> {
    let server = axum::serve(listener, app).with_graceful_shutdown(draining.clone().triggered());
    tokio::spawn(async move { server.await })
}

/// The line operators (and the tests' binary spawner) read the bound addresses from.
fn log_listening(
    (grpc, http): (SocketAddr, SocketAddr),
    threads: usize,
    uds: Option<&Path>,
    admin: Option<SocketAddr>,
) {
    tracing::info!(
        grpc = %grpc,
        http = %http,
        admin = %admin.map_or_else(|| "-".to_string(), |a| a.to_string()),
        grpc_threads = threads.max(1),
        grpc_uds = ?uds,
        "sluice listening (gRPC: RLS, RLQS, health, reflection; HTTP: /healthcheck /livez /rlconfig /json /metrics /debug/offenders /debug/rlqs)"
    );
}

/// Starts the servers and runs them until `shutdown` resolves (usually [`shutdown_signal`]),
/// then drains gracefully. `Ok` means a clean stop, so the process can exit 0.
pub async fn run(
    config: ServerConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServerError> {
    let running = start(config).await?;
    let handle = running.shutdown_handle();
    let wait = running.wait();
    tokio::pin!(wait);
    tokio::pin!(shutdown);
    tokio::select! {
        // A server failed on its own: nothing left to drain.
        r = &mut wait => return r,
        () = &mut shutdown => handle.shutdown(),
    }
    wait.await
}

/// The info line written for every config load: where from, and the rate limits per domain.
/// Also warns, once per limit, where envoyproxy counting meets a resource limit.
pub fn log_config_loaded(
    rules: &RuleSet,
    source: Option<&std::path::Path>,
    counting: crate::config::Counting,
) {
    let warnings = rules.counting_warnings(counting);
    for warning in warnings.iter().chain(&rules.layout_warnings()) {
        tracing::warn!("{warning}");
    }
    let counts = rules.rule_counts();
    let total: usize = counts.iter().map(|(_, n)| n).sum();
    let per_domain = counts
        .iter()
        .map(|(d, n)| format!("{d}={n}"))
        .collect::<Vec<_>>()
        .join(", ");
    tracing::info!(
        source = %source.map(|p| p.display().to_string()).unwrap_or_else(|| "<memory>".into()),
        domains = counts.len(),
        rate_limits = total,
        per_domain = %per_domain,
        "config loaded"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::app::Ingredients;
    use crate::clock::ManualClock;
    use crate::clock::{Clock, SystemClock};
    use crate::store::breaker::BreakerSettings;
    use crate::store::fake::FakeStore;
    use crate::store::redis::RedisSettings;
    use crate::store::{StoreChain, StoreError, StoreSignals, StoreStack};
    use std::time::Duration;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::{health_check_response::ServingStatus as Status, HealthCheckRequest};

    async fn health_client(running: &Running) -> HealthClient<tonic::transport::Channel> {
        let channel = tonic::transport::Endpoint::from_shared(running.grpc_url())
            .unwrap()
            .connect()
            .await
            .unwrap();
        HealthClient::new(channel)
    }

    fn config() -> ServerConfig {
        ServerConfig::for_tests(RuleSet::empty(), Arc::new(ManualClock::new(Duration::ZERO)))
    }

    #[tokio::test]
    async fn starts_on_free_ports_reports_serving_and_stops_cleanly() {
        let running = start(config()).await.unwrap();
        assert_ne!(running.grpc_addr().port(), 0);
        assert_ne!(running.http_addr().port(), 0);
        let mut health = health_client(&running).await;
        for service in ["", HEALTH_SERVICE_NAME, grpc::RLS_SERVICE_NAME] {
            let r = health
                .check(HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .unwrap()
                .into_inner();
            assert_eq!(r.status, Status::Serving as i32, "{service:?}");
        }
        running.stop().await.unwrap();
    }

    #[tokio::test]
    async fn health_watchers_see_not_serving_on_shutdown() {
        let running = start(config()).await.unwrap();
        let mut health = health_client(&running).await;
        let mut watch = health
            .watch(HealthCheckRequest {
                service: HEALTH_SERVICE_NAME.into(),
            })
            .await
            .unwrap()
            .into_inner();
        let first = watch.message().await.unwrap().unwrap();
        assert_eq!(first.status, Status::Serving as i32);
        running.shutdown();
        let next = watch.message().await.unwrap().unwrap();
        assert_eq!(next.status, Status::NotServing as i32);
        drop(watch);
        drop(health);
        running.wait().await.unwrap();
    }

    #[tokio::test]
    async fn a_taken_port_is_a_bind_error() {
        let first = start(config()).await.unwrap();
        let mut second = config();
        second.grpc_addr = first.grpc_addr();
        match start(second).await {
            Err(ServerError::Bind { what: "gRPC", .. }) => {}
            other => panic!("expected a gRPC bind error, got {other:?}"),
        }
        first.stop().await.unwrap();
    }

    #[tokio::test]
    async fn run_returns_ok_when_the_shutdown_future_resolves() {
        run(config(), async {}).await.unwrap();
    }

    const RULES: &str = concat!(
        "domain: d\n",
        "descriptors:\n",
        "  - key: k\n",
        "    rate_limit: {unit: minute, requests_per_unit: 5}\n",
    );

    /// RULES on `store` (a memory store on a manual clock unless given).
    fn ingredients(store: Option<StoreStack>) -> Ingredients {
        let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(Duration::from_secs(1_000_000)));
        let rules = crate::config::load_sources(&[("t.yaml".into(), RULES.into())])
            .unwrap_or_else(|e| panic!("{e}"));
        let base = Ingredients::for_tests(rules, clock);
        Ingredients {
            store: store.unwrap_or(base.store.clone()),
            ..base
        }
    }

    /// A server on a store that holds every decision until the test opens its gate.
    fn gated(grace: Duration) -> (ServerConfig, Arc<FakeStore>) {
        let store = Arc::new(FakeStore::gated(Arc::new(ManualClock::default())));
        let stack = StoreStack::new(store.clone(), StoreSignals::new("memory"));
        let mut config = ServerConfig::from_ingredients(ingredients(Some(stack)));
        config.shutdown_grace = grace;
        (config, store)
    }

    fn request() -> crate::proto::RateLimitRequest {
        crate::proto::RateLimitRequest {
            domain: "d".into(),
            descriptors: vec![crate::proto::RateLimitDescriptor {
                entries: vec![crate::proto::rate_limit_descriptor::Entry {
                    key: "k".into(),
                    value: "v".into(),
                }],
                ..Default::default()
            }],
            hits_addend: 0,
        }
    }

    #[tokio::test]
    async fn an_in_flight_call_finishes_after_shutdown_starts() {
        let (config, store) = gated(Duration::from_secs(60));
        let running = start(config).await.unwrap();
        let mut client = crate::proto::rate_limit_service_client::RateLimitServiceClient::connect(
            running.grpc_url(),
        )
        .await
        .unwrap();
        let call = tokio::spawn(async move { client.should_rate_limit(request()).await });
        store.wait_calls(1).await;
        running.shutdown();
        // New connections are refused while the call is still held by the store.
        let refused = loop {
            match tokio::net::TcpStream::connect(running.grpc_addr()).await {
                Err(_) => break true,
                Ok(_) => tokio::task::yield_now().await,
            }
        };
        assert!(refused);
        store.open(1);
        let answer = call.await.unwrap().unwrap().into_inner();
        assert_eq!(
            answer.overall_code,
            crate::proto::rate_limit_response::Code::Ok as i32
        );
        running.wait().await.unwrap();
    }

    #[tokio::test]
    async fn the_grace_period_bounds_the_drain() {
        let (config, store) = gated(Duration::from_millis(50));
        let running = start(config).await.unwrap();
        let mut client = crate::proto::rate_limit_service_client::RateLimitServiceClient::connect(
            running.grpc_url(),
        )
        .await
        .unwrap();
        let _call = tokio::spawn(async move { client.should_rate_limit(request()).await });
        store.wait_calls(1).await;
        // The store never answers; the drain still ends, cleanly, once the grace period is over.
        running.stop().await.unwrap();
    }

    async fn check(health: &mut HealthClient<tonic::transport::Channel>, service: &str) -> i32 {
        health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status
    }

    #[tokio::test]
    async fn health_follows_the_store_probe() {
        let store = Arc::new(FakeStore::failing(StoreError::Transient("down".into())));
        let stack = StoreStack::new(store.clone(), StoreSignals::new("redis"));
        let mut config = ServerConfig::from_ingredients(ingredients(Some(stack)));
        config.health_interval = Duration::from_millis(5);
        let running = start(config).await.unwrap();
        let mut health = health_client(&running).await;
        // Probed before `start` returned: NOT_SERVING from the first check.
        for service in ["", HEALTH_SERVICE_NAME] {
            assert_eq!(
                check(&mut health, service).await,
                Status::NotServing as i32,
                "{service:?}"
            );
        }
        let http = running.http_url();
        let mut watch = health
            .watch(HealthCheckRequest {
                service: HEALTH_SERVICE_NAME.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            watch.message().await.unwrap().unwrap().status,
            Status::NotServing as i32
        );
        // The store comes back: the health task notices (waiting on the watch, not on time).
        store.set_probe(true);
        assert_eq!(
            watch.message().await.unwrap().unwrap().status,
            Status::Serving as i32
        );
        assert_eq!(check(&mut health, "").await, Status::Serving as i32);
        assert_eq!(http_status(&http).await, 200);
        // And goes away again.
        store.set_probe(false);
        assert_eq!(
            watch.message().await.unwrap().unwrap().status,
            Status::NotServing as i32
        );
        assert_eq!(http_status(&http).await, 500);
        store.set_probe(true);
        assert_eq!(
            watch.message().await.unwrap().unwrap().status,
            Status::Serving as i32
        );
        // Shutdown wins over the health task for good.
        running.shutdown();
        assert_eq!(
            watch.message().await.unwrap().unwrap().status,
            Status::NotServing as i32
        );
        drop(watch);
        drop(health);
        running.wait().await.unwrap();
    }

    /// Status code of `GET /healthcheck` over a raw HTTP/1.1 request.
    async fn http_status(base: &str) -> u16 {
        get_status(base, "/healthcheck").await
    }

    /// Status code of `GET path` over a raw HTTP/1.1 request.
    async fn get_status(base: &str, path: &str) -> u16 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = base.trim_start_matches("http://");
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out.split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("bad HTTP answer {out:?}"))
    }

    /// A loopback port nothing listens on.
    fn closed_port() -> u16 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    }

    fn redis_chain(port: u16, local_cache_bytes: usize) -> StoreChain {
        StoreChain {
            redis: RedisSettings {
                urls: vec![format!("redis://127.0.0.1:{port}")],
                kind: crate::store::redis::RedisKind::Single,
                sentinel: None,
                auth: None,
                pool_size: 2,
                timeout: crate::store::redis::DEFAULT_TIMEOUT,
                key_prefix: String::new(),
                expiration_jitter: Duration::ZERO,
                tls: Default::default(),
            },
            breaker: BreakerSettings::default(),
            local_cache_bytes,
            local: None,
        }
    }

    #[tokio::test]
    async fn starts_not_serving_when_redis_is_unreachable() {
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let store = redis_chain(closed_port(), 4096).build(clock).unwrap();
        let mut i = ingredients(Some(store));
        i.options.failure_mode = None;
        let running = start(ServerConfig::from_ingredients(i)).await.unwrap();
        let mut health = health_client(&running).await;
        assert_eq!(check(&mut health, "").await, Status::NotServing as i32);
        assert_eq!(
            check(&mut health, HEALTH_SERVICE_NAME).await,
            Status::NotServing as i32
        );
        let mut client = crate::proto::rate_limit_service_client::RateLimitServiceClient::connect(
            running.grpc_url(),
        )
        .await
        .unwrap();
        // Every call is UNAVAILABLE: first from Redis, then at once from the open breaker.
        for _ in 0..5 {
            let e = client.should_rate_limit(request()).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        }
        running.stop().await.unwrap();
    }

    #[tokio::test]
    async fn liveness_ignores_redis_and_failure_mode_stays_ready() {
        for failure_mode in [None, Some(crate::service::FailureMode::Allow)] {
            let clock: Arc<dyn Clock> = Arc::new(SystemClock);
            let store = redis_chain(closed_port(), 0).build(clock).unwrap();
            let mut i = ingredients(Some(store));
            i.options.failure_mode = failure_mode;
            let running = start(ServerConfig::from_ingredients(i)).await.unwrap();
            let mut health = health_client(&running).await;
            let http = running.http_url();
            assert_eq!(get_status(&http, "/livez").await, 200, "{failure_mode:?}");
            if failure_mode.is_some() {
                // sluice answers for the store, so it stays ready.
                assert_eq!(check(&mut health, "").await, Status::Serving as i32);
                assert_eq!(http_status(&http).await, 200);
            } else {
                assert_eq!(check(&mut health, "").await, Status::NotServing as i32);
                assert_eq!(http_status(&http).await, 500);
            }
            running.stop().await.unwrap();
        }
    }

    #[tokio::test]
    async fn the_chain_stacks_breaker_and_cache() {
        let clock: Arc<dyn Clock> = Arc::new(ManualClock::default());
        let with = format!(
            "{:?}",
            redis_chain(1, 100).build(Arc::clone(&clock)).unwrap().store
        );
        assert!(with.starts_with("LocalDenyCache"), "{with}");
        assert!(with.contains("CircuitBreaker"), "{with}");
        assert!(with.contains("RedisStore"), "{with}");
        let without = format!("{:?}", redis_chain(1, 0).build(clock).unwrap().store);
        assert!(without.starts_with("CircuitBreaker"), "{without}");
    }
}
