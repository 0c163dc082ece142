//! `sluice bench` against a real server over a real socket: it reports every answer, and its
//! counts are exact (a limit of 5 admits exactly 5 of however many requests the run sent).
//! Nothing here depends on how many requests a run manages to send.

use crate::support::*;
use sluice::bench::{run, BenchArgs};
use std::time::Duration;

const FIVE: &str = r#"
domain: bench
descriptors:
  - key: resource
    value: api
    descriptors:
      - key: consumer
        rate_limit: {unit: hour, requests_per_unit: 5}
"#;

fn args(target: String, rate: u64) -> BenchArgs {
    BenchArgs {
        target,
        domain: "bench".into(),
        descriptors: vec!["resource=api,consumer=c{id}".into()],
        consumers: 1,
        concurrency: 4,
        connections: 2,
        rate,
        duration: Duration::from_millis(300),
        hits_addend: 0,
        timeout: Duration::from_secs(5),
        ca_cert: None,
        client_cert: None,
        client_key: None,
        tls_server_name: None,
        json: true,
        seed: 7,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_counts_every_answer_exactly() {
    for rate in [0, 200] {
        let s = TestServer::start(FIVE).await;
        let summary = run(args(format!("http://{}", s.grpc_addr), rate))
            .await
            .expect("bench runs");
        assert_eq!(summary.errors, 0, "{summary:?}");
        assert!(summary.decisions >= 5, "{summary:?}");
        assert_eq!(summary.ok, 5, "exactly the limit admitted: {summary:?}");
        assert_eq!(summary.over_limit, summary.decisions - 5, "{summary:?}");
        assert!(summary.p50_us <= summary.p99_us && summary.p99_us <= summary.max_us);
        let json = serde_json::to_value(&summary).expect("json");
        assert_eq!(json["decisions"], summary.decisions);
        s.stop().await;
    }
}

#[tokio::test]
async fn bench_reports_an_unreachable_target_and_bad_templates() {
    let (_guard, refused) = crate::support::binary::refused_addr();
    let e = run(args(format!("http://{refused}"), 0))
        .await
        .expect_err("nothing listens");
    assert!(e.contains("cannot connect"), "{e}");
    let mut bad = args("http://127.0.0.1:1".into(), 0);
    bad.descriptors = vec!["no-equals-sign".into()];
    let e = run(bad).await.expect_err("bad template");
    assert!(e.contains("not key=value"), "{e}");
}
