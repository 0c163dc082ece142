//! The decision log and `sluice replay` with real processes: a `sluice serve` on the memory
//! store writes its log (`DECISION_LOG`) under `sluice bench`'s load, many requests in flight;
//! `sluice replay` then gives back every logged answer for the enforced config and names who a
//! lower limit would stop; a full disk or a full queue drops lines, counted, and every request
//! is still answered.

use crate::support::binary::{bench_load, bin, serve, SluiceProcess};
use crate::support::{http, poll_until};
use std::path::Path;
use tokio::process::Command;

/// Per consumer: 5 a second and 30 over a sliding 10 s (the load sends each consumer ~40 a
/// second: over both however slowly a busy machine sends it).
const CONFIG: &str = r#"domain: bench
descriptors:
  - key: resource
    value: api
    descriptors:
      - key: consumer
        rate_limits:
          - {name: per-consumer, requests_per_unit: 5, unit: second}
          - {name: sliding, requests_per_unit: 30, period: 10s, algorithm: sliding_window}
"#;

async fn replay(args: &[&str]) -> Result<String, String> {
    let out = Command::new(bin())
        .arg("replay")
        .args(args)
        .output()
        .await
        .expect("sluice replay runs");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write");
    p.display().to_string()
}

async fn metric(s: &SluiceProcess, line: &str) -> u64 {
    let metrics = http(s.http, "GET", "/metrics", "").await.1;
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(line))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no {line} in /metrics:\n{metrics}")) as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_log_replayed_gives_back_every_answer_and_a_lower_limit_names_who_it_stops() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write(dir.path(), "a.yaml", CONFIG);
    let lower = write(
        dir.path(),
        "b.yaml",
        &CONFIG.replace("requests_per_unit: 5,", "requests_per_unit: 2,"),
    );
    let log = dir.path().join("decisions.log");
    let mut s = SluiceProcess::spawn({
        let mut c = serve(&config);
        c.env("DECISION_LOG", &log)
            .env("DECISION_LOG_REDACT", "consumer")
            .env("DECISION_LOG_REDACT_SALT", "a salt of 16 bytes or more");
        c
    })
    .await;
    // 40 consumers, ~40 requests a second each for 3 s: over both limits, 32 in flight.
    let (ok, over) = bench_load(
        &s.grpc_url(),
        ("bench", "resource=api,consumer={id}", 40),
        1_600,
        "3s",
    )
    .await;
    assert!(ok > 0 && over > 0, "{ok} {over}");
    s.sigterm();
    let (code, _) = s.exit().await;
    assert_eq!(code, Some(0));
    let text = std::fs::read_to_string(&log).expect("the log");
    // Every consumer value is a digest: no raw id on disk.
    let values: Vec<&str> = text.split("[\"consumer\",\"").skip(1).collect();
    assert_eq!(values.len() as u64, ok + over);
    assert!(
        values.iter().all(|v| v.starts_with("h:")),
        "values redacted"
    );

    let plot = dir.path().join("p.svg");
    let log_arg = log.display().to_string();
    let plot_arg = plot.display().to_string();
    let json = replay(&[
        "--log",
        &log_arg,
        "--compare",
        &config,
        &lower,
        "--json",
        "--top",
        "3",
        "--plot",
        &plot_arg,
    ])
    .await
    .expect("replay");
    let r: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    assert_eq!(r["lines"].as_u64(), Some(ok + over), "every request logged");
    let (same, halved) = (&r["configs"][0], &r["configs"][1]);
    // The enforced config: every answer as given (in flight 32 at a time, decided on the
    // store's own clock).
    assert_eq!(same["requests"]["admitted"].as_u64(), Some(ok), "{same}");
    assert_eq!(same["requests"]["denied"].as_u64(), Some(over), "{same}");
    assert_eq!(same["logged"], same["requests"]);
    assert_eq!(same["newly_denied"].as_u64(), Some(0));
    assert_eq!(same["newly_admitted"].as_u64(), Some(0));
    // A limit of 2 instead of 5: more denied, none newly admitted, and who.
    let newly = halved["newly_denied"].as_u64().expect("newly_denied");
    assert!(newly > 0, "{halved}");
    assert_eq!(halved["newly_admitted"].as_u64(), Some(0));
    assert_eq!(
        halved["requests"]["denied"].as_u64(),
        Some(over + newly),
        "{halved}"
    );
    let limits = halved["limits"].as_array().expect("limits");
    let per = limits
        .iter()
        .find(|l| l["limit"] == "per-consumer")
        .expect("per-consumer");
    let top = per["top"].as_array().expect("top");
    assert!(!top.is_empty() && top.len() <= 3, "{per}");
    for t in top {
        let who = t["consumer"].as_str().expect("consumer");
        assert!(
            who.starts_with(r#"[["resource","api"],["consumer","h:"#),
            "{who}"
        );
        assert!(t["denied"].as_u64() > Some(0));
    }
    let picture = std::fs::read_to_string(&plot).expect("the picture");
    assert!(picture.starts_with("<svg") && picture.contains("per-consumer"));

    // Replayed as a service in shadow mode (`--shadow-mode`, or SHADOW_MODE in its
    // environment) decides it: every request answered OK, the logged denials newly admitted.
    let json = replay(&[
        "--log",
        &log_arg,
        "--config",
        &config,
        "--json",
        "--shadow-mode",
    ])
    .await
    .expect("replay in shadow mode");
    let r: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    let shadow = &r["configs"][0];
    assert_eq!(shadow["requests"]["admitted"].as_u64(), Some(ok + over));
    assert_eq!(shadow["requests"]["denied"].as_u64(), Some(0));
    assert_eq!(shadow["newly_admitted"].as_u64(), Some(over), "{shadow}");

    // The table names the configs and the limits.
    let table = replay(&["--log", &log_arg, "--config", &lower])
        .await
        .expect("table");
    assert!(
        table.contains("b.yaml") && table.contains("newly denied"),
        "{table}"
    );
}

/// A `sluice serve` of `config` with `env`, loaded closed-loop for `duration` by 40 consumers:
/// the process and the requests it decided (every one answered: `bench_load` asserts no error).
async fn loaded(
    config: &str,
    env: &[(&str, &std::ffi::OsStr)],
    duration: &str,
) -> (SluiceProcess, u64) {
    let mut c = serve(config);
    for (k, v) in env {
        c.env(k, v);
    }
    let s = SluiceProcess::spawn(c).await;
    let (ok, over) = bench_load(
        &s.grpc_url(),
        ("bench", "resource=api,consumer={id}", 40),
        0,
        duration,
    )
    .await;
    (s, ok + over)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_or_a_stuck_writer_drops_lines_counted_and_every_request_is_answered() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write(dir.path(), "a.yaml", CONFIG);
    // /dev/full: every write fails with ENOSPC.
    let full = std::ffi::OsStr::new("/dev/full");
    let (s, decided) = loaded(&config, &[("DECISION_LOG", full)], "1s").await;
    let failed = "sluice_decision_log_dropped_total{reason=\"write_error\"} ";
    poll_until("every line dropped and counted", || async {
        match metric(&s, failed).await {
            n if n == decided => Ok(()),
            n => Err(n),
        }
    })
    .await;
    assert_eq!(metric(&s, "sluice_decision_log_lines_total ").await, 0);

    // A named pipe nobody reads: the writer's second batch blocks once the pipe's 64 KiB are
    // full, for good; the queue (one line) fills, and every line after it is dropped at once.
    let fifo = dir.path().join("stuck.log");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    let one = std::ffi::OsStr::new("1");
    let env = [
        ("DECISION_LOG", fifo.as_os_str()),
        ("DECISION_LOG_QUEUE", one),
    ];
    let (s, mut decided) = loaded(&config, &env, "1s").await;
    // Enough requests that two batches and the queue cannot hold them, however slow the
    // machine (a count, not a time).
    while decided < 3_000 {
        let (ok, over) = bench_load(
            &s.grpc_url(),
            ("bench", "resource=api,consumer={id}", 40),
            0,
            "1s",
        )
        .await;
        decided += ok + over;
    }
    let dropped = metric(
        &s,
        "sluice_decision_log_dropped_total{reason=\"queue_full\"} ",
    )
    .await;
    // At most two batches of 64 KiB (lines of ~110 bytes) and the queued line got through.
    assert!(dropped + 1_300 >= decided, "{dropped} dropped of {decided}");
}

#[tokio::test]
async fn replay_refuses_what_it_cannot_read_and_names_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write(dir.path(), "a.yaml", CONFIG);
    let missing = dir.path().join("none.log").display().to_string();
    let e = replay(&["--log", &missing, "--config", &config])
        .await
        .expect_err("no log");
    assert!(e.contains("none.log"), "{e}");
    let bad = write(dir.path(), "bad.log", "{\"t\":1}\n");
    let e = replay(&["--log", &bad, "--config", &config])
        .await
        .expect_err("bad line");
    assert!(e.contains("bad.log:1:"), "{e}");
    let good = write(
        dir.path(),
        "good.log",
        "{\"t\":1,\"domain\":\"bench\",\"descriptors\":[],\"ok\":true}\n",
    );
    let e = replay(&["--log", &good, "--config", &config, "--plot", "x.png"])
        .await
        .expect_err("png");
    assert!(e.contains("SVG"), "{e}");
    let broken = write(dir.path(), "broken.yaml", "domain: [\n");
    let e = replay(&["--log", &good, "--config", &broken])
        .await
        .expect_err("bad config");
    assert!(e.contains("broken.yaml"), "{e}");
    let e = replay(&["--log", &good]).await.expect_err("no config");
    assert!(e.contains("--config") || e.contains("--compare"), "{e}");
}
