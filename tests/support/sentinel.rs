//! A real Redis Sentinel deployment for the tests: a master, one replica and three
//! `redis-sentinel` processes (Debian's `redis-sentinel`; quorum 2) monitoring it as `mymaster`,
//! each on a free port, under the same watchdog as every test server, so nothing outlives the
//! test.
#![allow(dead_code)]

use super::redis::{
    ping, redis_cli, release_port, reserve_port, stop_child, RedisServer, WATCHDOG,
};
use std::fs::{self, File};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};
use tempfile::TempDir;

pub const MASTER_NAME: &str = "mymaster";
/// Bound on the deployment settling and on a failover; only there so a broken setup cannot hang.
const DEADLINE: Duration = Duration::from_secs(90);
const POLL: Duration = Duration::from_millis(100);

pub struct SentinelSetup {
    pub master: RedisServer,
    pub replica: RedisServer,
    sentinels: Vec<Sentinel>,
    /// The sentinels' `requirepass` (and the password they use with each other).
    password: Option<String>,
}

struct Sentinel {
    port: u16,
    child: Child,
    dir: TempDir,
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        stop_child(&mut self.child);
        release_port(self.port, false);
    }
}

impl SentinelSetup {
    /// Starts everything and waits until every sentinel knows the replica and the two other
    /// sentinels (what a failover needs). A master declared down after 1 s of silence.
    pub fn start() -> Self {
        Self::start_with_password(None)
    }

    /// Like [`SentinelSetup::start`], the sentinels requiring `password` (`requirepass`).
    pub fn start_with_password(password: Option<&str>) -> Self {
        let master = RedisServer::start();
        let replica =
            RedisServer::start_with_args(&["--replicaof", "127.0.0.1", &master.port().to_string()]);
        let sentinels = (0..3)
            .map(|_| Sentinel::start(master.port(), password))
            .collect();
        let setup = Self {
            master,
            replica,
            sentinels,
            password: password.map(str::to_string),
        };
        setup.wait_until("every sentinel sees the replica and its peers", |s| {
            s.sentinels.iter().all(|x| {
                let cli = |args: &[&str]| s.sentinel_cli(x.port, args).unwrap_or_default();
                let replicas = cli(&["SENTINEL", "replicas", MASTER_NAME]);
                let peers = cli(&["SENTINEL", "sentinels", MASTER_NAME]);
                replicas.contains("slave") && peers.matches("runid").count() == 2
            })
        });
        setup
    }

    /// `host:port` of each sentinel, for `REDIS_URL=mymaster,<these>`.
    pub fn addresses(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect()
    }

    /// `redis://` URLs of the sentinels, as the store's settings take them.
    pub fn urls(&self) -> Vec<String> {
        self.addresses()
            .into_iter()
            .map(|a| format!("redis://{a}"))
            .collect()
    }

    /// The port the first sentinel names as master now.
    pub fn master_port(&self) -> Option<u16> {
        let out = self
            .sentinel_cli(
                self.sentinels[0].port,
                &["SENTINEL", "get-master-addr-by-name", MASTER_NAME],
            )
            .ok()?;
        out.lines().nth(1)?.trim().parse().ok()
    }

    /// Waits until the replica has every write the master acknowledged, so a failover loses
    /// nothing the test counts on.
    pub fn wait_replicated(&self) {
        self.wait_until("the replica caught up with the master", |s| {
            let offset = |text: String, field: &str| {
                text.lines()
                    .find_map(|l| l.strip_prefix(field))
                    .and_then(|v| v.trim().parse::<u64>().ok())
            };
            let master = offset(
                s.master.cli(&["INFO", "replication"]),
                "master_repl_offset:",
            );
            let replica = offset(
                s.replica.cli(&["INFO", "replication"]),
                "slave_repl_offset:",
            );
            master.is_some() && master == replica
        });
    }

    /// Kills the master (SIGKILL) and waits until the sentinels have promoted the replica.
    pub fn kill_master_and_fail_over(&mut self) {
        self.master.stop();
        let replica = self.replica.port();
        self.wait_until("the sentinels promoted the replica", |s| {
            s.master_port() == Some(replica)
                && s.replica.cli(&["ROLE"]).lines().next() == Some("master")
        });
    }

    /// `SENTINEL FAILOVER`: the replica is promoted while the old master keeps running and is
    /// demoted to a replica of it. Waits until both took their new roles.
    pub fn force_failover(&self) {
        let first = self.sentinels[0].port;
        self.sentinel_cli(first, &["SENTINEL", "FAILOVER", MASTER_NAME])
            .expect("SENTINEL FAILOVER");
        let replica = self.replica.port();
        self.wait_until("the replica promoted and the master demoted", |s| {
            s.master_port() == Some(replica)
                && s.replica.cli(&["ROLE"]).lines().next() == Some("master")
                && s.master.cli(&["ROLE"]).lines().next() == Some("slave")
        });
    }

    fn sentinel_cli(&self, port: u16, args: &[&str]) -> Result<String, String> {
        let port = port.to_string();
        let mut connection = vec!["-h", "127.0.0.1", "-p", &port];
        if let Some(p) = &self.password {
            connection.extend(["--no-auth-warning", "-a", p]);
        }
        redis_cli(&connection, args)
    }

    fn wait_until(&self, what: &str, done: impl Fn(&Self) -> bool) {
        super::poll_until_blocking(what, || if done(self) { Ok(()) } else { Err("no") })
    }
}

impl Sentinel {
    fn start(master_port: u16, password: Option<&str>) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("sluice-sentinel-")
            .tempdir()
            .expect("temporary directory for a sentinel");
        let port = reserve_port(false);
        let conf = dir.path().join("sentinel.conf");
        fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\nlogfile {dir}/sentinel.log\n\
                 sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2\n\
                 sentinel down-after-milliseconds {MASTER_NAME} 1000\n\
                 sentinel failover-timeout {MASTER_NAME} 10000\n\
                 sentinel parallel-syncs {MASTER_NAME} 1\n",
                dir = dir.path().display()
            ) + &password
                .map(|p| format!("requirepass {p}\nsentinel sentinel-pass {p}\n"))
                .unwrap_or_default(),
        )
        .expect("write sentinel.conf");
        let out = File::create(dir.path().join("stdout.log")).expect("sentinel stdout");
        let err = out.try_clone().expect("sentinel stderr");
        let watchdog = WATCHDOG.replace("redis-server \"$@\"", "redis-sentinel \"$@\"");
        assert_ne!(watchdog, WATCHDOG, "the watchdog runs redis-server");
        let child = Command::new("sh")
            .arg("-c")
            .arg(watchdog)
            .arg("sh")
            .arg(&conf)
            .current_dir(dir.path())
            .stdin(Stdio::piped())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("spawn redis-sentinel");
        let mut sentinel = Self { port, child, dir };
        let deadline = Instant::now() + DEADLINE;
        // Up once it listens: a PING is answered (or refused for want of the password).
        while !ping(port) && std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = sentinel.child.try_wait() {
                panic!(
                    "redis-sentinel exited with {status} (is it installed? apt-get install -y \
                     redis-sentinel)\n{}",
                    fs::read_to_string(sentinel.dir.path().join("sentinel.log"))
                        .unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "sentinel on {port} did not start"
            );
            thread::sleep(POLL);
        }
        sentinel
    }
}
