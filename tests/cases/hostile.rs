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
