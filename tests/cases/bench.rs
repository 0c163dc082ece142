//! `sluice bench` against a real server over a real socket: it reports every answer, and its
//! counts are exact (a limit of 5 admits exactly 5 of however many requests the run sent).
//! Nothing here depends on how many requests a run manages to send.

use crate::support::binary::bench;
use crate::support::*;

const FIVE: &str = r#"
domain: bench
descriptors:
  - key: resource
    value: api
    descriptors:
      - key: consumer
        rate_limit: {unit: hour, requests_per_unit: 5}
"#;

/// `sluice bench` flags: 4 callers over 2 connections for 300 ms against `target`.
fn args(target: String, rate: u64) -> Vec<String> {
    [
        "--target",
        &target,
        "--domain",
        "bench",
        "--descriptor",
        "resource=api,consumer=c{id}",
        "--consumers",
        "1",
        "--concurrency",
        "4",
        "--connections",
        "2",
        "--rate",
        &rate.to_string(),
        "--duration",
        "300ms",
        "--timeout",
        "5s",
        "--seed",
        "7",
    ]
    .map(String::from)
    .to_vec()
}

fn count(summary: &serde_json::Value, field: &str) -> u64 {
    summary[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} in {summary}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_counts_every_answer_exactly() {
    for rate in [0, 200] {
        let s = TestServer::start(FIVE).await;
        let summary = bench(&args(format!("http://{}", s.grpc_addr), rate))
            .await
            .expect("bench runs");
        let decisions = count(&summary, "decisions");
        assert_eq!(count(&summary, "errors"), 0, "{summary}");
        assert!(decisions >= 5, "{summary}");
        assert_eq!(
            count(&summary, "ok"),
            5,
            "exactly the limit admitted: {summary}"
        );
        assert_eq!(count(&summary, "over_limit"), decisions - 5, "{summary}");
        let (p50, p99, max) = (
            count(&summary, "p50_us"),
            count(&summary, "p99_us"),
            count(&summary, "max_us"),
        );
        assert!(p50 <= p99 && p99 <= max, "{summary}");
        s.stop().await;
    }
}

#[tokio::test]
async fn bench_reports_an_unreachable_target_and_bad_templates() {
    let (_guard, refused) = crate::support::binary::refused_addr();
    let e = bench(&args(format!("http://{refused}"), 0))
        .await
        .expect_err("nothing listens");
    assert!(e.contains("cannot connect"), "{e}");
    let mut bad = args("http://127.0.0.1:1".into(), 0);
    let at = bad.iter().position(|a| a == "--descriptor").expect("flag") + 1;
    bad[at] = "no-equals-sign".into();
    let e = bench(&bad).await.expect_err("bad template");
    assert!(e.contains("not key=value"), "{e}");
}
