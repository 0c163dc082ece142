//! The one way tests run the real `sluice` binary. The child binds port 0 itself and the test
//! reads the real addresses from its "sluice listening" log line, so no port is picked by the
//! test and bound later by the child (a race with anything else on the machine). stderr is
//! captured line by line; every failure message carries it.

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub const BIN: &str = env!("CARGO_BIN_EXE_sluice");

/// The binary `serve` and `bench` run: `SLUICE_BIN` when set (scripts/test.sh points it at the
/// optimized build for the tests behind Envoy's 20 ms deadline, so they never measure how fast
/// a debug build answers on a busy machine), else the test build's.
pub fn bin() -> String {
    std::env::var("SLUICE_BIN").unwrap_or_else(|_| BIN.to_string())
}

/// Upper bound on waiting for the child; only there so a broken setup cannot hang.
const CAP: Duration = Duration::from_secs(90);

/// Variables of the test's own environment that would change what the child does.
const STRAY_ENV: [&str; 18] = [
    "RUST_LOG",
    "SLUICE_CONFIG",
    "REDIS_URL",
    "REDIS_TYPE",
    "REDIS_AUTH",
    "REDIS_TLS",
    "FAILURE_MODE",
    "SHADOW_MODE",
    "LOCAL_CACHE_SIZE_IN_BYTES",
    "CACHE_KEY_PREFIX",
    "TRACING_ENABLED",
    "LOG_FORMAT",
    "GLOBAL_REDIS_URL",
    "REGION",
    "GLOBAL_UNREACHABLE",
    "GLOBAL_UNREACHABLE_SHARE",
    "DECISION_LOG",
    "CANDIDATE_CONFIG",
];

/// `sluice serve --config <config>` on `127.0.0.1`, both ports 0, text logs at info, the test's
/// own sluice variables removed. Add or override with `.env(..)` before [`SluiceProcess::spawn`].
pub fn serve(config: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut command = Command::new(bin());
    command.arg("serve").arg("--config").arg(config);
    for var in STRAY_ENV {
        command.env_remove(var);
    }
    command
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", "0")
        .env("HOST", "127.0.0.1")
        .env("PORT", "0")
        .env("ADMIN_PORT", "0")
        .env("LOG_LEVEL", "info")
        // Tests that stop the binary drain at once unless they test the delay itself.
        .env("SHUTDOWN_DRAIN_DELAY", "0s");
    command
}

/// A running `sluice` child. Killed on drop.
pub struct SluiceProcess {
    pub child: Child,
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    /// Every stderr line so far (the reader appends until the process closes stderr).
    log: Arc<Mutex<Vec<String>>>,
    reader: Option<JoinHandle<()>>,
}

impl SluiceProcess {
    /// Spawns `command` and returns once the child logged its listening addresses. Panics, with
    /// the child's stderr, if it exits first.
    pub async fn spawn(mut command: Command) -> Self {
        let mut child = command
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn sluice");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (listening, mut on_listening) = watch::channel(None);
        let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
        let sink = Arc::clone(&log);
        let reader = tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if line.contains("sluice listening") {
                    listening.send_replace(Some(listening_addrs(&line)));
                }
                sink.lock().expect("log lock").push(line);
            }
        });
        let mut process = Self {
            child,
            grpc: SocketAddr::from(([0, 0, 0, 0], 0)),
            http: SocketAddr::from(([0, 0, 0, 0], 0)),
            log,
            reader: Some(reader),
        };
        // The sender is dropped when stderr closes: the child exited without listening.
        let seen = tokio::time::timeout(CAP, on_listening.wait_for(Option::is_some)).await;
        let addrs = match seen {
            Ok(Ok(addrs)) => *addrs,
            Ok(Err(_)) => None,
            Err(_) => panic!("sluice did not listen within {CAP:?}:\n{}", process.log()),
        };
        match addrs {
            Some(Some((grpc, http))) => (process.grpc, process.http) = (grpc, http),
            Some(None) => panic!("no addresses in the listening line:\n{}", process.log()),
            None => panic!(
                "sluice exited ({:?}) before listening:\n{}",
                process.child.try_wait(),
                process.log()
            ),
        }
        process
    }

    /// The admin API's address, from the listening line.
    pub fn admin_url(&self) -> String {
        let log = self.log();
        let line = log
            .lines()
            .find(|l| l.contains("sluice listening"))
            .unwrap_or_else(|| panic!("no listening line:\n{log}"));
        let start = line
            .find(" admin=")
            .map(|i| i + 7)
            .expect("admin= in the listening line");
        let rest = &line[start..];
        let end = rest.find(' ').unwrap_or(rest.len());
        format!("http://{}", &rest[..end])
    }

    /// `http://` URL of the gRPC listener.
    pub fn grpc_url(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// The whole stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().expect("log lock").join("\n")
    }

    pub fn pid(&self) -> u32 {
        self.child.id().expect("sluice is running")
    }

    /// Sends SIGTERM, as Kubernetes does to stop a pod.
    pub fn sigterm(&self) {
        let pid = self.pid().to_string();
        let status = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM {pid}");
    }

    /// Waits for the process to exit; returns its exit code and its whole stderr.
    pub async fn exit(&mut self) -> (Option<i32>, String) {
        let status = match tokio::time::timeout(CAP, self.child.wait()).await {
            Ok(status) => status.expect("wait for sluice"),
            Err(_) => panic!("sluice did not exit within {CAP:?}:\n{}", self.log()),
        };
        if let Some(reader) = self.reader.take() {
            // stderr is closed now that the process is gone: the reader has read everything.
            let _ = tokio::time::timeout(CAP, reader).await;
        }
        (status.code(), self.log())
    }
}

/// `(grpc, http)` from the listening line, in the text (`grpc=ADDR`) or JSON (`"grpc":"ADDR"`)
/// log format.
fn listening_addrs(line: &str) -> Option<(SocketAddr, SocketAddr)> {
    let field = |name: &str| -> Option<SocketAddr> {
        let text = format!(" {name}=");
        let json = format!("\"{name}\":\"");
        let start = match (line.find(&text), line.find(&json)) {
            (Some(i), _) => i + text.len(),
            (None, Some(i)) => i + json.len(),
            (None, None) => return None,
        };
        let rest = &line[start..];
        let end = rest.find([' ', '"']).unwrap_or(rest.len());
        rest[..end].parse().ok()
    };
    Some((field("grpc")?, field("http")?))
}

/// A `127.0.0.1` address where nothing accepts connections, for as long as the guard lives: the
/// socket is bound (so nothing else can take the port) but never listens, so a connection is
/// refused at once.
pub fn refused_addr() -> (tokio::net::TcpSocket, SocketAddr) {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("bind");
    let addr = socket.local_addr().expect("local addr");
    (socket, addr)
}

/// `sluice bench --json ARGS` run to its end: the summary it printed, or (when it exits
/// non-zero) its stderr.
pub async fn bench(args: &[String]) -> Result<serde_json::Value, String> {
    let mut command = Command::new(bin());
    command.arg("bench").arg("--json").args(args);
    for var in STRAY_ENV {
        command.env_remove(var);
    }
    let out = tokio::time::timeout(CAP, command.output())
        .await
        .expect("sluice bench finishes")
        .expect("sluice bench runs");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "bench printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// `sluice bench` on `target` (domain, descriptor template, `{id}` one of `consumers`),
/// `rate` requests a second (0: closed loop, 32 in flight) over 2 connections for `duration`,
/// each call with a 5 s deadline; asserts no errors and returns (ok, over_limit).
pub async fn bench_load(
    target: &str,
    (domain, descriptor, consumers): (&str, &str, u64),
    rate: u32,
    duration: &str,
) -> (u64, u64) {
    let (consumers, rate) = (consumers.to_string(), rate.to_string());
    let args: Vec<String> = [
        "--target",
        target,
        "--domain",
        domain,
        "--descriptor",
        descriptor,
        "--consumers",
        &consumers,
        "--concurrency",
        "32",
        "--connections",
        "2",
        "--rate",
        &rate,
        "--duration",
        duration,
        "--timeout",
        "5s",
    ]
    .map(String::from)
    .to_vec();
    let s = bench(&args).await.expect("bench runs");
    assert_eq!(s["errors"].as_u64(), Some(0), "{s}");
    (
        s["ok"].as_u64().expect("ok"),
        s["over_limit"].as_u64().expect("over_limit"),
    )
}

/// Resident memory of a process in bytes, from `/proc/PID/status`: now (`VmRSS:`) or its peak so
/// far (`VmHWM:`).
pub fn resident(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("/proc status")
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("memory field")
        * 1024
}
