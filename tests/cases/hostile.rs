//! The caller is the adversary (issue 37): what a client controls — its deadline, its request
//! ids — buys it nothing and degrades nobody. Black box, against real Redis and the real binary.

use crate::support::binary::{self, SluiceProcess};
use crate::support::redis::start_redis;
use crate::support::*;
use sluice::proto::rate_limit_response::Code;
use sluice::proto::rate_limit_service_client::RateLimitServiceClient;
use std::time::Duration;

const RULES: &str = r#"
domain: h
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 100}
"#;

async fn metric(s: &SluiceProcess, name: &str) -> Option<f64> {
    let (_, _, body) = http_request(s.http, "GET", "/metrics", &[], "").await;
    body.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// `FAILURE_MODE=local` on a healthy Redis: 20 requests with a 1 ms gRPC deadline (each may
/// time out at the client: that is its own business) leave `sluice_deciding_locally` at 0, no
/// request is decided locally, and the next 50 requests are decided on Redis, which counts them
/// exactly (a second replica on the same Redis sees all of them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_millisecond_deadline_never_switches_the_store_off() {
    let redis = start_redis(&[]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("h.yaml"), RULES).expect("write rules");
    let replica = |_: u8| {
        let mut cmd = binary::serve(dir.path());
        cmd.env("REDIS_URL", redis.url())
            .env("FAILURE_MODE", "local")
            .env("LOCAL_REPLICAS", "2");
        cmd
    };
    let a = SluiceProcess::spawn(replica(0)).await;
    let b = SluiceProcess::spawn(replica(1)).await;
    let mut client = RateLimitServiceClient::connect(a.grpc_url())
        .await
        .expect("connect");
    for _ in 0..20 {
        let mut req = tonic::Request::new(one("h", &[("k", "impatient")]));
        req.set_timeout(Duration::from_millis(1));
        // Answered or cut off by the caller's own deadline: either is fine.
        let _ = client.should_rate_limit(req).await;
    }
    let calls_before = redis.evalsha_calls();
    for i in 0..50 {
        let r = client
            .should_rate_limit(one("h", &[("k", "normal")]))
            .await
            .expect("answered")
            .into_inner();
        assert_eq!(code(&r), Code::Ok, "request {i}");
    }
    assert!(
        redis.evalsha_calls() >= calls_before + 50,
        "every normal request reached Redis ({} calls after {calls_before})\n{}",
        redis.evalsha_calls(),
        a.log()
    );
    assert_eq!(
        metric(&a, "sluice_deciding_locally").await,
        Some(0.0),
        "{}",
        a.log()
    );
    let local = metric(&a, "sluice_local_decisions_total")
        .await
        .unwrap_or(0.0);
    assert_eq!(local, 0.0, "nothing decided locally\n{}", a.log());
    // The other replica sees Redis's count: exactly the 50.
    let r = RateLimitServiceClient::connect(b.grpc_url())
        .await
        .expect("connect b")
        .should_rate_limit(one("h", &[("k", "normal")]))
        .await
        .expect("answered")
        .into_inner();
    assert_eq!(r.statuses[0].limit_remaining, 100 - 51, "{r:?}");
    assert!(
        a.log()
            .contains("a caller's deadline is shorter than LOCAL_DEADLINE_MARGIN"),
        "the operator is told, once:\n{}",
        a.log()
    );
}

const LEASES: &str = r#"
domain: ai
descriptors:
  - key: tenant
    in_flight: {max: 3, lease: 1h, id_key: request_id, done_key: request_done}
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 6}
  - key: key
    rate_limit: {unit: hour, requests_per_unit: 1000}
    reservations: {lease: 1h, id_key: request_id, done_key: request_done}
"#;

/// Seeds found before, replayed every run, then fresh ones (printed; `SLUICE_HOSTILE_SEED`
/// replays one).
const HOSTILE_SEEDS: [u64; 4] = [
    1,
    99_537_365,
    1_795_701_955_870_610_413,
    // RLQS: a response sluice sent on its own came before a report's answer.
    1_795_905_356_081_519_705,
];

pub(super) fn hostile_seeds() -> Vec<u64> {
    match std::env::var("SLUICE_HOSTILE_SEED") {
        Ok(s) => vec![s.parse().expect("SLUICE_HOSTILE_SEED is a number")],
        Err(_) => {
            let fresh = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(7, |d| d.as_nanos() as u64);
            HOSTILE_SEEDS.into_iter().chain([fresh]).collect()
        }
    }
}

/// One request as Envoy makes it: a request-time call now, a stream-done call later (for a
/// denied request too), the id chosen by the caller.
struct Pending {
    id: String,
    admitted: bool,
    /// A reservation's estimate (0: an `in_flight` request).
    estimate: u64,
}

/// A caller that controls ids (a handful, reused), the order in which its requests end, the
/// estimates (0 included), and whether another limit of the request denies it: whatever it
/// does, the slots counted never fall below its admitted requests still in flight (nor exceed
/// `max`), the reservations counted never fall below the estimates of its admitted requests
/// not yet settled (nor exceed the budget), and once every request has ended, nothing is held.
async fn a_hostile_caller_never_gets_past_the_lease_limits(kind: &str) {
    for seed in hostile_seeds() {
        println!("{kind}: hostile seed {seed} (SLUICE_HOSTILE_SEED={seed} replays it)");
        let (store, _clock, _backend) = super::store::make_store(kind).await;
        let s = TestServer::start_on(
            LEASES,
            sluice::service::ServiceOptions::default(),
            Some(store),
            _clock.clone(),
        )
        .await;
        let mut rng = Rng::new(seed);
        let ids = ["a", "b", "fixed", "x", "y"];
        let mut pending: Vec<Pending> = Vec::new();
        let mut reserved_admitted = 0u64;
        let mut budget_used = 0u64;
        for step in 0..400 {
            let context = format!("{kind}, seed {seed}, step {step}");
            if pending.is_empty() || rng.below(5) < 3 {
                let id = ids[rng.below(ids.len() as u64) as usize].to_string();
                if rng.below(2) == 0 {
                    // An in_flight request, sometimes with a rate limit that may deny it.
                    let mut req = one("ai", &[("tenant", "t"), ("request_id", &id)]);
                    if rng.below(3) == 0 {
                        let user = format!("u{}", rng.below(2));
                        req.descriptors.push(desc(&[("user", &user)]));
                    }
                    let admitted = code(&s.call(req).await) == Code::Ok;
                    pending.push(Pending {
                        id,
                        admitted,
                        estimate: 0,
                    });
                } else {
                    let estimate = rng.below(300);
                    let mut req = one("ai", &[("key", "k"), ("request_id", &id)]);
                    req.descriptors[0].hits_addend = Some(estimate);
                    let r = s.call(req).await;
                    let admitted = code(&r) == Code::Ok;
                    let charged = estimate.max(1);
                    if admitted {
                        reserved_admitted += charged;
                        budget_used += charged;
                    }
                    pending.push(Pending {
                        id,
                        admitted,
                        estimate: charged,
                    });
                }
            } else {
                // One request ends (any of them, in any order): its stream-done call. A
                // reservation settles at an actual no larger than its estimate, and a denied
                // budget request makes no settle (its 429 carries no usage), as through Envoy.
                let p = pending.swap_remove(rng.below(pending.len() as u64) as usize);
                if p.estimate == 0 {
                    let done = one("ai", &[("tenant", "t"), ("request_done", &p.id)]);
                    assert_eq!(code(&s.call(done).await), Code::Ok, "{context}");
                } else if p.admitted {
                    let actual = rng.below(p.estimate + 1);
                    let mut done = one("ai", &[("key", "k"), ("request_done", &p.id)]);
                    done.descriptors[0].hits_addend = Some(actual);
                    s.call(done).await;
                    reserved_admitted -= p.estimate;
                    budget_used -= p.estimate - actual;
                }
            }
            let in_flight = pending
                .iter()
                .filter(|p| p.admitted && p.estimate == 0)
                .count() as u32;
            let check = s.call(one("ai", &[("tenant", "t")])).await;
            let held = 3 - check.statuses[0].limit_remaining;
            assert!(
                held >= in_flight && in_flight <= 3,
                "{context}: {held} slots counted, {in_flight} admitted requests in flight"
            );
            let mut peek = one("ai", &[("key", "k")]);
            peek.descriptors[0].hits_addend = Some(0);
            let used = 1000 - u64::from(s.call(peek).await.statuses[0].limit_remaining);
            // Requests sharing an id: sluice cannot tell which ended, so it may give back less
            // than the model (never more) until the id's last request settles.
            assert!(
                used >= reserved_admitted && used >= budget_used,
                "{context}: {used} used, {reserved_admitted} reserved by admitted requests \
                 not settled, at least {budget_used} expected"
            );
            if !pending.iter().any(|p| p.estimate > 0 && p.admitted) {
                assert_eq!(used, budget_used, "{context}: every reservation settled");
            }
        }
        // Every request ends: nothing stays held.
        for p in pending.drain(..) {
            if p.estimate == 0 {
                s.call(one("ai", &[("tenant", "t"), ("request_done", &p.id)]))
                    .await;
            }
        }
        let check = s.call(one("ai", &[("tenant", "t")])).await;
        assert_eq!(
            check.statuses[0].limit_remaining, 3,
            "{kind}, seed {seed}: every slot freed once every request ended"
        );
        s.stop().await;
    }
}

test_with_all_stores!(hostile_lease_callers_on, kind => a_hostile_caller_never_gets_past_the_lease_limits);
