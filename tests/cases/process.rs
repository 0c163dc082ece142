//! The real binary as an operator runs it: `sluice check` on broken configs, and `sluice serve`
//! stopped by SIGTERM while calls are in flight, exiting 0.

use crate::support::*;
use sluice::proto::rate_limit_response::Code;
use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_sluice");

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
    let (grpc, http_port) = (free_port(), free_port());
    let mut child = tokio::process::Command::new(BIN)
        .args([
            "serve",
            "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/config/examples/basic.yaml"),
        ])
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", grpc.to_string())
        .env("HOST", "127.0.0.1")
        .env("PORT", http_port.to_string())
        .env("WORKER_THREADS", "3")
        .env_remove("REDIS_URL")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn sluice");

    // Wait until it serves (readiness, not a timing assertion: the loop only bounds a hang).
    let url = format!("http://127.0.0.1:{grpc}");
    let mut client = None;
    for _ in 0..600 {
        if let Ok(c) =
            sluice::proto::rate_limit_service_client::RateLimitServiceClient::connect(url.clone())
                .await
        {
            client = Some(c);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let client = client.expect("sluice came up");
    let req = one("example", &[("remote_address", "10.9.9.9")]);

    // WORKER_THREADS=3: the process serves on two threads besides its main one. (A TCP connect
    // succeeds as soon as the socket listens; one answered call means the servers run.)
    client
        .clone()
        .should_rate_limit(req.clone())
        .await
        .expect("first call answered");
    let pid = child.id().expect("pid");
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
    sigterm(&child);
    let status = child.wait().await.expect("wait for sluice");
    assert_eq!(status.code(), Some(0), "sluice exits 0 on SIGTERM");

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
                // (server::tests, a call held inside the store during shutdown).
                Err((code, msg)) => assert!(
                    matches!(code, tonic::Code::Unavailable | tonic::Code::Cancelled)
                        || (code == tonic::Code::Internal && msg.contains("h2 protocol error")),
                    "unexpected {code:?}: {msg}"
                ),
            }
        }
    }
    assert!(answered > 0, "calls were served before the signal");
}

#[tokio::test]
async fn json_logs_say_what_was_loaded_and_when_the_store_changes_state_without_secrets() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let (grpc, http_port, dead_redis) = (free_port(), free_port(), free_port());
    let secret = "hunter2-very-secret";
    let mut child = tokio::process::Command::new(BIN)
        .args([
            "serve",
            "--config",
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/config/examples/hierarchy.yaml"
            ),
        ])
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", grpc.to_string())
        .env("HOST", "127.0.0.1")
        .env("PORT", http_port.to_string())
        .env("LOG_FORMAT", "json")
        .env("LOG_LEVEL", "info")
        .env_remove("RUST_LOG")
        // Nothing listens there: the store is down from the start.
        .env(
            "REDIS_URL",
            format!("redis://:{secret}@127.0.0.1:{dead_redis}"),
        )
        .env("REDIS_AUTH", secret)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn sluice");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let mut seen = Vec::new();
    // Read until it listens (a hang is bounded by the test harness, not asserted on).
    while let Some(line) = lines.next_line().await.expect("read stderr") {
        let listening = line.contains("sluice listening");
        seen.push(line);
        if listening {
            break;
        }
    }
    sigterm(&child);
    while let Some(line) = lines.next_line().await.expect("read stderr") {
        seen.push(line);
    }
    let status = child.wait().await.expect("wait for sluice");
    assert_eq!(status.code(), Some(0), "{seen:#?}");

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

/// Sends SIGTERM to a running child, as Kubernetes does to stop a pod.
fn sigterm(child: &tokio::process::Child) {
    let pid = child.id().expect("pid").to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
}
