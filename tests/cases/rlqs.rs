//! The Rate Limit Quota Service through real Envoy 1.40 processes (the `rate_limit_quota`
//! filter of the shipped `config/examples/envoy/rlqs.yaml`, bucketing by `x-api-key`) against
//! the real sluice binary. Envoy reports on its own 5 s timer, so these tests offer load for a
//! whole limit window (L = 600 a minute, 12 report periods) and assert counts per window,
//! aligned to the window's boundary, against the bounds the README states; never latencies.

use crate::support::binary::{self, SluiceProcess};
use crate::support::envoy::{self, Backend, EnvoyProcess};
use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The limit of the example's domain `rlqs`: 600 a minute per key.
const L: u64 = 600;
const WINDOW: u64 = 60;

async fn sluice() -> SluiceProcess {
    SluiceProcess::spawn(binary::serve(envoy::example("sluice"))).await
}

async fn front(backend: &Backend, sluice: &SluiceProcess) -> EnvoyProcess {
    EnvoyProcess::start(
        &envoy::example("rlqs.yaml"),
        &[
            (envoy::BACKEND_PORT, backend.port),
            (envoy::SLUICE_PORTS[0], sluice.grpc.port()),
        ],
    )
    .await
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Offers `rate` requests a second with `key` through `e` from now until the end of the first
/// window that starts after `warmup` seconds, and returns (status -> count) for that window.
async fn offer_one_window(
    e: &EnvoyProcess,
    key: &str,
    rate: u64,
    warmup: u64,
) -> HashMap<u16, u64> {
    let window = (unix_secs() + warmup) / WINDOW + 1;
    let mut counts = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    loop {
        tick.tick().await;
        let now = unix_secs() / WINDOW;
        if now > window {
            return counts;
        }
        let (status, _) = e.get("/", &[("x-api-key", key)]).await;
        if now == window {
            *counts.entry(status).or_default() += 1;
        }
    }
}

/// Acceptance 1: one Envoy, one key, offered 15/s (1.5 L) for a whole window: admitted within
/// [0.9 L, L + bound], where the bound is one request before the bucket's first assignment,
/// the fresh bucket's `max_tokens` (one second of its share) and the share over a report
/// period and a round trip while demand shifts (15 x 6), far above what a steady demand uses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_envoy_one_key_is_admitted_about_the_limit_per_window() {
    let backend = Backend::start().await;
    let s = sluice().await;
    let e = front(&backend, &s).await;
    let counts = offer_one_window(&e, "acceptance-1", 15, 12).await;
    let admitted = counts.get(&200).copied().unwrap_or(0);
    let denied = counts.get(&429).copied().unwrap_or(0);
    let bound = 1 + 15 + 15 * 6;
    println!("RLQS one window, L = {L}, offered 15/s: admitted {admitted}, denied {denied}");
    assert!(
        admitted * 10 >= L * 9 && admitted <= L + bound,
        "admitted {admitted} (denied {denied}) in one window of L = {L}: {counts:?}"
    );
    assert!(denied > 0, "1.5 L offered: some must be denied: {counts:?}");
    assert_eq!(
        counts.keys().filter(|&&k| k != 200 && k != 429).count(),
        0,
        "only 200 and 429: {counts:?}"
    );
}
