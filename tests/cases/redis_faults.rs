//! Redis faults through the production store chain (Redis store -> circuit breaker -> local deny
//! cache) against real redis-server processes: Redis stopped mid-test, Redis unreachable at
//! start, failure modes, and the local deny cache answering without any Redis call.

use super::store::{redis_settings, redis_store, server_on_redis_settings};
use crate::support::redis::start_redis;
use crate::support::*;
use sluice::app::Ingredients;
use sluice::clock::{ManualClock, SystemClock};
use sluice::proto::rate_limit_response::Code;
use sluice::server::{self, ServerConfig};
use sluice::service::{FailureMode, ServiceOptions};
use sluice::store::breaker::BreakerSettings;
use sluice::store::local_cache::LocalDenyCache;
use sluice::store::redis::RedisKind;
use sluice::store::CounterStore;
use sluice::store::{DenialFinality, StoreChain};
use std::sync::Arc;
use std::time::Duration;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const CONFIG: &str = r#"
domain: f
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 5}
"#;

/// A sluice whose store is the production chain on `url` (Redis server clock), probing health
/// every 20 ms so recovery is quick; `failure_mode` as given.
async fn sluice_with_chain(url: String, failure_mode: Option<FailureMode>) -> server::Running {
    let chain = StoreChain {
        redis: sluice::store::redis::RedisSettings {
            timeout: Duration::from_secs(2),
            ..redis_settings(vec![url], RedisKind::Single)
        },
        breaker: BreakerSettings::default(),
        local_cache_bytes: 0,
        local: None,
    };
    let store = chain.build(Arc::new(SystemClock)).expect("store chain");
    let config = ServerConfig {
        health_interval: Duration::from_millis(20),
        ..ServerConfig::from_ingredients(Ingredients {
            store,
            options: ServiceOptions {
                failure_mode,
                ..Default::default()
            },
            clock: Arc::new(SystemClock),
            ..Ingredients::for_tests(rules(CONFIG), Arc::new(SystemClock))
        })
    };
    server::start(config)
        .await
        .expect("sluice starts even if Redis is down")
}

async fn health(addr: std::net::SocketAddr, service: &str) -> ServingStatus {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect health");
    let mut c = HealthClient::new(channel);
    let r = c
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .expect("health check")
        .into_inner();
    ServingStatus::try_from(r.status).unwrap_or(ServingStatus::Unknown)
}

/// Polls until `health` reports `want` for service "ratelimit". The bound only stops a hang;
/// nothing is asserted about how long it took.
async fn wait_for_health(addr: std::net::SocketAddr, want: ServingStatus) {
    poll_until(&format!("health becomes {want:?}"), || async {
        match health(addr, "ratelimit").await {
            now if now == want => Ok(()),
            other => Err(other),
        }
    })
    .await
}

async fn call(
    addr: std::net::SocketAddr,
    req: &sluice::proto::RateLimitRequest,
) -> Result<sluice::proto::RateLimitResponse, tonic::Status> {
    sluice::proto::rate_limit_service_client::RateLimitServiceClient::connect(format!(
        "http://{addr}"
    ))
    .await
    .expect("connect")
    .should_rate_limit(req.clone())
    .await
    .map(|r| r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_mid_test_then_back_heals_without_restart() {
    let mut redis = start_redis(&[]).await;
    let s = sluice_with_chain(redis.url(), None).await;
    let req = one("f", &[("k", "v")]);
    assert_eq!(
        code(&call(s.grpc_addr(), &req).await.expect("ok")),
        Code::Ok
    );
    assert_eq!(health(s.grpc_addr(), "").await, ServingStatus::Serving);

    redis.stop();
    // Five calls: the first three reach the dead Redis, then the breaker answers at once. All
    // are UNAVAILABLE, never a panic or a hang.
    for _ in 0..5 {
        let err = call(s.grpc_addr(), &req).await.expect_err("Redis is down");
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    }
    wait_for_health(s.grpc_addr(), ServingStatus::NotServing).await;

    redis.restart();
    wait_for_health(s.grpc_addr(), ServingStatus::Serving).await;
    let r = call(s.grpc_addr(), &req).await.expect("decisions resume");
    assert_eq!(code(&r), Code::Ok);
    s.stop().await.expect("clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_at_start_serves_not_serving_then_recovers() {
    let mut redis = start_redis(&[]).await;
    redis.stop(); // the port is known and nothing listens on it
    let s = sluice_with_chain(redis.url(), None).await;
    assert_eq!(
        health(s.grpc_addr(), "ratelimit").await,
        ServingStatus::NotServing
    );
    assert_eq!(health(s.grpc_addr(), "").await, ServingStatus::NotServing);
    let (status, _) = http(s.http_addr(), "GET", "/healthcheck", "").await;
    assert_eq!(status, 500);
    let req = one("f", &[("k", "v")]);
    let err = call(s.grpc_addr(), &req).await.expect_err("no Redis yet");
    assert_eq!(err.code(), tonic::Code::Unavailable);

    redis.restart();
    wait_for_health(s.grpc_addr(), ServingStatus::Serving).await;
    let r = call(s.grpc_addr(), &req)
        .await
        .expect("decides once Redis is up");
    assert_eq!(code(&r), Code::Ok);
    let (status, _) = http(s.http_addr(), "GET", "/healthcheck", "").await;
    assert_eq!(status, 200);
    s.stop().await.expect("clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_modes_answer_for_a_dead_redis() {
    let mut redis = start_redis(&[]).await;
    redis.stop();
    let req = one("f", &[("k", "v")]);

    let allow = sluice_with_chain(redis.url(), Some(FailureMode::Allow)).await;
    let r = call(allow.grpc_addr(), &req)
        .await
        .expect("answered by sluice");
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(limit_of(&r.statuses[0]), Some((5, "HOUR".into())));
    allow.stop().await.expect("clean stop");

    let deny = sluice_with_chain(redis.url(), Some(FailureMode::Deny)).await;
    let r = call(deny.grpc_addr(), &req)
        .await
        .expect("answered by sluice");
    assert_eq!(code(&r), Code::OverLimit);
    assert_eq!(status_code(&r.statuses[0]), Code::OverLimit);
    deny.stop().await.expect("clean stop");
}

#[tokio::test]
async fn the_local_deny_cache_answers_without_any_redis_call() {
    let redis = start_redis(&[]).await;
    let clock = ManualClock::new(T0);
    let inner = redis_store(vec![redis.url()], RedisKind::Single, &clock);
    let cache = Arc::new(LocalDenyCache::new(
        inner,
        1 << 20,
        Arc::new(clock.clone()),
        DenialFinality::Always,
    ));
    let store: Arc<dyn CounterStore> = cache.clone();
    let s = TestServer::start_on(
        CONFIG,
        ServiceOptions::default(),
        Some(store),
        clock.clone(),
    )
    .await;
    let req = one("f", &[("k", "v")]);
    assert_eq!(
        admitted(&s, &req, 6).await,
        5,
        "the 6th is denied by Redis and cached"
    );

    redis.cli(&["CONFIG", "RESETSTAT"]);
    for _ in 0..10 {
        let r = s.call(req.clone()).await;
        assert_eq!(code(&r), Code::OverLimit);
    }
    assert_eq!(redis.evalsha_calls(), 0, "no Redis call for cached denials");
    assert_eq!(cache.local_denials(), 10);
    // A different limit on the same descriptor (an override) is never served from the cache.
    let mut overridden = desc(&[("k", "v")]);
    overridden.limit = Some(sluice::proto::rate_limit_descriptor::RateLimitOverride {
        requests_per_unit: 100,
        unit: sluice::proto::envoy::r#type::v3::RateLimitUnit::Hour as i32,
    });
    let r = s.call(request("f", vec![overridden])).await;
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(redis.evalsha_calls(), 1);

    // The window ends: the entry expires and Redis decides again.
    clock.advance(Duration::from_secs(3600));
    let r = s.call(req.clone()).await;
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(redis.evalsha_calls(), 2);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_stops_answering_gives_unavailable_not_a_hang() {
    let redis = start_redis(&[]).await;
    let settings = sluice::store::redis::RedisSettings {
        timeout: Duration::from_millis(300),
        ..redis_settings(vec![redis.url()], RedisKind::Single)
    };
    let s = server_on_redis_settings(CONFIG, &settings).await;
    let req = one("f", &[("k", "v")]);
    assert_eq!(code(&s.call(req.clone()).await), Code::Ok);
    // Redis accepts connections but holds every command for 60 s: only the timeout ends the call.
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "60000", "ALL"]).trim(), "OK");
    let err = s
        .client()
        .await
        .should_rate_limit(req)
        .await
        .expect_err("Redis does not answer");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    let msg = err.message();
    assert!(
        msg.contains("timed out") || msg.contains("did not answer"),
        "{msg}"
    );
    s.stop().await;
}

/// FAILURE_MODE=local on a calendar window: what a replica admitted while Redis was down is
/// written back into that calendar window's counter, the one Redis decides on once it is back
/// (the write-back once went without its window: the script charged the epoch-aligned day's
/// key, and the calendar day's limit never saw the hits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_was_admitted_locally_on_a_calendar_window_is_written_back_into_that_window() {
    use sluice::config::calendar::CalendarSpec;
    use sluice::config::{Limit, Period, Unit};
    use sluice::store::fallback::{LocalFallback, LocalSettings};
    use sluice::store::redis::RedisStore;
    use sluice::store::{LimitCheck, StoreSignals};

    let mut redis = start_redis(&[]).await;
    // Noon UTC: the New York day began at 05:00Z, the epoch's at 00:00Z.
    let noon = Duration::from_secs(1_796_126_400); // 2026-12-01T12:00:00Z
    let clock = ManualClock::new(noon);
    let settings = sluice::store::redis::RedisSettings {
        timeout: Duration::from_secs(2),
        ..redis_settings(vec![redis.url()], RedisKind::Single)
    };
    let redis_store = || {
        RedisStore::new(&settings)
            .expect("redis store")
            .with_test_clock(Arc::new(clock.clone()))
    };
    let local = LocalFallback::new(
        Arc::new(redis_store()),
        None,
        LocalSettings {
            retry_every: Duration::ZERO,
            ..LocalSettings::default()
        },
        Arc::new(clock.clone()),
        &StoreSignals::new("test"),
    );
    let spec = CalendarSpec {
        unit: Unit::Day,
        zone: "America/New_York".into(),
        ..CalendarSpec::utc_months()
    };
    let mut limit = Limit::fixed(10, Unit::Day);
    limit.period = Period::from_calendar(&spec).expect("a zone");
    let now_us = u64::try_from(noon.as_micros()).expect("fits");
    let window = limit
        .period
        .calendar()
        .and_then(|c| c.calendar().window_at(now_us));
    assert!(window.is_some_and(|(start, _)| start % 86_400_000_000 != 0));
    // As the plan sends it: the calendar day's window, computed by the service.
    let check = |hits: u64| {
        let mut c = LimitCheck::for_tests("cw", "acme", limit, hits);
        c.record = true;
        c.window = window;
        c
    };

    redis.stop();
    for _ in 0..3 {
        let d = local.decide(&[check(1)]).await.expect("decided locally");
        assert!(d.admitted, "{d:?}");
    }
    assert_eq!(local.owed(), 1, "the three hits owed to the store");
    redis.restart();
    // Bounded only against a hang: the probe and the write-back go as soon as Redis answers.
    // Settled means nothing owed and no store call of the outage still out: a call that
    // outlived its request (Redis down, the connection retried) may land after the write-back
    // and charge its hit a second time; its answer takes that hit off the debt again, a refund
    // the next write-back sends (seen on a busy machine: 4 hits for 3 admitted, read while the
    // refund was still owed).
    for _ in 0..300 {
        local.probe_now().await;
        local.write_back_now().await;
        if local.late_calls() == 0 && local.owed() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(local.late_calls(), 0, "the outage's store calls answered");
    assert_eq!(local.owed(), 0, "written back");
    // Redis alone, on the calendar day's counter: the three local hits are in it.
    let d = redis_store()
        .decide(&[check(0)])
        .await
        .expect("Redis decides");
    assert_eq!(d.outcomes[0].remaining, 7, "{d:?}");
    // And nowhere else: the one counter of acme (beside the write-back's guard) is the
    // calendar day's.
    let keys = redis.cli(&["KEYS", "*acme*"]);
    let counters: Vec<&str> = keys
        .lines()
        .map(str::trim)
        .filter(|k| !k.is_empty() && !k.contains("#wb:"))
        .collect();
    assert_eq!(counters.len(), 1, "{keys}");
    assert!(counters[0].contains("day@america/new_york"), "{keys}");
}
