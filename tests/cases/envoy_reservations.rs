//! Token budgets with `reservations` through a real Envoy 1.40 (the shipped `envoy.yaml`, route
//! `/budget`, domain `ai` of `config/examples/envoy/sluice/ai.yaml`: 1000 tokens an hour per API
//! key). The request-time call reserves the `x-token-estimate` request header for Envoy's
//! `x-request-id`; the `apply_on_stream_done` call settles it at the `x-tokens` response header
//! (the test's backend echoes the request's `x-tokens`). Requests are held at the backend, after
//! Envoy's rate-limit filter, until the test releases them, so "concurrent" is a fact of the
//! test, not a matter of timing. The issue's measurement without reservations: all 10 admitted
//! (a check of 0 at request time), or 2 and then every later request denied (estimates and
//! actuals both recorded).

use super::envoy::{request_then_wait, RLS_OK};
use super::envoy_in_flight::{fleet, held_burst, Rig};
use crate::support::redis::start_redis;
use crate::support::*;

const PATH: &str = "/budget/chat";
const RESERVED: &str = r#"sluice_reservations_outstanding{domain="ai"}"#;
const UNMATCHED: &str = r#"sluice_lease_releases_unmatched_total{domain="ai",kind="reservations"}"#;

async fn budget_of_1000(envs: &[(&str, &str)], replicas: usize) {
    let rig = Rig::start(envs, replicas).await;
    let (backend, e) = (&rig.backend, &rig.e);
    let key = [
        ("x-api-key", "k1"),
        ("x-token-estimate", "400"),
        ("x-tokens", "250"),
    ];

    // 10 at once, each reserving 400 of 1000: exactly 2 admitted (held), 8 denied.
    let (tasks, denied) = held_burst(e, backend, PATH, &key, 10).await;
    assert_eq!(
        (backend.held(), denied),
        (2, 8),
        "10 concurrent estimates of 400 against 1000"
    );
    // They end, each reporting 250: the two settles give 150 back each (500 used).
    let before = e.stat(RLS_OK).await;
    backend.release(2);
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.expect("request task"));
    }
    assert_eq!(statuses.iter().filter(|&&s| s == 200).count(), 2);
    eventually("the 2 settles answered", || async {
        e.stat(RLS_OK).await >= before + 2
    })
    .await;
    // 500 + 400 fits; then 750 + 400 does not, twice.
    let mut seq = Vec::new();
    for _ in 0..3 {
        seq.push(request_then_wait(e, PATH, &key, 2).await);
    }
    assert_eq!(seq, [200, 429, 429], "sequential after the settles");
    // 750 + 200 fits.
    let smaller = [
        ("x-api-key", "k1"),
        ("x-token-estimate", "200"),
        ("x-tokens", "200"),
    ];
    assert_eq!(request_then_wait(e, PATH, &smaller, 2).await, 200);
    // Now 950: a settle above its estimate charges the difference (50 + 100 = 1050 used), so
    // even an estimate of 1 is denied.
    let more = [
        ("x-api-key", "k2"),
        ("x-token-estimate", "100"),
        ("x-tokens", "1000"),
    ];
    assert_eq!(request_then_wait(e, PATH, &more, 2).await, 200);
    let one = [
        ("x-api-key", "k2"),
        ("x-token-estimate", "1"),
        ("x-tokens", "1"),
    ];
    assert_eq!(
        request_then_wait(e, PATH, &one, 2).await,
        429,
        "a settle of 1000 on an estimate of 100 charged 900 more"
    );
    // Every admitted request settled (none outstanding, summed over the replicas), and no
    // settle found nothing: a denied request makes none (its 429 has no `x-tokens`).
    let replicas = rig.replicas();
    eventually("every reservation settled", || async {
        fleet(&replicas, RESERVED).await == 0
    })
    .await;
    assert_eq!(fleet(&replicas, UNMATCHED).await, 0, "settles of nothing");
    assert_eq!(e.stat("cluster.backend.ratelimit.error").await, 0);
    assert_eq!(e.stat("cluster.sluice.upstream_rq_timeout").await, 0);
}

/// One `x-request-id` for all (set by the client; Envoy keeps a loopback client's): 10
/// concurrent reservations of 400 against 1000 admit exactly 2, as with distinct ids.
async fn one_id_for_every_reservation(envs: &[(&str, &str)], replicas: usize) {
    let rig = Rig::start(envs, replicas).await;
    let (backend, e) = (&rig.backend, &rig.e);
    let key = [
        ("x-api-key", "k1"),
        ("x-token-estimate", "400"),
        ("x-tokens", "400"),
        ("x-request-id", "fixed"),
    ];
    let (tasks, denied) = held_burst(e, backend, PATH, &key, 10).await;
    assert_eq!(
        (backend.held(), denied),
        (2, 8),
        "10 concurrent estimates of 400 against 1000, one id"
    );
    let replicas = rig.replicas();
    assert_eq!(fleet(&replicas, RESERVED).await, 2, "two reservations held");
    backend.release(2);
    for t in tasks {
        t.await.expect("request task");
    }
    eventually("both settled", || async {
        fleet(&replicas, RESERVED).await == 0
    })
    .await;
    // 800 used: the id buys nothing more.
    assert_eq!(request_then_wait(e, PATH, &key, 2).await, 429);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_id_for_every_reservation_buys_nothing_through_envoy_on_memory() {
    one_id_for_every_reservation(&[], 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_id_for_every_reservation_buys_nothing_through_envoy_on_redis() {
    let redis = start_redis(&[]).await;
    one_id_for_every_reservation(&[("REDIS_URL", redis.url().as_str())], 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_budget_through_envoy_on_memory() {
    // One replica (both of Envoy's endpoints): memory counters are the replica's own.
    budget_of_1000(&[], 1).await;
}

/// Two replicas on one Redis: Envoy's round robin sends a request's settle to either, so
/// settles on the replica that did not reserve are part of the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_budget_through_envoy_on_redis_with_two_replicas() {
    let redis = start_redis(&[]).await;
    budget_of_1000(&[("REDIS_URL", redis.url().as_str())], 2).await;
}
