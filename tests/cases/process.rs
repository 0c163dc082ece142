//! The real binary as an operator runs it: `sluice check` on broken configs, and `sluice serve`
//! stopped by SIGTERM while calls are in flight, exiting 0.

use crate::support::binary::{self, SluiceProcess, BIN};
use crate::support::*;
use sluice::proto::rate_limit_response::Code;
use std::process::Command;

#[test]
fn check_reports_every_mistake_with_file_and_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("broken.yaml");
    std::fs::write(
        &file,
        "domain: broken\n\
         descriptors:\n\
         \x20 - key: a\n\
         \x20   rate_limit:\n\
         \x20     unit: fortnight\n\
         \x20     requests_per_unit: 1\n\
         \x20 - key: \"\"\n\
         \x20   rate_limit: {unit: second, requests_per_unit: 1}\n\
         \x20 - key: b\n\
         \x20   colour: blue\n",
    )
    .expect("write config");
    let out = Command::new(BIN)
        .args(["check", file.to_str().expect("utf-8 path")])
        .output()
        .expect("run sluice check");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(1), "{text}");
    let name = file.display().to_string();
    for (line, what) in [(5, "fortnight"), (7, "key"), (10, "colour")] {
        let prefix = format!("{name}:{line}:");
        assert!(
            text.lines()
                .any(|l| l.starts_with(&prefix) && l.contains(what)),
            "expected an error at {prefix} mentioning {what:?} in:\n{text}"
        );
    }

    let ok = Command::new(BIN)
        .args([
            "check",
            concat!(env!("CARGO_MANIFEST_DIR"), "/config/examples/basic.yaml"),
        ])
        .output()
        .expect("run sluice check");
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_calls_and_exits_zero() {
    let mut command = binary::serve(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/config/examples/basic.yaml"
    ));
    command.env("WORKER_THREADS", "3");
    let mut sluice = SluiceProcess::spawn(command).await;
    let client = sluice::proto::rate_limit_service_client::RateLimitServiceClient::connect(
        sluice.grpc_url(),
    )
    .await
    .expect("sluice listens");
    let req = one("example", &[("remote_address", "10.9.9.9")]);

    // WORKER_THREADS=3: the process serves on two threads besides its main one. (A TCP connect
    // succeeds as soon as the socket listens; one answered call means the servers run.)
    client
        .clone()
        .should_rate_limit(req.clone())
        .await
        .expect("first call answered");
    let pid = sluice.pid();
    let names: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("thread list")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect();
    for name in ["sluice-grpc-1", "sluice-grpc-2"] {
        assert!(names.iter().any(|n| n == name), "{name} in {names:?}");
    }
    assert!(!names.iter().any(|n| n == "sluice-grpc-3"), "{names:?}");

    // Keep a burst of calls in flight, then SIGTERM.
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let mut c = client.clone();
        let req = req.clone();
        tasks.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            for _ in 0..200 {
                match c.should_rate_limit(req.clone()).await {
                    Ok(r) => answers.push(Ok(code(&r.into_inner()))),
                    Err(e) => {
                        answers.push(Err((e.code(), e.message().to_string())));
                        break;
                    }
                }
            }
            answers
        }));
    }
    sluice.sigterm();
    let (status, log) = sluice.exit().await;
    assert_eq!(status, Some(0), "sluice exits 0 on SIGTERM:\n{log}");

    let mut answered = 0;
    for t in tasks {
        for a in t.await.expect("task") {
            match a {
                Ok(c) => {
                    assert!(matches!(c, Code::Ok | Code::OverLimit));
                    answered += 1;
                }
                // After shutdown starts, new calls are refused at the transport level; no call
                // gets an application-level error. A call the client sends while the server's
                // graceful GOAWAY(NO_ERROR) and close are under way never reached the service;
                // tonic's client reports that race as Internal with an h2 protocol message
                // ("GoAway(NO_ERROR..." or "http2 error"), which Envoy treats as a failed call.
                // That calls in flight get their answers is checked deterministically in-process
                // (server::tests, a call held inside the store during shutdown). A call written
                // as the closed connection goes away fails in tonic's client as Unknown
                // "transport error": refused at the transport too, never answered wrongly.
                Err((code, msg)) => assert!(
                    matches!(code, tonic::Code::Unavailable | tonic::Code::Cancelled)
                        || (code == tonic::Code::Internal && msg.contains("h2 protocol error"))
                        || (code == tonic::Code::Unknown && msg == "transport error"),
                    "unexpected {code:?}: {msg}"
                ),
            }
        }
    }
    assert!(answered > 0, "calls were served before the signal");
}

#[tokio::test]
async fn json_logs_say_what_was_loaded_and_when_the_store_changes_state_without_secrets() {
    // Nothing accepts there: the store is down from the start.
    let (_guard, dead_redis) = binary::refused_addr();
    let secret = "hunter2-very-secret";
    let mut command = binary::serve(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/config/examples/hierarchy.yaml"
    ));
    command
        .env("LOG_FORMAT", "json")
        .env("REDIS_URL", format!("redis://:{secret}@{dead_redis}"))
        .env("REDIS_AUTH", secret);
    let mut sluice = SluiceProcess::spawn(command).await;
    sluice.sigterm();
    let (status, log) = sluice.exit().await;
    let seen: Vec<&str> = log.lines().collect();
    assert_eq!(status, Some(0), "{seen:#?}");

    let records: Vec<serde_json::Value> = seen
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    // Flattened records: fields sit next to level and timestamp.
    let message = |r: &serde_json::Value| r["message"].as_str().unwrap_or("").to_string();
    let loaded = records
        .iter()
        .find(|r| message(r) == "config loaded")
        .unwrap_or_else(|| panic!("no config line in {seen:#?}"));
    assert_eq!(loaded["level"], "INFO");
    assert_eq!(loaded["domains"], 1, "{loaded}");
    assert!(
        loaded["per_domain"]
            .as_str()
            .is_some_and(|s| s.starts_with("calc=")),
        "{loaded}"
    );
    assert_eq!(loaded["rate_limits"], 5, "{loaded}");
    assert!(
        records
            .iter()
            .any(|r| message(r).contains("unreachable") && r["level"] == "WARN"),
        "a store state change is logged: {seen:#?}"
    );
    assert!(
        records.iter().any(|r| message(r) == "shutdown complete"),
        "{seen:#?}"
    );
    let all = seen.join("\n");
    assert!(
        !all.contains(secret),
        "a secret leaked into the logs:\n{all}"
    );
}

/// SIGTERM with `SHUTDOWN_DRAIN_DELAY`: sluice reports NOT_SERVING (gRPC health for "" and
/// "ratelimit", `/healthcheck` 500) while it still accepts NEW connections and answers on them
/// and on the old ones, so Envoy's health checks and Kubernetes take it out before it goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_reports_not_serving_but_keeps_answering_during_the_drain_delay() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("d.yaml");
    std::fs::write(
        &file,
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1000}\n",
    )
    .expect("write config");
    let mut cmd = binary::serve(&file);
    // Long enough that the test never races its end; the test kills the process afterwards.
    cmd.env("SHUTDOWN_DRAIN_DELAY", "10m");
    let mut sluice = SluiceProcess::spawn(cmd).await;
    let url = sluice.grpc_url();
    let old = tonic::transport::Channel::from_shared(url.clone())
        .expect("url")
        .connect()
        .await
        .expect("connect");
    let mut client =
        sluice::proto::rate_limit_service_client::RateLimitServiceClient::new(old.clone());
    let req = one("d", &[("k", "v")]);
    client.should_rate_limit(req.clone()).await.expect("before");
    sluice.sigterm();
    let health = |service: &'static str| {
        let old = old.clone();
        async move {
            HealthClient::new(old)
                .check(HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .map(|r| r.into_inner().status)
                .map_err(|e| e.to_string())
        }
    };
    eventually("health turns NOT_SERVING after SIGTERM", || async {
        health("").await == Ok(ServingStatus::NotServing as i32)
    })
    .await;
    assert_eq!(
        health("ratelimit").await,
        Ok(ServingStatus::NotServing as i32)
    );
    let (status, body) = http(sluice.http, "GET", "/healthcheck", "").await;
    assert_eq!(status, 500, "{body}");
    // Still answering: on the old connection, and on a brand-new one.
    let r = client
        .should_rate_limit(req.clone())
        .await
        .expect("old connection");
    assert_eq!(code(&r.into_inner()), Code::Ok);
    let fresh = tonic::transport::Channel::from_shared(url)
        .expect("url")
        .connect()
        .await
        .expect("a new connection is still accepted");
    let r = sluice::proto::rate_limit_service_client::RateLimitServiceClient::new(fresh)
        .should_rate_limit(req)
        .await
        .expect("new connection");
    assert_eq!(code(&r.into_inner()), Code::Ok);
    let log = sluice.log();
    assert!(
        log.contains("still serving until the drain delay ends"),
        "{log}"
    );
    sluice.child.start_kill().expect("kill");
    let _ = sluice.exit().await;
}

/// `sluice check` warns where a resource limit runs under envoyproxy counting (denied consumers
/// burn the resource's budget), and not for the shipped hierarchy, which asks for
/// all_or_nothing.
#[test]
fn check_warns_about_resource_limits_under_envoyproxy_counting() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("h.yaml");
    std::fs::write(
        &file,
        "domain: h\ndescriptors:\n  - key: r\n    value: x\n    rate_limit: {unit: hour, requests_per_unit: 5, applies_to_descendants: true}\n    descriptors:\n      - key: c\n        rate_limit: {unit: hour, requests_per_unit: 1}\n",
    )
    .expect("write");
    let out = Command::new(BIN)
        .args(["check", file.to_str().expect("utf-8")])
        .env_remove("COUNTING")
        .output()
        .expect("run sluice check");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("warning: ")
            && err.contains("applies_to_descendants under envoyproxy counting"),
        "{err}"
    );
    let out = Command::new(BIN)
        .args([
            "check",
            "--counting",
            "all_or_nothing",
            file.to_str().expect("utf-8"),
        ])
        .output()
        .expect("run sluice check");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("warning"),
        "COUNTING=all_or_nothing"
    );
    let shipped = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/config/examples/hierarchy.yaml"
    );
    let out = Command::new(BIN)
        .args(["check", shipped])
        .env_remove("COUNTING")
        .output()
        .expect("run sluice check");
    assert_eq!(out.status.code(), Some(0));
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("warning"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
