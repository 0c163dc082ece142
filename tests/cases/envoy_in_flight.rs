//! `in_flight` through a real Envoy 1.40 (the shipped `envoy.yaml`, route `/inflight`, domain
//! `ai` of `config/examples/envoy/sluice/ai.yaml`: 3 per tenant): the request-time call takes a
//! slot for Envoy's `x-request-id`, the `apply_on_stream_done` call frees it. Requests are held
//! in flight by the test's backend (after Envoy's rate-limit filter) until the test releases
//! them, so "in flight" is a fact of the test, not a matter of timing.

use super::envoy::{front, request_then_wait, sluice, wait_healthy, RLS_OK};
use crate::support::binary::SluiceProcess;
use crate::support::envoy::{Backend, EnvoyProcess};
use crate::support::redis::start_redis;
use crate::support::*;
use std::sync::Arc;

const PATH: &str = "/inflight/chat";

/// Sends `n` requests of `tenant` at once, held at the backend; waits until every denied one
/// has its answer and the admitted ones are all held. Returns the admitted requests' tasks and
/// how many were denied.
async fn burst(
    e: &Arc<EnvoyProcess>,
    backend: &Backend,
    tenant: &'static str,
    n: usize,
) -> (Vec<tokio::task::JoinHandle<u16>>, usize) {
    held_burst(e, backend, PATH, &[("x-tenant", tenant)], n).await
}

/// Sends `n` requests to `path` with `headers` at once, each held at the backend once admitted;
/// waits until each is held or answered. Returns the requests' tasks and how many were denied.
pub(super) async fn held_burst(
    e: &Arc<EnvoyProcess>,
    backend: &Backend,
    path: &'static str,
    headers: &[(&'static str, &'static str)],
    n: usize,
) -> (Vec<tokio::task::JoinHandle<u16>>, usize) {
    let mut headers = headers.to_vec();
    headers.push(("x-hold", "1"));
    let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let denied = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (e, answered, denied) = (e.clone(), answered.clone(), denied.clone());
            let headers = headers.clone();
            tokio::spawn(async move {
                let (status, _) = e.get(path, &headers).await;
                if status == 429 {
                    denied.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                status
            })
        })
        .collect();
    let count =
        |a: &Arc<std::sync::atomic::AtomicUsize>| a.load(std::sync::atomic::Ordering::SeqCst);
    eventually(&format!("{n} requests: each held or answered"), || async {
        backend.held() + count(&answered) == n
    })
    .await;
    (tasks, count(&denied))
}

/// One or two sluice replicas on `envs` behind the shipped `envoy.yaml` (Envoy's two endpoints:
/// both replicas, or the one twice) and the test's backend, with Envoy seeing both healthy.
pub(super) struct Rig {
    pub backend: Backend,
    pub a: SluiceProcess,
    pub b: Option<SluiceProcess>,
    pub e: Arc<EnvoyProcess>,
}

impl Rig {
    pub(super) async fn start(envs: &[(&str, &str)], replicas: usize) -> Self {
        let backend = Backend::start().await;
        let a = sluice(envs).await;
        let b = if replicas == 2 {
            Some(sluice(envs).await)
        } else {
            None
        };
        let b_addr = b.as_ref().map_or(a.grpc, |b| b.grpc);
        let e = Arc::new(front(&backend, a.grpc, b_addr).await);
        wait_healthy(&e, 2).await;
        Self { backend, a, b, e }
    }

    /// The replicas, for series summed over them ([`fleet`]).
    pub(super) fn replicas(&self) -> Vec<&SluiceProcess> {
        std::iter::once(&self.a).chain(self.b.as_ref()).collect()
    }
}

async fn three_in_flight_per_tenant(envs: &[(&str, &str)], replicas: usize) {
    let rig = Rig::start(envs, replicas).await;
    let (backend, e) = (&rig.backend, &rig.e);

    for round in 1..=2 {
        let (tasks, denied) = burst(e, backend, "acme", 10).await;
        assert_eq!(
            (backend.held(), denied),
            (3, 7),
            "round {round}: 10 at once, 3 in flight admitted, 7 denied"
        );
        // While they are in flight, another request of the tenant is denied; another tenant's
        // is not.
        let (s, _) = e.get(PATH, &[("x-tenant", "acme")]).await;
        assert_eq!(s, 429, "round {round}: a 4th in flight");
        assert_eq!(
            request_then_wait(e, PATH, &[("x-tenant", "other")], 2).await,
            200
        );
        let before = e.stat(RLS_OK).await;
        backend.release(3);
        let mut statuses = Vec::new();
        for t in tasks {
            statuses.push(t.await.expect("request task"));
        }
        statuses.sort_unstable();
        assert_eq!(
            statuses.iter().filter(|&&s| s == 200).count(),
            3,
            "{statuses:?}"
        );
        // Their stream-done calls free the slots (each request makes one when it ends).
        eventually("the 3 stream-done calls answered", || async {
            e.stat(RLS_OK).await >= before + 3
        })
        .await;
        // Envoy makes the stream-done call for a request its rate-limit filter denied too: it
        // consumes that request's remembered denial (frees no slot, and is no free of nothing).
        // So each round's 12 frees (8 denials: 7 of the burst and the 4th; 4 admitted: 3 of
        // the burst and the other tenant's) leave every slot free and no free unmatched.
        let replicas = rig.replicas();
        eventually("every stream-done call answered", || async {
            fleet(&replicas, FREES).await == 12 * round
        })
        .await;
        assert_eq!(
            fleet(&replicas, SLOTS).await,
            0,
            "round {round}: every slot freed"
        );
        assert_eq!(fleet(&replicas, UNMATCHED).await, 0, "round {round}");
    }
    // One at a time, a request is never denied: each ends (and frees its slot) before the next.
    for i in 0..10 {
        let s = request_then_wait(e, PATH, &[("x-tenant", "acme")], 2).await;
        assert_eq!(s, 200, "sequential request {i}");
    }
    assert_eq!(e.stat("cluster.backend.ratelimit.error").await, 0);
    assert_eq!(e.stat("cluster.sluice.upstream_rq_timeout").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_in_flight_per_tenant_through_envoy_on_memory() {
    // One replica (both of Envoy's endpoints): memory counters are the replica's own.
    three_in_flight_per_tenant(&[], 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_in_flight_per_tenant_through_envoy_on_redis_with_two_replicas() {
    let redis = start_redis(&[]).await;
    three_in_flight_per_tenant(&[("REDIS_URL", redis.url().as_str())], 2).await;
}

/// A client that sets its own `x-request-id` (Envoy keeps a loopback client's, as it keeps any
/// internal request's with the default HCM) buys nothing with it (issue 37): 10 concurrent
/// requests sharing one id admit exactly 3; with the 3 held, more requests reusing the id are
/// denied, and the denied requests' stream-done calls free none of the 3; once the 3 end, the
/// id is admitted again.
async fn one_id_for_every_request(envs: &[(&str, &str)], replicas: usize) {
    let rig = Rig::start(envs, replicas).await;
    let (backend, e) = (&rig.backend, &rig.e);
    let replicas = rig.replicas();
    let fixed = [("x-tenant", "acme"), ("x-request-id", "fixed")];

    let (tasks, denied) = held_burst(e, backend, PATH, &fixed, 10).await;
    assert_eq!(
        (backend.held(), denied),
        (3, 7),
        "10 at once sharing one request id: exactly 3 in flight"
    );
    for i in 0..5 {
        let (s, _) = e.get(PATH, &fixed).await;
        assert_eq!(s, 429, "take {i} reusing the held id");
    }
    // The 12 denied requests' stream-done calls reach sluice...
    eventually(
        "the denied requests' stream-done calls answered",
        || async {
            fleet(&replicas, FREES).await == 12 && fleet(&replicas, TAKES_DENIED).await == 12
        },
    )
    .await;
    // ...and free none of the 3.
    assert_eq!(fleet(&replicas, SLOTS).await, 3, "the 3 slots still held");
    let (s, _) = e.get(PATH, &fixed).await;
    assert_eq!(s, 429, "still full after the denied requests' done calls");
    let (s, _) = e.get(PATH, &[("x-tenant", "acme")]).await;
    assert_eq!(s, 429, "full for a fresh id too");

    backend.release(3);
    for t in tasks {
        t.await.expect("request task");
    }
    eventually(
        "the 3 slots freed by their requests' done calls",
        || async { fleet(&replicas, SLOTS).await == 0 },
    )
    .await;
    assert_eq!(request_then_wait(e, PATH, &fixed, 2).await, 200);
    assert_eq!(e.stat("cluster.backend.ratelimit.error").await, 0);
    assert_eq!(e.stat("cluster.sluice.upstream_rq_timeout").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_id_for_every_request_buys_nothing_through_envoy_on_memory() {
    one_id_for_every_request(&[], 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_id_for_every_request_buys_nothing_through_envoy_on_redis_with_two_replicas() {
    let redis = start_redis(&[]).await;
    one_id_for_every_request(&[("REDIS_URL", redis.url().as_str())], 2).await;
}

/// SIGKILLs Envoy with requests held at the backend: their stream-done calls never come.
async fn kill_mid_request(
    e: Arc<EnvoyProcess>,
    backend: &Backend,
    tasks: Vec<tokio::task::JoinHandle<u16>>,
) {
    let status = std::process::Command::new("kill")
        .args(["-KILL", &e.pid().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let held = tasks.len();
    for t in tasks {
        let _ = t.await;
    }
    backend.release(held);
    drop(e);
}

/// Redis's clock in microseconds (what the script stamps leases with).
fn redis_now_us(redis: &crate::support::redis::RedisServer) -> u64 {
    let out = redis.cli(&["TIME"]);
    let mut parts = out
        .split_whitespace()
        .map(|p| p.parse::<u64>().expect("TIME"));
    let (s, us) = (
        parts.next().expect("seconds"),
        parts.next().expect("micros"),
    );
    s * 1_000_000 + us
}

/// Envoy SIGKILLed with 3 requests of a tenant in flight: no stream-done call ever comes. The
/// slots stay taken (a restarted Envoy's requests are denied) until each lease ends, a lease
/// after its take, and are free then. Counts and Redis's own clock, never a latency: the lease
/// ends are read from the stored slots and compared with when the first request was admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_of_a_killed_envoy_end_with_their_lease() {
    let redis = start_redis(&[]).await;
    let envs = [("REDIS_URL", redis.url())];
    let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let backend = Backend::start().await;
    let (a, b) = (sluice(&envs).await, sluice(&envs).await);
    let e = Arc::new(front(&backend, a.grpc, b.grpc).await);
    wait_healthy(&e, 2).await;

    let taken_after = redis_now_us(&redis);
    let (tasks, denied) = burst(&e, &backend, "crash", 3).await;
    let taken_before = redis_now_us(&redis);
    assert_eq!((backend.held(), denied), (3, 0), "3 in flight");
    kill_mid_request(e, &backend, tasks).await;

    // The tenant's slots: 3 ids, each ending a lease (5 s) after it was taken.
    let keys = redis.cli(&["--scan", "--pattern", "*tenant=crash*"]);
    let key = keys
        .lines()
        .next()
        .expect("the in_flight key")
        .trim()
        .to_string();
    let members = redis.cli(&["ZRANGE", &key, "0", "-1", "WITHSCORES"]);
    let ends: Vec<u64> = members
        .lines()
        .skip(1)
        .step_by(2)
        .map(|l| l.trim().parse().expect("score"))
        .collect();
    assert_eq!(ends.len(), 3, "3 slots held after the kill: {members}");
    for end in &ends {
        assert!(
            (taken_after + 5_000_000..=taken_before + 5_000_000).contains(end),
            "a lease ends 5 s after its take: {end} not in [{taken_after}, {taken_before}] + 5 s"
        );
    }
    let first_end = ends.iter().copied().min().unwrap_or(0);
    let last_end = ends.iter().copied().max().unwrap_or(0);
    // The lease gauge, summed over the two replicas: the 3 slots, while their leases run.
    let held = fleet(&[&a, &b], SLOTS).await;
    if redis_now_us(&redis) < first_end {
        assert_eq!(held, 3, "3 slots held, as the gauge has it");
    }

    // A new Envoy: the tenant's requests are denied until the slots' leases end, then admitted.
    let e = Arc::new(front(&backend, a.grpc, b.grpc).await);
    wait_healthy(&e, 2).await;
    let admitted_at = poll_until("a request of the tenant is admitted again", || {
        let e = e.clone();
        let redis = &redis;
        async move {
            let before = redis_now_us(redis);
            let (s, _) = e.get(PATH, &[("x-tenant", "crash")]).await;
            if s == 200 {
                Ok(before)
            } else {
                Err(format!("status {s}"))
            }
        }
    })
    .await;
    // Redis's clock when the admitted request was sent was at most its answer's time: the
    // first slot had ended by then, not before (never freed early).
    let answered = redis_now_us(&redis);
    assert!(
        answered >= first_end,
        "admitted at {admitted_at}..{answered}, before the first lease ended at {first_end}"
    );
    // Once every lease has ended (and the second the gauge books it in), a take drops what is
    // left of them: the 3 counted as expired, none held.
    eventually("every lease of the killed Envoy's slots ended", || async {
        redis_now_us(&redis) >= last_end + 1_000_000
    })
    .await;
    assert_eq!(
        request_then_wait(&e, PATH, &[("x-tenant", "crash")], 2).await,
        200
    );
    eventually("the expired slots counted, every slot freed", || async {
        fleet(&[&a, &b], EXPIRED).await == 3 && fleet(&[&a, &b], SLOTS).await == 0
    })
    .await;
    assert_eq!(e.stat("cluster.backend.ratelimit.error").await, 0);
}

const SLOTS: &str = r#"sluice_in_flight_slots{domain="ai"}"#;
const EXPIRED: &str = r#"sluice_leases_expired_total{domain="ai",kind="in_flight"}"#;
const UNMATCHED: &str = r#"sluice_lease_releases_unmatched_total{domain="ai",kind="in_flight"}"#;
const FREES: &str = r#"sluice_lease_calls_total{call="free",domain="ai",outcome="ok"}"#;
const TAKES_DENIED: &str =
    r#"sluice_lease_calls_total{call="take",domain="ai",outcome="over_limit"}"#;

/// A lease series of `/metrics` summed over the replicas (0 where a replica has none).
pub(super) async fn fleet(replicas: &[&SluiceProcess], series: &str) -> i64 {
    let mut sum = 0;
    for r in replicas {
        let (_, _, body) = http_request(r.http, "GET", "/metrics", &[], "").await;
        sum += body
            .lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.parse::<f64>().ok())
            .map_or(0, |v| v as i64);
    }
    sum
}

/// The same on memory (one replica, both of Envoy's endpoints): with Envoy SIGKILLed holding 3
/// requests of a tenant in flight, a restarted Envoy's requests of the tenant are denied while
/// the slots are held, and admitted once the leases end; never before a lease (5 s) after the
/// takes, by the system clock the memory store reads (a lower bound: a slow machine only makes
/// the admission later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_of_a_killed_envoy_end_with_their_lease_on_memory() {
    let now_us = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64)
    };
    let backend = Backend::start().await;
    let a = sluice(&[]).await;
    let e = Arc::new(front(&backend, a.grpc, a.grpc).await);
    wait_healthy(&e, 2).await;
    let taken_after = now_us();
    let (tasks, denied) = burst(&e, &backend, "crash", 3).await;
    let taken_before = now_us();
    assert_eq!((backend.held(), denied), (3, 0), "3 in flight");
    kill_mid_request(e, &backend, tasks).await;

    let e = Arc::new(front(&backend, a.grpc, a.grpc).await);
    wait_healthy(&e, 2).await;
    let (first, _) = e.get(PATH, &[("x-tenant", "crash")]).await;
    let checked_at = now_us();
    if checked_at < taken_after + 5_000_000 {
        assert_eq!(first, 429, "the killed Envoy's 3 slots are still held");
    }
    poll_until("a request of the tenant is admitted again", || {
        let e = e.clone();
        async move {
            let (s, _) = e.get(PATH, &[("x-tenant", "crash")]).await;
            if s == 200 {
                Ok(())
            } else {
                Err(format!("status {s}"))
            }
        }
    })
    .await;
    let answered = now_us();
    assert!(
        answered >= taken_after + 5_000_000,
        "admitted at {answered}, before any lease could end ({taken_after} + 5 s)"
    );
    // Every lease ended (and the second the gauge books it in): a take drops what is left of
    // them, the 3 counted as expired, none held.
    eventually("every lease of the killed Envoy's slots ended", || async {
        now_us() >= taken_before + 6_000_000
    })
    .await;
    assert_eq!(
        request_then_wait(&e, PATH, &[("x-tenant", "crash")], 2).await,
        200
    );
    eventually("the expired slots counted, every slot freed", || async {
        fleet(&[&a], EXPIRED).await == 3 && fleet(&[&a], SLOTS).await == 0
    })
    .await;
    assert_eq!(e.stat("cluster.backend.ratelimit.error").await, 0);
}
