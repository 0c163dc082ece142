//! gRPC health: the statuses sluice reports (the server, envoyproxy's `ratelimit` name and the
//! RLS), and the task that probes the store and mirrors readiness in them.

use super::config::HEALTH_SERVICES;
use crate::service::RateLimiter;
use std::sync::Arc;
use std::time::Duration;
use tonic_health::ServingStatus;

pub(super) fn serving_status(ok: bool) -> ServingStatus {
    if ok {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    }
}

pub(super) async fn set_health(health: &tonic_health::server::HealthReporter, ok: bool) {
    for name in HEALTH_SERVICES {
        health.set_service_status(name, serving_status(ok)).await;
    }
}

/// Probes the store every `interval` and mirrors readiness (the store's answer, and a config
/// being in when one is required) in the gRPC health status, logging each change once. Runs
/// until the supervisor aborts it at shutdown.
pub(super) async fn watch_health(
    limiter: Arc<RateLimiter>,
    health: tonic_health::server::HealthReporter,
    interval: Duration,
    mut store_ok: bool,
    always_ready: bool,
) {
    // A zero interval would spin; a probe per millisecond is already more than enough.
    let interval = interval.max(Duration::from_millis(1));
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut config_ok = limiter.config_ready();
    loop {
        ticker.tick().await;
        let ok = limiter.probe_store().await;
        let config_now = limiter.config_ready();
        if ok == store_ok && config_now == config_ok {
            continue;
        }
        if ok != store_ok {
            match (ok, always_ready) {
                (true, false) => tracing::info!("counter store reachable"),
                (false, false) => {
                    tracing::warn!("counter store unreachable: health is NOT_SERVING")
                }
                (true, true) => tracing::info!("counter store reachable"),
                (false, true) => tracing::warn!(
                    "counter store unreachable: FAILURE_MODE answers meanwhile, health stays SERVING"
                ),
            }
        }
        let ready = (ok || always_ready) && config_now;
        if ready != ((store_ok || always_ready) && config_ok) {
            tracing::info!(
                serving = ready,
                "health is {}",
                if ready { "SERVING" } else { "NOT_SERVING" }
            );
        }
        set_health(&health, ready).await;
        store_ok = ok;
        config_ok = config_now;
    }
}

/// Probes the store once now, so a Redis that is down at start is NOT_SERVING from the first
/// health check (a store that cannot be reached is a health state, never a start-up failure),
/// and starts [`watch_health`]. Returns the reporter (the supervisor turns it NOT_SERVING on
/// shutdown), the gRPC health service and the watch task.
pub(super) async fn start_health(
    limiter: &Arc<RateLimiter>,
    interval: Duration,
) -> (
    tonic_health::server::HealthReporter,
    tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
    tokio::task::JoinHandle<()>,
) {
    let (reporter, service) = tonic_health::server::health_reporter();
    let store_ok = limiter.probe_store().await;
    if !store_ok {
        tracing::warn!(
            "counter store unreachable at start: health is NOT_SERVING until it answers"
        );
    }
    // With a FAILURE_MODE sluice answers every request itself while the store is down, so it
    // stays ready (SERVING); the store is still probed, which closes the breaker on recovery.
    let always_ready = limiter.options().failure_mode.is_some();
    set_health(
        &reporter,
        (store_ok || always_ready) && limiter.config_ready(),
    )
    .await;
    let watch = tokio::spawn(watch_health(
        Arc::clone(limiter),
        reporter.clone(),
        interval,
        store_ok,
        always_ready,
    ));
    (reporter, service, watch)
}
