//! Real `redis-server` processes for the integration tests, never mocks: a standalone
//! [`RedisServer`] (which can be stopped and restarted on the same port for fault tests) and a
//! three-master [`RedisCluster`], each node on its own free port in its own temporary directory.
//! Everything is torn down on drop, also when a test panics, and a watchdog kills the servers
//! if the test process itself dies without unwinding.
#![allow(dead_code)]

use std::collections::hash_map::RandomState;
use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::hash::BuildHasher;
use std::io::{self, Read, Seek, SeekFrom};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};
use tempfile::TempDir;

/// Upper bound for one server to answer `PING`; only there so a broken setup cannot hang.
const START_DEADLINE: Duration = Duration::from_secs(60);
/// Upper bound for `redis-cli --cluster create` plus every node reporting `cluster_state:ok`.
const CLUSTER_DEADLINE: Duration = Duration::from_secs(120);
/// Upper bound for one `redis-cli` invocation.
const CLI_DEADLINE: Duration = Duration::from_secs(60);
/// Upper bound for a killed server to be reaped.
const STOP_DEADLINE: Duration = Duration::from_secs(20);
/// Fresh ports tried when a chosen port turns out to be taken at startup.
const START_ATTEMPTS: usize = 8;
/// Whole-cluster attempts (fresh nodes each time) if the cluster cannot be formed.
const CLUSTER_ATTEMPTS: usize = 3;
/// Redis Cluster's bus listens on the client port plus this offset.
const BUS_OFFSET: u16 = 10_000;
const POLL: Duration = Duration::from_millis(25);
const CLUSTER_SLOTS: &str = "16384";
/// `redis-server` arguments of every cluster node.
const CLUSTER_NODE_ARGS: [&str; 6] = [
    "--cluster-enabled",
    "yes",
    "--cluster-config-file",
    "nodes.conf",
    "--cluster-node-timeout",
    "5000",
];

/// Runs redis-server as a background job of `sh` and exits with its status. A watcher holds the
/// read end of our stdin pipe: when the write end closes (on `stop`, or because the test process
/// died, even by SIGKILL) it kills redis-server, so no server outlives its test.
pub(super) const WATCHDOG: &str = r#"exec 3<&0 0</dev/null
redis-server "$@" 3<&- &
pid=$!
(read -r line <&3; kill -9 "$pid" 2>/dev/null) &
watcher=$!
exec 3<&-
wait "$pid"
code=$?
kill "$watcher" 2>/dev/null
exit "$code""#;

// ---------------------------------------------------------------------------------------------
// Standalone server
// ---------------------------------------------------------------------------------------------

/// Which server a test runs: Redis, or Valkey (the managed Redis of the large clouds moved to
/// it; the store must work on both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    Redis,
    Valkey,
}

impl Server {
    /// The server binary: `redis-server`, or `$VALKEY_SERVER` (set by `scripts/test.sh`, which
    /// installs Valkey when missing), else `valkey-server` on the PATH.
    pub fn bin(self) -> String {
        match self {
            Server::Redis => "redis-server".into(),
            Server::Valkey => {
                std::env::var("VALKEY_SERVER").unwrap_or_else(|_| "valkey-server".into())
            }
        }
    }
}

/// One real `redis-server` (standalone, no persistence) on `127.0.0.1` and a free port, in a
/// fresh temporary directory.
pub struct RedisServer {
    server: Server,
    port: u16,
    /// Whether `port + 10000` is reserved too (cluster nodes).
    bus: bool,
    extra_args: Vec<String>,
    /// The `sh` watchdog whose exit is redis-server's exit; `None` while stopped.
    child: Option<Child>,
    dir: TempDir,
}

impl RedisServer {
    /// Starts a standalone server and waits until it answers `PING`. Panics with the server's
    /// log if it cannot start.
    pub fn start() -> Self {
        Self::start_with_args(&[])
    }

    /// Like [`RedisServer::start`], with extra `redis-server` arguments appended (for example
    /// `["--maxmemory", "10mb"]`).
    pub fn start_with_args(extra: &[&str]) -> Self {
        Self::launch(extra.iter().map(|s| s.to_string()).collect(), false)
    }

    fn launch(extra_args: Vec<String>, bus: bool) -> Self {
        Self::launch_as(Server::Redis, extra_args, bus)
    }

    /// A standalone Valkey server (see [`Server::bin`]).
    pub fn start_valkey() -> Self {
        Self::launch_as(Server::Valkey, Vec::new(), false)
    }

    fn launch_as(server: Server, extra_args: Vec<String>, bus: bool) -> Self {
        Self::launch_with(server, Listen::Plain, bus, |_| extra_args.clone())
    }

    /// Starts a server listening as `listen` with the arguments `args` gives for a port, on a
    /// fresh port each time the chosen one turns out to be taken; `bus` reserves `port + 10000`
    /// too. Panics with the server's log if it cannot start.
    fn launch_with(
        server: Server,
        listen: Listen,
        bus: bool,
        args: impl Fn(u16) -> Vec<String>,
    ) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(listen.dir_prefix())
            .tempdir()
            .expect("create a temporary directory for redis-server");
        let mut failures = Vec::new();
        for attempt in 1..=START_ATTEMPTS {
            let port = reserve_port(bus);
            let extra_args = args(port);
            match spawn_ready(server, listen, port, dir.path(), &extra_args) {
                Ok(child) => {
                    return Self {
                        server,
                        port,
                        bus,
                        extra_args,
                        child: Some(child),
                        dir,
                    }
                }
                Err(e) => {
                    release_port(port, bus);
                    failures.push(format!(
                        "--- attempt {attempt} on {} {port} ---\n{}",
                        listen.port_name(),
                        e.message
                    ));
                    if !e.port_taken {
                        break;
                    }
                    clear_dir(dir.path());
                }
            }
        }
        panic!("{}\n{}", listen.not_started(), failures.join("\n"));
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The server's working directory (holds `redis.log`, and `nodes.conf` for cluster nodes).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Whether the process is running (not stopped, and not exited on its own).
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// `PING` over a fresh connection answers `PONG`.
    pub fn ping(&self) -> bool {
        ping(self.port)
    }

    /// Runs `redis-cli -h 127.0.0.1 -p PORT <args>` and returns its stdout (raw, as printed when
    /// not on a terminal: `OK`, `-1`, one list element per line...). Error replies come back as
    /// text (`ERR ...`); panics if redis-cli itself fails, e.g. cannot connect.
    pub fn cli(&self, args: &[&str]) -> String {
        self.try_cli(args).unwrap_or_else(|e| {
            panic!(
                "redis-cli -p {} {args:?} failed: {e}\n{}",
                self.port,
                logs(self.dir())
            )
        })
    }

    /// Like [`RedisServer::cli`], but a failing redis-cli (e.g. the server is down) is an `Err`
    /// carrying its stderr.
    pub fn try_cli(&self, args: &[&str]) -> Result<String, String> {
        redis_cli(&["-h", "127.0.0.1", "-p", &self.port.to_string()], args)
    }

    /// `redis-cli MONITOR` on this server from now until [`Monitor::stop`]: every command it
    /// runs, in order, a script's own commands right after its call (marked `lua`).
    pub fn monitor(&self) -> Monitor {
        static N: AtomicU64 = AtomicU64::new(0);
        let path = self
            .dir()
            .join(format!("monitor-{}.log", N.fetch_add(1, Ordering::Relaxed)));
        let out = File::create(&path).expect("monitor log");
        let child = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "MONITOR"])
            .stdout(out)
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-cli MONITOR");
        let m = Monitor {
            child,
            path,
            port: self.port,
        };
        // Monitoring once redis-cli printed its OK.
        m.wait_for("OK");
        m
    }

    /// Every key with its `TTL` (`-1`: no expiry), sorted by key.
    /// Calls of EVALSHA since start or `CONFIG RESETSTAT`, from `INFO commandstats`.
    pub fn evalsha_calls(&self) -> u64 {
        self.cli(&["INFO", "commandstats"])
            .lines()
            .find(|l| l.starts_with("cmdstat_evalsha:"))
            .and_then(|l| l.split("calls=").nth(1))
            .and_then(|v| v.split(',').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    /// Every key and its TTL. A call a signal interrupts (EINTR: a child process of the test,
    /// an Envoy or a sluice just stopped, delivers SIGCHLD; seen once in CI) is made again.
    pub fn keys_with_ttl(&self) -> Vec<(String, i64)> {
        let mut tries = 0;
        let mut keys = loop {
            match keys_with_ttl(self.port) {
                Ok(keys) => break keys,
                Err(e) if tries < 3 && e.to_string().contains("Interrupted") => tries += 1,
                Err(e) => panic!("scanning keys on port {} failed: {e}", self.port),
            }
        };
        keys.sort();
        keys
    }

    /// The server's log so far (for diagnostics).
    pub fn log(&self) -> String {
        logs(self.dir())
    }

    /// Sends `signal` (`STOP`, `CONT`, ...) to the server process: SIGSTOP freezes it with its
    /// connections open (a hung Redis), SIGCONT resumes it where it stopped.
    pub fn signal(&self, signal: &str) {
        assert!(self.child.is_some(), "the server is running");
        // The child is the watchdog shell; the server is the process listening on our port
        // (found by its command line, which also works while it is stopped).
        let port = self.port.to_string();
        let pid = std::fs::read_dir("/proc")
            .expect("read /proc")
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .find(|pid| {
                let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                    return false;
                };
                // redis-server and valkey-server rewrite their title as "<binary> <bind>:<port>"
                // (a Cluster node's ends in " [cluster]").
                let title = String::from_utf8_lossy(cmd.split(|&b| b == 0).next().unwrap_or(&[]))
                    .to_string();
                title.contains("-server ")
                    && (title.ends_with(&format!(":{port}"))
                        || title.contains(&format!(":{port} ")))
            })
            .expect("the redis-server process of this port");
        let ok = std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill -{signal} {pid}");
    }

    /// Kills the server (SIGKILL, no shutdown, nothing saved) and waits until it is gone. The
    /// port stays reserved and the directory stays, so [`RedisServer::restart`] can bring it back.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            stop_child(&mut child);
        }
    }

    /// Starts the server again on the same port and directory (empty: nothing is persisted; a
    /// cluster node keeps its `nodes.conf` and rejoins) and waits until it answers `PING`. Stops
    /// it first if it is running. Panics if the port cannot be bound again.
    pub fn restart(&mut self) {
        self.stop();
        let deadline = Instant::now() + START_DEADLINE;
        let mut failures = Vec::new();
        for attempt in 1..=START_ATTEMPTS {
            match spawn_ready(
                self.server,
                Listen::Plain,
                self.port,
                self.dir(),
                &self.extra_args,
            ) {
                Ok(child) => {
                    self.child = Some(child);
                    return;
                }
                Err(e) => failures.push(format!("--- attempt {attempt} ---\n{}", e.message)),
            }
            if Instant::now() > deadline {
                break;
            }
            thread::sleep(Duration::from_millis(200));
        }
        panic!(
            "redis-server could not be restarted on port {}\n{}",
            self.port,
            failures.join("\n")
        );
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        release_port(self.port, self.bus);
        // `dir` (a TempDir) is removed after this, once the process is gone.
    }
}

// ---------------------------------------------------------------------------------------------
// Standalone server over TLS
// ---------------------------------------------------------------------------------------------

impl RedisServer {
    /// Starts a standalone server that speaks TLS only (`--port 0 --tls-port PORT`), with the
    /// server certificate, key and CA of `certs`; with `auth_clients` it also requires a client
    /// certificate signed by that CA (`tls-auth-clients yes`). Waits until `PING` over TLS
    /// answers. [`RedisServer::port`] is the TLS port; use [`RedisServer::tls_url`] and
    /// [`RedisServer::tls_cli`]: the plaintext helpers (`url`, `ping`, `cli`, `keys_with_ttl`,
    /// `restart`) do not apply to it.
    pub fn start_tls(certs: &super::certs::TlsFiles, auth_clients: bool) -> Self {
        Self::launch_tls(certs, auth_clients, &[], false)
    }

    /// [`RedisServer::start_tls`] with extra arguments; `bus` reserves `port + 10000` too.
    fn launch_tls(
        certs: &super::certs::TlsFiles,
        auth_clients: bool,
        extra: &[&str],
        bus: bool,
    ) -> Self {
        let path = |p: &Path| p.to_string_lossy().to_string();
        Self::launch_with(Server::Redis, Listen::Tls, bus, |port| {
            let mut extra_args: Vec<String> = [
                "--tls-port",
                &port.to_string(),
                "--tls-cert-file",
                &path(&certs.server_cert),
                "--tls-key-file",
                &path(&certs.server_key),
                "--tls-ca-cert-file",
                &path(&certs.ca_cert),
                "--tls-auth-clients",
                if auth_clients { "yes" } else { "no" },
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            extra_args.extend(extra.iter().map(|s| s.to_string()));
            extra_args
        })
    }

    /// `rediss://127.0.0.1:PORT` of a server started with [`RedisServer::start_tls`].
    pub fn tls_url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.port)
    }

    /// `redis-cli --tls` against a server started with [`RedisServer::start_tls`], trusting its
    /// CA and presenting its own certificate (valid as a client certificate of the same CA).
    pub fn tls_cli(&self, args: &[&str]) -> String {
        self.try_tls_cli(&[], args).unwrap_or_else(|e| {
            panic!(
                "redis-cli --tls -p {} {args:?} failed: {e}\n{}",
                self.port,
                logs(self.dir())
            )
        })
    }

    /// [`RedisServer::tls_cli`] with extra redis-cli options (`-c`, `--cluster`...) before the
    /// connection arguments; a failing redis-cli is an `Err` with its output.
    fn try_tls_cli(&self, options: &[&str], args: &[&str]) -> Result<String, String> {
        let arg = |name: &str| {
            arg_value(&self.extra_args, name)
                .unwrap_or_else(|| panic!("not a TLS server: no {name}"))
        };
        let connection = tls_connection(self.port, &arg);
        let connection: Vec<&str> = options
            .iter()
            .copied()
            .chain(connection.iter().map(String::as_str))
            .collect();
        redis_cli(&connection, args)
    }
}

/// The value following `name` in redis-server arguments.
fn arg_value(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

/// `redis-cli` connection arguments for TLS on `port`, with the files named in the server's
/// arguments (looked up through `arg`).
fn tls_connection(port: u16, arg: &dyn Fn(&str) -> String) -> Vec<String> {
    vec![
        "--tls".into(),
        "--cacert".into(),
        arg("--tls-ca-cert-file"),
        "--cert".into(),
        arg("--tls-cert-file"),
        "--key".into(),
        arg("--tls-key-file"),
        "-h".into(),
        "127.0.0.1".into(),
        "-p".into(),
        port.to_string(),
    ]
}

impl RedisCluster {
    /// A three-master Redis Cluster that speaks TLS only, clients and cluster bus alike
    /// (`--tls-cluster yes`), with the certificates of `certs` (see
    /// [`RedisServer::start_tls`]). Use [`RedisCluster::tls_seeds`] and
    /// [`RedisCluster::tls_cli_cluster`]; the plaintext helpers do not apply.
    pub fn start_tls(certs: &super::certs::TlsFiles, auth_clients: bool) -> Self {
        let mut node_args = CLUSTER_NODE_ARGS.to_vec();
        node_args.extend(["--tls-cluster", "yes"]);
        Self::start_with(
            "Redis Cluster over TLS",
            || RedisServer::launch_tls(certs, auth_clients, &node_args, true),
            Self::form_tls,
        )
    }

    fn form_tls(&self) -> Result<(), String> {
        let deadline = Instant::now() + CLUSTER_DEADLINE;
        let args = self.create_args(0);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = self.nodes[0].try_tls_cli(&[], &args)?;
        if !out.contains("All 16384 slots covered") {
            return Err(format!("redis-cli --cluster create:\n{out}"));
        }
        loop {
            let states: Vec<String> = self
                .nodes
                .iter()
                .map(|n| n.try_tls_cli(&[], &["CLUSTER", "INFO"]).unwrap_or_default())
                .collect();
            if states.iter().all(|i| {
                i.contains("cluster_state:ok")
                    && i.contains(&format!("cluster_slots_assigned:{CLUSTER_SLOTS}"))
                    && i.contains("cluster_known_nodes:3")
            }) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("the cluster did not become ok:\n{states:#?}"));
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// `rediss://127.0.0.1:PORT` of every node of a cluster from [`RedisCluster::start_tls`].
    pub fn tls_seeds(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::tls_url).collect()
    }

    /// `redis-cli --tls -c` (follows redirects) through the first node.
    pub fn tls_cli_cluster(&self, args: &[&str]) -> String {
        self.nodes[0]
            .try_tls_cli(&["-c"], args)
            .unwrap_or_else(|e| panic!("redis-cli --tls -c {args:?} failed: {e}"))
    }
}

// ---------------------------------------------------------------------------------------------
// Cluster
// ---------------------------------------------------------------------------------------------

/// A real three-master Redis Cluster (no replicas): three `redis-server` processes, each on a
/// free port whose bus port (`+10000`) is free too, each in its own temporary directory.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three nodes, joins them with `redis-cli --cluster create`, and waits until every
    /// node reports `cluster_state:ok` with all 16384 slots assigned. Panics with the nodes'
    /// logs if the cluster cannot be formed.
    pub fn start() -> Self {
        Self::start_as(Server::Redis)
    }

    /// A three-master cluster of `server` nodes (see [`RedisCluster::start`]).
    pub fn start_as(server: Server) -> Self {
        let node_args: Vec<String> = CLUSTER_NODE_ARGS.iter().map(|s| s.to_string()).collect();
        Self::start_with(
            "Redis Cluster",
            || RedisServer::launch_as(server, node_args.clone(), true),
            |cluster| {
                cluster.form().map_err(|e| {
                    let logs: Vec<String> = cluster
                        .nodes
                        .iter()
                        .map(|n| format!("--- node on port {} ---\n{}", n.port, n.log()))
                        .collect();
                    format!("{e}\n{}", logs.join("\n"))
                })
            },
        )
    }

    /// Three masters and three replicas (one per master), failing over fast: a master that
    /// stops answering for 1 s is replaced by its replica. For failover tests. The other
    /// masters keep serving their slots meanwhile (`cluster-require-full-coverage no`: by
    /// default, once a master is marked failed, every node answers CLUSTERDOWN for every slot
    /// until its replica is promoted).
    pub fn start_replicated() -> Self {
        let mut node_args: Vec<String> = CLUSTER_NODE_ARGS.iter().map(|s| s.to_string()).collect();
        if let Some(t) = node_args.iter_mut().find(|a| *a == "5000") {
            *t = "1000".into();
        }
        node_args.extend(["--cluster-require-full-coverage".into(), "no".into()]);
        let mut failures = Vec::new();
        for attempt in 1..=CLUSTER_ATTEMPTS {
            let cluster = Self {
                nodes: (0..6)
                    .map(|_| RedisServer::launch_as(Server::Redis, node_args.clone(), true))
                    .collect(),
            };
            match cluster.form_with(1) {
                Ok(()) => return cluster,
                Err(e) => failures.push(format!("=== attempt {attempt} ===\n{e}")),
            }
        }
        panic!(
            "a replicated Redis Cluster could not be formed\n{}",
            failures.join("\n")
        );
    }

    /// The node serving `key`'s slot as master now.
    pub fn master_of(&self, key: &str) -> usize {
        // Any node that answers (a killed master does not).
        let slot: u16 = self
            .nodes
            .iter()
            .find_map(|n| n.try_cli(&["CLUSTER", "KEYSLOT", key]).ok())
            .and_then(|s| s.trim().parse().ok())
            .expect("a node answers CLUSTER KEYSLOT");
        let in_range = |r: &str| match r.split_once('-') {
            Some((a, b)) => {
                a.parse::<u16>().is_ok_and(|a| a <= slot)
                    && b.parse::<u16>().is_ok_and(|b| slot <= b)
            }
            None => r.parse::<u16>() == Ok(slot),
        };
        for (i, n) in self.nodes.iter().enumerate() {
            let Ok(nodes) = n.try_cli(&["CLUSTER", "NODES"]) else {
                continue;
            };
            // "<id> <addr> myself,master - ... <slot ranges>": this node, if it serves the slot.
            let serves = nodes.lines().any(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                f.get(2)
                    .is_some_and(|flags| flags.contains("myself") && flags.contains("master"))
                    && f.iter().skip(8).any(|r| in_range(r))
            });
            if serves {
                return i;
            }
        }
        panic!("no master serves slot {slot}");
    }

    /// Up to [`CLUSTER_ATTEMPTS`] times: three fresh nodes from `node`, joined by `form`.
    /// Panics with every attempt's error if none forms; `what` names the cluster there.
    fn start_with(
        what: &str,
        node: impl Fn() -> RedisServer,
        form: impl Fn(&Self) -> Result<(), String>,
    ) -> Self {
        let mut failures = Vec::new();
        for attempt in 1..=CLUSTER_ATTEMPTS {
            let cluster = Self {
                nodes: (0..3).map(|_| node()).collect(),
            };
            match form(&cluster) {
                Ok(()) => return cluster,
                Err(e) => failures.push(format!("=== attempt {attempt} ===\n{e}")),
            }
        }
        panic!("{what} could not be formed\n{}", failures.join("\n"));
    }

    /// `redis-cli --cluster create` arguments joining the nodes, `replicas` per master.
    fn create_args(&self, replicas: u32) -> Vec<String> {
        let mut args = vec!["--cluster".to_string(), "create".to_string()];
        args.extend(self.ports().iter().map(|p| format!("127.0.0.1:{p}")));
        args.extend(["--cluster-replicas".to_string(), replicas.to_string()]);
        args.push("--cluster-yes".to_string());
        args
    }

    fn form(&self) -> Result<(), String> {
        self.form_with(0)
    }

    fn form_with(&self, replicas: u32) -> Result<(), String> {
        let deadline = Instant::now() + CLUSTER_DEADLINE;
        let known = self.nodes.len().to_string();
        let args = self.create_args(replicas);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = run(Command::new("redis-cli").args(&args), deadline)
            .map_err(|e| format!("redis-cli {}: {e}", args.join(" ")))?;
        if !out.status.success() || !out.stdout.contains("All 16384 slots covered") {
            return Err(format!(
                "redis-cli {} exited with {}\nstdout:\n{}\nstderr:\n{}",
                args.join(" "),
                out.status,
                out.stdout,
                out.stderr
            ));
        }
        let mut last = String::new();
        loop {
            let mut all_ok = true;
            for port in self.ports() {
                match query::<String>(port, redis::cmd("CLUSTER").arg("INFO")) {
                    Ok(info) => {
                        let field = |name: &str| {
                            info.lines()
                                .find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':'))
                                .unwrap_or("")
                                .to_string()
                        };
                        if field("cluster_state") != "ok"
                            || field("cluster_slots_assigned") != CLUSTER_SLOTS
                            || field("cluster_slots_ok") != CLUSTER_SLOTS
                            || field("cluster_known_nodes") != known
                        {
                            all_ok = false;
                            last = format!("node {port}:\n{info}");
                        }
                    }
                    other => {
                        all_ok = false;
                        last = format!("node {port}: CLUSTER INFO answered {other:?}");
                    }
                }
            }
            if all_ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "cluster did not reach cluster_state:ok within {CLUSTER_DEADLINE:?}; last \
                     CLUSTER INFO:\n{last}"
                ));
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// `redis://127.0.0.1:PORT` of every node.
    pub fn seeds(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The client port of every node.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(RedisServer::port).collect()
    }

    /// One node, e.g. to `stop()`/`restart()` it through [`RedisCluster::node_mut`].
    pub fn node(&self, index: usize) -> &RedisServer {
        &self.nodes[index]
    }

    pub fn node_mut(&mut self, index: usize) -> &mut RedisServer {
        &mut self.nodes[index]
    }

    /// `redis-cli` against one node, without following redirects.
    pub fn cli(&self, node_index: usize, args: &[&str]) -> String {
        self.nodes[node_index].cli(args)
    }

    /// `redis-cli -c` (follows `MOVED`/`ASK`) entering through the first running node.
    pub fn cli_cluster(&self, args: &[&str]) -> String {
        self.try_cli_cluster(args)
            .unwrap_or_else(|e| panic!("redis-cli -c {args:?} failed: {e}"))
    }

    pub fn try_cli_cluster(&self, args: &[&str]) -> Result<String, String> {
        let port = self
            .nodes
            .iter()
            .map(RedisServer::port)
            .find(|p| ping(*p))
            .unwrap_or(self.nodes[0].port);
        redis_cli(&["-c", "-h", "127.0.0.1", "-p", &port.to_string()], args)
    }

    /// Every key on every node (each node scanned for the keys it owns) with its `TTL` (`-1`: no
    /// expiry), sorted by key.
    pub fn keys_with_ttl(&self) -> Vec<(String, i64)> {
        let mut keys: Vec<(String, i64)> = self
            .nodes
            .iter()
            .flat_map(RedisServer::keys_with_ttl)
            .collect();
        keys.sort();
        keys
    }
}

// Dropping `nodes` drops every RedisServer, each of which kills its process.

// ---------------------------------------------------------------------------------------------
// Ports
// ---------------------------------------------------------------------------------------------

/// Ports handed out in this process and not yet released (client and bus ports), so parallel
/// tests never pick the same one; other processes are excluded by test-binding.
static RESERVED: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// The range client ports are drawn from: when the kernel's ephemeral range allows, both the
/// port and its bus port lie below it, so outgoing connections (which take ephemeral ports)
/// never collide with a server, nor with a stopped server waiting to be restarted.
fn port_range() -> (u16, u16) {
    let ephemeral_low = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    if ephemeral_low >= 12_000 + BUS_OFFSET + 1_000 {
        (12_000, ephemeral_low - BUS_OFFSET - 1)
    } else {
        (20_000, 45_000)
    }
}

fn random() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    RandomState::new().hash_one(COUNTER.fetch_add(1, Ordering::Relaxed))
}

fn bindable(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// A port that is bindable now (and so is `port + 10000` if `bus`), reserved in this process.
pub(super) fn reserve_port(bus: bool) -> u16 {
    let (low, high) = port_range();
    let span = u64::from(high - low) + 1;
    let mut reserved = RESERVED.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..10_000 {
        let port = low + (random() % span) as u16;
        let bus_port = port + BUS_OFFSET;
        if reserved.contains(&port) || (bus && reserved.contains(&bus_port)) {
            continue;
        }
        if !bindable(port) || (bus && !bindable(bus_port)) {
            continue;
        }
        reserved.insert(port);
        if bus {
            reserved.insert(bus_port);
        }
        return port;
    }
    panic!("no free port found in {low}..={high}");
}

pub(super) fn release_port(port: u16, bus: bool) {
    let mut reserved = RESERVED.lock().unwrap_or_else(|e| e.into_inner());
    reserved.remove(&port);
    if bus {
        reserved.remove(&(port + BUS_OFFSET));
    }
}

// ---------------------------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------------------------

struct StartError {
    /// redis-server could not listen (another process took the port in the meantime).
    port_taken: bool,
    message: String,
}

fn log_path(dir: &Path) -> PathBuf {
    dir.join("redis.log")
}

fn stdout_path(dir: &Path) -> PathBuf {
    dir.join("stdout.log")
}

/// The tail of redis-server's log and of its stdout/stderr.
fn logs(dir: &Path) -> String {
    fn tail(path: &Path) -> String {
        let text = fs::read(path)
            .map(|b| String::from_utf8_lossy(&b).to_string())
            .unwrap_or_else(|e| format!("<{}: {e}>", path.display()));
        let cut = text.len().saturating_sub(16_000);
        let cut = (cut..=text.len())
            .find(|i| text.is_char_boundary(*i))
            .unwrap_or(0);
        text[cut..].to_string()
    }
    format!(
        "redis.log:\n{}\nstdout/stderr:\n{}",
        tail(&log_path(dir)),
        tail(&stdout_path(dir))
    )
}

fn clear_dir(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// How a server listens, and so how [`spawn_ready`] asks it whether it is up and ours.
#[derive(Clone, Copy)]
enum Listen {
    /// Plaintext on the port: `PING`, then `CONFIG GET dir`, through the RESP client.
    Plain,
    /// TLS only (`--port 0`; `--tls-port` and the certificate files are among the extra
    /// arguments): `CONFIG GET dir` through `redis-cli --tls` once something listens.
    Tls,
}

impl Listen {
    /// The value of `--port`: no plaintext port for a TLS server.
    fn port_arg(self, port: u16) -> String {
        match self {
            Listen::Plain => port.to_string(),
            Listen::Tls => "0".to_string(),
        }
    }

    /// What the port is called in messages.
    fn port_name(self) -> &'static str {
        match self {
            Listen::Plain => "port",
            Listen::Tls => "TLS port",
        }
    }

    fn dir_prefix(self) -> &'static str {
        match self {
            Listen::Plain => "sluice-redis-",
            Listen::Tls => "sluice-redis-tls-",
        }
    }

    fn not_started(self) -> &'static str {
        match self {
            Listen::Plain => {
                "redis-server could not be started (is it installed? apt-get install -y \
                 redis-server redis-tools)"
            }
            Listen::Tls => {
                "redis-server with TLS could not be started (is it built with TLS? Debian's is)"
            }
        }
    }

    /// What the server is waited for to answer, in messages.
    fn awaited(self) -> &'static str {
        match self {
            Listen::Plain => "answer PING",
            Listen::Tls => "answer",
        }
    }

    /// How often readiness is polled (a TLS poll spawns redis-cli).
    fn poll(self) -> Duration {
        match self {
            Listen::Plain => POLL,
            Listen::Tls => Duration::from_millis(50),
        }
    }

    /// The check of a server on `port` started with `extra`: the `dir` it serves, once it
    /// answers.
    fn served_dir(self, port: u16, extra: &[String]) -> Box<dyn Fn() -> Option<PathBuf>> {
        match self {
            Listen::Plain => Box::new(move || {
                if !ping(port) {
                    return None;
                }
                match query::<Vec<String>>(port, redis::cmd("CONFIG").arg("GET").arg("dir")) {
                    Ok(items) => items.get(1).map(PathBuf::from),
                    Err(_) => None,
                }
            }),
            Listen::Tls => {
                let arg = |name: &str| arg_value(extra, name).unwrap_or_default();
                let connection = tls_connection(port, &arg);
                Box::new(move || {
                    // Only once something listens, so the loop does not spawn redis-cli in vain.
                    TcpStream::connect(("127.0.0.1", port)).ok()?;
                    let connection: Vec<&str> = connection.iter().map(String::as_str).collect();
                    let out = redis_cli(&connection, &["CONFIG", "GET", "dir"]).ok()?;
                    out.lines().nth(1).map(PathBuf::from)
                })
            }
        }
    }
}

/// Spawns redis-server (under the watchdog), listening as `listen`, and waits until it answers
/// and is really ours (its `dir` is ours: not some other server that holds the port).
fn spawn_ready(
    server: Server,
    listen: Listen,
    port: u16,
    dir: &Path,
    extra: &[String],
) -> Result<Child, StartError> {
    let fatal = |message: String| StartError {
        port_taken: false,
        message,
    };
    let out = OpenOptions::new()
        .create(true)
        .append(true)
        .open(stdout_path(dir))
        .map_err(|e| fatal(format!("open {}: {e}", stdout_path(dir).display())))?;
    let err = out
        .try_clone()
        .map_err(|e| fatal(format!("clone log handle: {e}")))?;
    let dir_arg = dir.to_string_lossy().to_string();
    let log_arg = log_path(dir).to_string_lossy().to_string();
    let port_arg = listen.port_arg(port);
    let watchdog = WATCHDOG.replace("redis-server \"$@\"", &format!("'{}' \"$@\"", server.bin()));
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(watchdog)
        .arg("sh")
        .args([
            "--port",
            &port_arg,
            "--bind",
            "127.0.0.1",
            "--dir",
            &dir_arg,
            "--logfile",
            &log_arg,
            "--daemonize",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(extra)
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|e| fatal(format!("cannot spawn sh (for {}): {e}", server.bin())))?;

    let served_dir = listen.served_dir(port, extra);
    let our_dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let deadline = Instant::now() + START_DEADLINE;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let log = logs(dir);
                return Err(StartError {
                    port_taken: log.contains("Address already in use")
                        || log.contains("Could not create server TCP listening socket"),
                    message: format!(
                        "redis-server exited with {status} before it was ready\n{log}"
                    ),
                });
            }
            Ok(None) => {}
            Err(e) => {
                stop_child(&mut child);
                return Err(fatal(format!("waiting for redis-server: {e}")));
            }
        }
        if let Some(served) = served_dir() {
            if served == our_dir || served == dir {
                return Ok(child);
            }
        }
        if Instant::now() > deadline {
            stop_child(&mut child);
            return Err(fatal(format!(
                "redis-server on {} {port} did not {} within {START_DEADLINE:?}\n{}",
                listen.port_name(),
                listen.awaited(),
                logs(dir)
            )));
        }
        thread::sleep(listen.poll());
    }
}

/// Closes the watchdog's stdin (it SIGKILLs redis-server and exits with it) and reaps it.
pub(super) fn stop_child(child: &mut Child) {
    drop(child.stdin.take());
    let deadline = Instant::now() + STOP_DEADLINE;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return,
            Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
        }
    }
}

struct Output {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

/// Runs a command to completion with stdout/stderr in anonymous temp files (no pipe can fill
/// up), killing it at the deadline.
fn run(cmd: &mut Command, deadline: Instant) -> io::Result<Output> {
    let mut stdout = tempfile::tempfile()?;
    let mut stderr = tempfile::tempfile()?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(stdout.try_clone()?)
        .stderr(stderr.try_clone()?)
        .spawn()?;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "did not finish before its deadline; killed",
            ));
        }
        thread::sleep(Duration::from_millis(10));
    };
    let read = |f: &mut File| -> io::Result<String> {
        let mut bytes = Vec::new();
        f.seek(SeekFrom::Start(0))?;
        f.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).to_string())
    };
    Ok(Output {
        status,
        stdout: read(&mut stdout)?,
        stderr: read(&mut stderr)?,
    })
}

/// `redis-cli` with `connection` then `args`. A connection the server resets or closes mid-call
/// (a master turning replica closes its clients) is tried again, up to three times.
pub(super) fn redis_cli(connection: &[&str], args: &[&str]) -> Result<String, String> {
    let mut last = String::new();
    for _ in 0..3 {
        match redis_cli_once(connection, args) {
            Err(e) if e.contains("reset by peer") || e.contains("closed the connection") => {
                last = e
            }
            other => return other,
        }
    }
    Err(last)
}

fn redis_cli_once(connection: &[&str], args: &[&str]) -> Result<String, String> {
    let out = run(
        Command::new("redis-cli").args(connection).args(args),
        Instant::now() + CLI_DEADLINE,
    )
    .map_err(|e| format!("redis-cli: {e}"))?;
    if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(format!(
            "redis-cli exited with {}: {}{}",
            out.status, out.stderr, out.stdout
        ))
    }
}

// ---------------------------------------------------------------------------------------------
// Queries through the `redis` crate (readiness checks and key scans, without spawning redis-cli)
// ---------------------------------------------------------------------------------------------

/// A connection to the plaintext server on `port`, bounded so a broken setup cannot hang.
fn connect(port: u16) -> redis::RedisResult<redis::Connection> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
    let conn = client.get_connection_with_timeout(Duration::from_secs(10))?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    conn.set_write_timeout(Some(Duration::from_secs(10)))?;
    Ok(conn)
}

/// One command on a fresh connection.
fn query<T: redis::FromRedisValue>(port: u16, cmd: &redis::Cmd) -> redis::RedisResult<T> {
    cmd.query(&mut connect(port)?)
}

pub(super) fn ping(port: u16) -> bool {
    matches!(query::<String>(port, &redis::cmd("PING")), Ok(s) if s == "PONG")
}

/// `SCAN` the whole keyspace of one node, then `TTL` every key, on one connection.
fn keys_with_ttl(port: u16) -> redis::RedisResult<Vec<(String, i64)>> {
    let mut conn = connect(port)?;
    let mut keys: Vec<String> = redis::cmd("SCAN")
        .cursor_arg(0)
        .arg("COUNT")
        .arg(1000)
        .clone()
        .iter::<String>(&mut conn)?
        .collect::<Result<_, _>>()?;
    keys.sort();
    keys.dedup(); // SCAN may return a key more than once
    let mut out = Vec::with_capacity(keys.len());
    for key in keys {
        match redis::cmd("TTL").arg(&key).query::<i64>(&mut conn)? {
            // -2: expired or deleted between SCAN and TTL; it is not there any more.
            -2 => {}
            ttl => out.push((key, ttl)),
        }
    }
    Ok(out)
}

/// [`RedisServer::start_with_args`] from async code: the start blocks (it waits for the server
/// to answer), so it runs on a blocking thread.
pub async fn start_redis(args: &'static [&'static str]) -> RedisServer {
    tokio::task::spawn_blocking(move || RedisServer::start_with_args(args))
        .await
        .expect("start redis")
}

/// A standalone Valkey server from async code, on a blocking thread.
pub async fn start_valkey() -> RedisServer {
    tokio::task::spawn_blocking(RedisServer::start_valkey)
        .await
        .expect("start valkey")
}

/// A three-master Valkey cluster from async code, on a blocking thread.
pub async fn start_valkey_cluster() -> RedisCluster {
    tokio::task::spawn_blocking(|| RedisCluster::start_as(Server::Valkey))
        .await
        .expect("start valkey cluster")
}

/// [`RedisCluster::start`] from async code, on a blocking thread.
pub async fn start_cluster() -> RedisCluster {
    tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .expect("start cluster")
}

/// A running `redis-cli MONITOR` (see [`RedisServer::monitor`]).
pub struct Monitor {
    child: Child,
    path: PathBuf,
    port: u16,
}

impl Monitor {
    fn wait_for(&self, text: &str) {
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until {
            if fs::read_to_string(&self.path).is_ok_and(|t| t.contains(text)) {
                return;
            }
            thread::sleep(Duration::from_millis(10));
        }
        panic!("MONITOR on port {} never showed {text:?}", self.port);
    }

    /// Every command monitored so far (a marker sent last, and seen, flushes the rest).
    pub fn stop(mut self) -> String {
        let marker = format!("monitor-end-{}", self.port);
        redis_cli(
            &["-h", "127.0.0.1", "-p", &self.port.to_string()],
            &["ECHO", &marker],
        )
        .expect("ECHO");
        self.wait_for(&marker);
        let _ = self.child.kill();
        let _ = self.child.wait();
        fs::read_to_string(&self.path).unwrap_or_default()
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
