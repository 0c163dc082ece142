//! `FAILURE_MODE=local` through a real Envoy 1.40 (`failure_mode_deny: true`, Envoy's default
//! 20 ms timeout) in front of two real sluice processes sharing a real Redis: the store frozen,
//! killed and restarted empty, slower than the deadline, flapping. Each scenario runs one
//! minute window (aligned to the limit's boundary) of the load: a key at 600/min offered
//! 12/s for the whole window, and a key first seen during the outage (100/min) offered 12/s
//! during it and 2/s after. The scenarios run in one test, two side by side per window. The
//! domain counts all or nothing, so a store's counter ends equal to what was admitted.
//!
//! Nothing is timed: Envoy's own 20 ms deadline does the timing (a late answer is a 500 and
//! `ratelimit.error`), and the assertions are counts against the bound in docs/operations.md.

use crate::support::binary::{self, SluiceProcess};
use crate::support::envoy::{self, Backend, EnvoyProcess};
use crate::support::proxy::RedisProxy;
use crate::support::redis::{start_redis, RedisCluster, RedisServer};
use crate::support::sentinel::SentinelSetup;
use crate::support::*;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const RULES: &str = "\
domain: edge
counting: all_or_nothing
descriptors:
  - key: tenant
    descriptors:
      - key: path
        value: /api/hot
        rate_limit: {unit: minute, requests_per_unit: 600}
      - key: path
        value: /api/fresh
        rate_limit: {unit: minute, requests_per_unit: 100}
      - key: path
        value: /api/warm
        rate_limit: {unit: minute, requests_per_unit: 100000}
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 5}
";

/// When the outage starts and ends, seconds into the window.
const OUTAGE: (u64, u64) = (20, 40);
/// The load runs from 1 s to 58 s into the window, so no request falls in the next one.
const LOAD: (u64, u64) = (1, 58);

/// The shipped Envoy example with the two knobs the issue names: `failure_mode_deny: true` and
/// Envoy's default rate-limit timeout (20 ms: the file's `timeout: 1s` line removed).
fn envoy_yaml() -> String {
    let shipped = std::fs::read_to_string(envoy::example("envoy.yaml")).expect("envoy.yaml");
    let yaml = shipped
        .replace("failure_mode_deny: false", "failure_mode_deny: true")
        .replace("                      timeout: 1s\n", "");
    assert_ne!(yaml, shipped);
    assert!(!yaml.contains("timeout: 1s\n                      # x-ratelimit"));
    yaml
}

/// Two replicas on `redis_url` (FAILURE_MODE=local) behind one Envoy.
struct Rig {
    a: SluiceProcess,
    b: SluiceProcess,
    envoy: EnvoyProcess,
    /// Envoy's `ratelimit.error` after the warm-up (a cold call may have counted there).
    errors_before: u64,
    /// Sluice's own account of its answers after the warm-up ([`sluice_answers`]): a cold call
    /// may have been late, and the window judges its own answers only.
    answers_before: (f64, f64, f64),
    _backend: Backend,
    _rules: tempfile::TempDir,
}

impl Rig {
    /// Rate-limit calls Envoy counted as errors since the warm-up.
    async fn errors(&self) -> u64 {
        self.envoy.stat("cluster.backend.ratelimit.error").await - self.errors_before
    }
}

async fn rig(redis_url: &str) -> Rig {
    rig_on(&[("REDIS_URL", redis_url)]).await
}

/// Two replicas with `store` settings (`REDIS_URL`, `REDIS_TYPE`) behind one Envoy.
async fn rig_on(store: &[(&str, &str)]) -> Rig {
    let rules = tempfile::tempdir().expect("tempdir");
    std::fs::write(rules.path().join("edge.yaml"), RULES).expect("write rules");
    let replica = || {
        let mut cmd = binary::serve(rules.path());
        cmd.env("FAILURE_MODE", "local").env("LOCAL_REPLICAS", "2");
        for (k, v) in store {
            cmd.env(k, v);
        }
        SluiceProcess::spawn(cmd)
    };
    let a = replica().await;
    let b = replica().await;
    let backend = Backend::start().await;
    let yaml = envoy_yaml()
        .replace("port_value: 9901 ", "port_value: 0 ")
        .replace("port_value: 10000 ", "port_value: 0 ")
        .replace(
            "port_value: 10001 ",
            &format!("port_value: {} ", backend.port),
        )
        .replace(
            "port_value: 8081 ",
            &format!("port_value: {} ", a.grpc.port()),
        )
        .replace(
            "port_value: 8082 ",
            &format!("port_value: {} ", b.grpc.port()),
        );
    let envoy = EnvoyProcess::start_yaml(&yaml).await;
    eventually("Envoy sees both replicas healthy", || async {
        envoy.healthy_hosts("sluice").await == 2
    })
    .await;
    // Each replica counts the other through the heartbeats before the window starts.
    for s in [&a, &b] {
        eventually("both replicas heartbeat", || async {
            metric(s, "sluice_local_replicas").await == Some(2.0)
        })
        .await;
    }
    // Warm before the window: Envoy's rate-limit client and both replicas have served a call
    // and loaded the script (a process's first call, on the debug build, costs milliseconds the
    // window's first requests, sent by four rigs at once, must not pay against 20 ms).
    // Until six calls in a row are answered in time (a cold call may not be: that is what
    // warming is for) and each of Envoy's two workers has its connection to each replica (a
    // worker opens its own on its first call there: a window's first request must not pay
    // for a TCP and HTTP/2 handshake against 20 ms; the health checker holds one per replica
    // besides: 6 in all), at most 200 calls.
    let mut in_a_row = 0;
    for _ in 0..200 {
        let (status, _) = envoy.get("/api/warm", &[("x-tenant", "warmup")]).await;
        in_a_row = if status == 200 { in_a_row + 1 } else { 0 };
        if in_a_row >= 6 && envoy.stat("cluster.sluice.upstream_cx_active").await >= 6 {
            break;
        }
    }
    assert!(
        in_a_row >= 6,
        "warm-up calls through Envoy answered in time"
    );
    let errors_before = envoy.stat("cluster.backend.ratelimit.error").await;
    let answers_before = sluice_answers_of(&a, &b).await;
    Rig {
        a,
        b,
        envoy,
        errors_before,
        answers_before,
        _backend: backend,
        _rules: rules,
    }
}

/// One value of sluice's `/metrics` (the first series of `name`).
async fn metric(s: &SluiceProcess, name: &str) -> Option<f64> {
    let (_, _, body) = http_request(s.http, "GET", "/metrics", &[], "").await;
    body.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// One request's answer: seconds into the window when sent, status, `x-ratelimit-remaining`.
type Answer = (f64, u16, Option<u32>);

/// What one scenario's requests got.
#[derive(Debug, Default)]
struct Answers {
    hot: Vec<Answer>,
    fresh: Vec<Answer>,
    /// Seconds into the window when the outage's fault was in place (a SIGKILLed Redis gone):
    /// a request sent from then on (its `t` at or after it: `offer` sends none early) cannot
    /// have reached the store the fault took down.
    fault_at: f64,
}

impl Answers {
    fn admitted(list: &[Answer], from: f64) -> usize {
        list.iter()
            .filter(|(t, s, _)| *t >= from && *s == 200)
            .count()
    }

    fn status_count(&self, status: u16) -> usize {
        self.hot
            .iter()
            .chain(&self.fresh)
            .filter(|(_, s, _)| *s == status)
            .count()
    }
}

fn unix() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
}

/// Sleeps until `secs` into the window that starts at `start` (Unix time).
async fn at(start: Duration, secs: f64) {
    let when = start + Duration::from_secs_f64(secs);
    let now = unix();
    if when > now {
        tokio::time::sleep(when - now).await;
    }
}

/// Offers `rate` requests a second on `path` from `from` to `to` seconds into the window, each
/// on its own task (a slow answer never delays the next), and records every answer.
async fn offer(
    front: std::net::SocketAddr,
    start: Duration,
    path: &'static str,
    plan: &[(u64, u64, u32)],
    out: Arc<Mutex<Vec<Answer>>>,
) {
    offer_as(front, start, "acme", path, plan, out).await;
}

/// [`offer`] for `tenant`.
async fn offer_as(
    front: std::net::SocketAddr,
    start: Duration,
    tenant: &str,
    path: &'static str,
    plan: &[(u64, u64, u32)],
    out: Arc<Mutex<Vec<Answer>>>,
) {
    let mut tasks = Vec::new();
    for &(from, to, rate) in plan {
        let n = (to - from) * u64::from(rate);
        for i in 0..n {
            let t = from as f64 + i as f64 / f64::from(rate);
            at(start, t).await;
            let out = Arc::clone(&out);
            let tenant = tenant.to_string();
            tasks.push(tokio::spawn(async move {
                let (status, head, _) =
                    http_request(front, "GET", path, &[("x-tenant", &tenant)], "").await;
                let remaining = head.lines().find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.trim()
                        .eq_ignore_ascii_case("x-ratelimit-remaining")
                        .then(|| v.trim().parse().ok())?
                });
                out.lock().expect("answers").push((t, status, remaining));
            }));
        }
    }
    for t in tasks {
        t.await.expect("request task");
    }
}

/// The fault a scenario injects at the outage's start and lifts at its end.
enum Fault {
    /// SIGSTOP, then SIGCONT: a hung Redis, every connection open.
    Freeze,
    /// SIGKILL, then a restart on the same port, empty.
    KillRestart,
    /// A proxy holds every script call, then lets them through: a store slower than every
    /// deadline that still executes what it was sent.
    Hold(Arc<RedisProxy>),
    /// SIGSTOP / SIGCONT every second.
    Flap,
    /// Injected by the caller (a failover).
    None,
}

/// Runs the window's load through `rig` with `fault` during the outage.
async fn window(
    rig: &Rig,
    redis: Option<Arc<Mutex<RedisServer>>>,
    fault: Fault,
    start: Duration,
) -> Answers {
    let server = || redis.as_ref().expect("a server to fault");
    let hot = Arc::new(Mutex::new(Vec::new()));
    let fresh = Arc::new(Mutex::new(Vec::new()));
    let front = rig.envoy.front;
    let load = async {
        tokio::join!(
            offer(
                front,
                start,
                "/api/hot",
                &[(LOAD.0, LOAD.1, 12)],
                Arc::clone(&hot)
            ),
            offer(
                front,
                start,
                "/api/fresh",
                &[(OUTAGE.0, OUTAGE.1, 12), (OUTAGE.1, LOAD.1, 2)],
                Arc::clone(&fresh)
            ),
        )
    };
    let faults = async {
        at(start, OUTAGE.0 as f64).await;
        match &fault {
            Fault::Freeze => lock(server()).signal("STOP"),
            Fault::KillRestart => lock(server()).stop(),
            Fault::Hold(p) => p.hold(),
            Fault::Flap => {
                for s in OUTAGE.0..OUTAGE.1 {
                    at(start, s as f64).await;
                    lock(server()).signal(if (s - OUTAGE.0) % 2 == 0 {
                        "STOP"
                    } else {
                        "CONT"
                    });
                }
            }
            Fault::None => {}
        }
        let fault_at = (unix() - start).as_secs_f64();
        at(start, OUTAGE.1 as f64).await;
        match &fault {
            Fault::Freeze | Fault::Flap => lock(server()).signal("CONT"),
            Fault::None => {}
            Fault::KillRestart => {
                let r = Arc::clone(server());
                tokio::task::spawn_blocking(move || lock(&r).restart())
                    .await
                    .expect("restart");
            }
            Fault::Hold(p) => p.release(),
        }
        fault_at
    };
    let (_, fault_at) = tokio::join!(load, faults);
    let hot = std::mem::take(&mut *lock(&hot));
    let fresh = std::mem::take(&mut *lock(&fresh));
    Answers {
        hot,
        fresh,
        fault_at,
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The count Redis holds for the fixed-window counter of `path` (the window's key).
fn redis_count(redis: &RedisServer, path: &str) -> u64 {
    let keys = redis.cli(&["--scan", "--pattern", &format!("*{path}*")]);
    keys.lines()
        .filter(|k| !k.is_empty() && !k.contains("#wb:"))
        .map(|k| redis.cli(&["GET", k]).trim().parse::<u64>().unwrap_or(0))
        .sum()
}

/// Waits until both replicas owe the store nothing (every local decision written back, every
/// late store call reconciled).
async fn settled(rig: &Rig) {
    for s in [&rig.a, &rig.b] {
        eventually("every local decision written back", || async {
            metric(s, "sluice_local_owed").await == Some(0.0)
                && metric(s, "sluice_deciding_locally").await == Some(0.0)
        })
        .await;
    }
}

async fn local_decisions(rig: &Rig) -> f64 {
    let mut n = 0.0;
    for s in [&rig.a, &rig.b] {
        let (_, _, body) = http_request(s.http, "GET", "/metrics", &[], "").await;
        n += body
            .lines()
            .filter(|l| l.starts_with("sluice_local_decisions_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    n
}

/// When answers were 500s: when they were sent, whether Envoy timed the call out or sluice
/// answered an error, and what the replicas logged (what a failure needs to be understood).
async fn report_late(name: &str, rig: &Rig, a: &Answers) {
    let late: Vec<f64> = a
        .hot
        .iter()
        .chain(&a.fresh)
        .filter(|(_, s, _)| *s == 500)
        .map(|(t, _, _)| *t)
        .collect();
    if late.is_empty() {
        return;
    }
    eprintln!("{name}: 500s sent at {late:?} s into the window");
    let (_, stats) = http(rig.envoy.admin, "GET", "/stats", "").await;
    for l in stats.lines().filter(|l| {
        l.starts_with("cluster.sluice.")
            && (l.contains("timeout") || l.contains(".grpc.") || l.contains("rq_error"))
    }) {
        eprintln!("{name}: envoy {l}");
    }
    for (replica, s) in [("a", &rig.a), ("b", &rig.b)] {
        eprintln!("{name}: replica {replica} logged:\n{}", s.log());
    }
}

/// Sluice's own account of its answers on both replicas (its request histogram, timed from the
/// request to the answer inside sluice): how many, how many within Envoy's 20 ms deadline, and
/// how many were errors (UNAVAILABLE).
async fn sluice_answers(rig: &Rig) -> (f64, f64, f64) {
    let (all, in_time, errors) = sluice_answers_of(&rig.a, &rig.b).await;
    let (all0, in_time0, errors0) = rig.answers_before;
    (all - all0, in_time - in_time0, errors - errors0)
}

/// [`sluice_answers`] since each process started.
async fn sluice_answers_of(a: &SluiceProcess, b: &SluiceProcess) -> (f64, f64, f64) {
    let (mut all, mut in_time, mut errors) = (0.0, 0.0, 0.0);
    for s in [a, b] {
        let (_, _, body) = http_request(s.http, "GET", "/metrics", &[], "").await;
        let value = |l: &str| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        for l in body.lines() {
            if l.starts_with("sluice_request_duration_seconds_count{") {
                all += value(l).unwrap_or(0.0);
                if l.contains("outcome=\"unavailable\"") {
                    errors += value(l).unwrap_or(0.0);
                }
            } else if l.starts_with("sluice_request_duration_seconds_bucket{")
                && l.contains("le=\"0.02\"")
            {
                in_time += value(l).unwrap_or(0.0);
            }
        }
    }
    (all, in_time, errors)
}

/// What sluice controls behind Envoy's 20 ms deadline (the optimized binary, `SLUICE_BIN`):
/// every answer sluice gave since the warm-up, timed by sluice from request to answer, within
/// the deadline but for the rare one a stalled machine made late, and none an error. Envoy's
/// own 500s (its timer, two busy cores) are reported, not asserted: whether Envoy's event loop
/// got the answer in time is the machine's, not sluice's.
async fn assert_answered_in_time(name: &str, rig: &Rig, a: &Answers) {
    report_late(name, rig, a).await;
    let (all, in_time, errors) = sluice_answers(rig).await;
    eprintln!(
        "{name}: sluice answered {all}, {in_time} within 20 ms; Envoy 500s {}, ratelimit.error {}",
        a.status_count(500),
        rig.errors().await
    );
    let offered = a.hot.len() + a.fresh.len();
    let envoy_500s = a.status_count(500);
    assert!(
        all >= (offered - envoy_500s) as f64,
        "{name}: sluice answered {all} of the requests"
    );
    // Sluice decides locally 10 ms (LOCAL_DEADLINE_MARGIN) before Envoy's 20 ms: an answer
    // past 20 ms means its process was not run for those 10 ms. Seen once on a CI machine: at
    // one instant three replicas of two rigs all found their store calls past the margin, and
    // one answer of the 960 was late (the machine, not sluice). Late ones stay rare: at most
    // 1 % of what sluice answered (at least 2). Anything systematic (a decision that waits on
    // the store past the margin) is late on every request of an outage, hundreds. Envoy's
    // rate-limit errors are reported, not a bound: a late answer is not always one Envoy gave
    // up on, since Envoy's timer runs on the same starved cores (seen at `dbb2176` beside a
    // loaded suite run: 1 of 960 past 20 ms by sluice's clock, `ratelimit.error` 0).
    let late = all - in_time;
    let envoy_errors = rig.errors().await;
    assert!(
        late <= (all / 100.0).max(2.0),
        "{name}: sluice's answers past 20 ms: {late} of {all}; Envoy's rate-limit errors \
         {envoy_errors} (500s {envoy_500s} of the window's {offered})"
    );
    assert_eq!(errors, 0.0, "{name}: sluice answered UNAVAILABLE");
}

/// Every answer in time (what sluice controls), and the limits held within the bound.
async fn assert_within_bound(name: &str, rig: &Rig, a: &Answers) {
    eprintln!(
        "{name}: hot {} of {}, fresh {} of {}, 500s {}, decided locally {}",
        Answers::admitted(&a.hot, 0.0),
        a.hot.len(),
        Answers::admitted(&a.fresh, 0.0),
        a.fresh.len(),
        a.status_count(500),
        local_decisions(rig).await
    );
    assert_answered_in_time(name, rig, a).await;
    assert_eq!(
        a.status_count(200) + a.status_count(429) + a.status_count(500),
        a.hot.len() + a.fresh.len()
    );
    let hot = Answers::admitted(&a.hot, 0.0);
    let fresh = Answers::admitted(&a.fresh, 0.0);
    assert!(
        (540..=660).contains(&hot),
        "{name}: the 600/min key admitted {hot} (offered {})",
        a.hot.len()
    );
    assert!(fresh <= 110, "{name}: the 100/min key admitted {fresh}");
    assert!(
        local_decisions(rig).await > 0.0,
        "{name}: nothing was decided locally"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outages_through_envoy_are_answered_in_time_within_the_bound_and_written_back() {
    let frozen = Arc::new(Mutex::new(start_redis(&[]).await));
    let killed = Arc::new(Mutex::new(start_redis(&[]).await));
    let slow = Arc::new(Mutex::new(start_redis(&[]).await));
    let flapping = Arc::new(Mutex::new(start_redis(&[]).await));
    let slow_port = lock(&slow).port();
    let proxy = Arc::new(RedisProxy::start(([127, 0, 0, 1], slow_port).into()).await);
    let urls = [
        lock(&frozen).url(),
        lock(&killed).url(),
        proxy.url(),
        lock(&flapping).url(),
    ];
    let (r1, r2, r3, r4) = tokio::join!(rig(&urls[0]), rig(&urls[1]), rig(&urls[2]), rig(&urls[3]));
    // Two scenarios side by side per window (the next whole minute: every request of a
    // scenario falls in one window), two windows in turn: four at once kept two cores so busy
    // that an answer decided locally in microseconds now and then reached Envoy after 20 ms.
    let next_minute = || Duration::from_secs((unix().as_secs() / 60 + 1) * 60);
    let start = next_minute();
    let (a1, a2) = tokio::join!(
        window(&r1, Some(Arc::clone(&frozen)), Fault::Freeze, start),
        window(&r2, Some(Arc::clone(&killed)), Fault::KillRestart, start),
    );
    assert!(
        unix() < start + Duration::from_secs(60),
        "the run left its window"
    );
    tokio::join!(settled(&r1), settled(&r2));

    // 1. Frozen 20 s: in time, within the bound.
    assert_within_bound("frozen", &r1, &a1).await;
    // After recovery, the counters hold what was admitted (nothing lost, nothing doubled).
    let hot1 = Answers::admitted(&a1.hot, 0.0) as u64;
    let fresh1 = Answers::admitted(&a1.fresh, 0.0) as u64;
    holds_admitted(
        redis_count(&lock(&frozen), "/api/hot"),
        hot1,
        &a1.hot,
        "frozen: hot counter",
    );
    holds_admitted(
        redis_count(&lock(&frozen), "/api/fresh"),
        fresh1,
        &a1.fresh,
        "frozen: fresh counter",
    );

    eprintln!(
        "killed: hot {} of {}, fresh {} of {}, 500s {}",
        Answers::admitted(&a2.hot, 0.0),
        a2.hot.len(),
        Answers::admitted(&a2.fresh, 0.0),
        a2.fresh.len(),
        a2.status_count(500)
    );
    // 2. Killed and restarted empty: in time; the empty Redis gets the outage's usage back
    // (the fresh key's whole usage; the hot key's from the kill on).
    assert_answered_in_time("killed", &r2, &a2).await;
    let fresh2 = Answers::admitted(&a2.fresh, 0.0) as u64;
    assert!(fresh2 <= 110, "killed: the fresh key admitted {fresh2}");
    // The fresh key's first request is sent as the kill is (OUTAGE.0): one sent before the
    // SIGKILLed Redis was gone may have been charged there, and went with it (seen: 101 counted
    // of 102 admitted beside a loaded suite run). Everything sent from then on is in the
    // restarted Redis, decided there or written back; nothing more than was admitted.
    let fresh_count = redis_count(&lock(&killed), "/api/fresh");
    let fresh_after_kill = Answers::admitted(&a2.fresh, a2.fault_at) as u64;
    let fresh_dropped = a2.fresh.iter().filter(|(_, s, _)| *s == 500).count() as u64;
    assert!(
        (fresh_after_kill..=fresh2 + fresh_dropped).contains(&fresh_count),
        "killed: fresh counter {fresh_count}, admitted {fresh2} ({fresh_after_kill} sent after \
         the kill, {:.3} s into the window), Envoy 500s {fresh_dropped}; the first answers \
         (t, status, remaining: 99 was decided on the Redis that died, a share's on a replica): \
         {:?}",
        a2.fault_at,
        &a2.fresh
            .iter()
            .filter(|a| a.0 < a2.fault_at + 0.5)
            .collect::<Vec<_>>()
    );
    let hot_after_kill = Answers::admitted(&a2.hot, OUTAGE.0 as f64 + 0.1) as u64;
    // The same for the hot key, should the kill itself take longer than that tenth of a second.
    let hot_surely_after = Answers::admitted(&a2.hot, a2.fault_at.max(OUTAGE.0 as f64 + 0.1));
    let hot2 = redis_count(&lock(&killed), "/api/hot");
    // As `holds_admitted`: a request Envoy timed out on its own clock (a 500 here, though
    // sluice answered it in time) may have been admitted by sluice, so it may be counted.
    let dropped = a2
        .hot
        .iter()
        .filter(|(t, s, _)| *t >= OUTAGE.0 as f64 + 0.1 && *s == 500)
        .count() as u64;
    assert!(
        (hot_surely_after as u64..=hot_after_kill + 2 + dropped).contains(&hot2),
        "killed: the restarted Redis holds {hot2} of the {hot_after_kill} admitted from the kill \
         on (Envoy 500s since: {dropped})"
    );

    // The second window: its counters are read right after it, before they expire.
    let start = next_minute();
    let (a3, a4) = tokio::join!(
        window(
            &r3,
            Some(Arc::clone(&slow)),
            Fault::Hold(Arc::clone(&proxy)),
            start
        ),
        window(&r4, Some(Arc::clone(&flapping)), Fault::Flap, start),
    );
    assert!(
        unix() < start + Duration::from_secs(60),
        "the run left its window"
    );
    tokio::join!(settled(&r3), settled(&r4));

    // 3. Slower than every deadline: in time, and the store's counters equal what was admitted.
    assert_within_bound("slow", &r3, &a3).await;
    let hot3 = Answers::admitted(&a3.hot, 0.0) as u64;
    let fresh3 = Answers::admitted(&a3.fresh, 0.0) as u64;
    holds_admitted(
        redis_count(&lock(&slow), "/api/hot"),
        hot3,
        &a3.hot,
        "slow: hot counter",
    );
    holds_admitted(
        redis_count(&lock(&slow), "/api/fresh"),
        fresh3,
        &a3.fresh,
        "slow: fresh counter",
    );

    // 4. Flapping every second: never a doubled charge, never a lost write-back.
    assert_within_bound("flapping", &r4, &a4).await;
    let hot4 = Answers::admitted(&a4.hot, 0.0) as u64;
    let fresh4 = Answers::admitted(&a4.fresh, 0.0) as u64;
    holds_admitted(
        redis_count(&lock(&flapping), "/api/hot"),
        hot4,
        &a4.hot,
        "flapping: hot counter",
    );
    holds_admitted(
        redis_count(&lock(&flapping), "/api/fresh"),
        fresh4,
        &a4.fresh,
        "flapping: fresh counter",
    );
}

/// A counter holds what was admitted: nothing lost, nothing doubled. A request whose answer
/// Envoy's own timer dropped (a 500 on two busy cores, though sluice answered within 20 ms: see
/// [`assert_answered_in_time`]) may have been admitted and charged by sluice, so the counter may
/// hold up to one more per such 500 on that key.
fn holds_admitted(count: u64, admitted: u64, answers: &[Answer], name: &str) {
    let dropped = answers.iter().filter(|(_, s, _)| *s == 500).count() as u64;
    assert!(
        (admitted..=admitted + dropped).contains(&count),
        "{name}: {count}, admitted {admitted}, Envoy 500s {dropped}"
    );
}

/// A counter on a promoted master: a write the dead master had not yet replicated may be gone
/// (a few at most), and, as for every counter here, a request Envoy answered 500 on its own
/// 20 ms timer may have been admitted and counted by sluice (seen on Cluster: 600 counted, 599
/// admitted, one 500; and on Sentinel: "hot counter 600 of 599", `upstream_rq_timeout` 2,
/// sluice 960 of 960 within 20 ms by its own clock). And a script call in flight when the
/// master was SIGKILLed may have been applied and replicated with its reply lost: sluice cannot
/// tell, decides that request locally and writes it back, so it counts twice (docs/redis.md,
/// "Nothing lost": an over-count, never an admission more). Seen once on a clean clone beside
/// stress-ng: "cluster: hot counter: 600, admitted 596, Envoy 500s 3". At 28 requests a second
/// over calls of a millisecond or two, at most one or two such calls. One rule for every store
/// this test checks.
fn holds_after_failover(count: u64, admitted: u64, answers: &[Answer], name: &str) {
    let dropped = answers.iter().filter(|(_, s, _)| *s == 500).count() as u64;
    const IN_FLIGHT_AT_THE_KILL: u64 = 2;
    assert!(
        count + 5 >= admitted && count <= admitted + dropped + IN_FLIGHT_AT_THE_KILL,
        "{name}: {count}, admitted {admitted}, Envoy 500s {dropped}"
    );
}

/// A tenant whose counters live on another Cluster master than `acme`'s.
/// The episodes a replica's log declares it decided locally in, as (from, to) seconds into
/// the window that starts at `start` (Unix time); one still open ends at infinity.
fn local_episodes(log: &str, start: Duration) -> Vec<(f64, f64)> {
    let mut out = Vec::new();
    let mut open: Option<f64> = None;
    for line in log.lines() {
        let Some(at) = line.split_whitespace().next().and_then(unix_of_rfc3339) else {
            continue;
        };
        let t = at - start.as_secs_f64();
        if line.contains("deciding locally") {
            open.get_or_insert(t);
        } else if line.contains("deciding on the store again") {
            if let Some(from) = open.take() {
                out.push((from, t));
            }
        }
    }
    out.extend(open.map(|from| (from, f64::INFINITY)));
    out
}

/// `2026-11-28T12:38:09.513747Z` (the log's UTC timestamps) as Unix seconds.
fn unix_of_rfc3339(s: &str) -> Option<f64> {
    let (date, time) = s.strip_suffix('Z')?.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let mut h = time.split(':');
    let (hh, mm) = (
        h.next()?.parse::<f64>().ok()?,
        h.next()?.parse::<f64>().ok()?,
    );
    let ss = h.next()?.parse::<f64>().ok()?;
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days as f64 * 86_400.0 + hh * 3600.0 + mm * 60.0 + ss)
}

#[test]
fn log_timestamps_read_as_unix_seconds() {
    assert_eq!(unix_of_rfc3339("1970-01-01T00:00:00.000000Z"), Some(0.0));
    assert_eq!(
        unix_of_rfc3339("2026-11-28T12:38:09.500000Z"),
        Some(1_795_869_489.5)
    );
    let log = "2026-11-28T12:38:09.500000Z  WARN sluice::store::fallback: deciding locally: x\n\
               2026-11-28T12:38:10.000000Z  INFO sluice::store::fallback: deciding on the store again\n";
    let start = Duration::from_secs(1_795_869_480);
    assert_eq!(local_episodes(log, start), vec![(9.5, 10.0)]);
}

fn tenant_elsewhere(cluster: &RedisCluster) -> String {
    let acme = cluster.master_of("{edge|tenant=acme}");
    (0..64)
        .map(|i| format!("t{i}"))
        .find(|t| cluster.master_of(&format!("{{edge|tenant={t}}}")) != acme)
        .expect("a tenant on another master")
}

/// The count a Cluster holds for `path`'s fixed-window counter of `tenant` (through any node).
fn cluster_count(cluster: &RedisCluster, tenant: &str, path: &str) -> u64 {
    let node = cluster.master_of(&format!("{{edge|tenant={tenant}}}"));
    redis_count(cluster.node(node), &format!("tenant={tenant}}}*{path}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failovers_through_envoy_keep_the_limits_and_the_written_back_usage() {
    let cluster = Arc::new(Mutex::new(
        tokio::task::spawn_blocking(RedisCluster::start_replicated)
            .await
            .expect("cluster"),
    ));
    let sentinel = Arc::new(Mutex::new(
        tokio::task::spawn_blocking(SentinelSetup::start)
            .await
            .expect("sentinel"),
    ));
    let seeds = lock(&cluster).seeds().join(",");
    let sentinel_url = format!("mymaster,{}", lock(&sentinel).addresses().join(","));
    let on_cluster = [("REDIS_TYPE", "cluster"), ("REDIS_URL", seeds.as_str())];
    let on_sentinel = [
        ("REDIS_TYPE", "sentinel"),
        ("REDIS_URL", sentinel_url.as_str()),
    ];
    let (rc, rs) = tokio::join!(rig_on(&on_cluster), rig_on(&on_sentinel));
    let other = tenant_elsewhere(&lock(&cluster));
    let now = unix().as_secs();
    let start = Duration::from_secs((now / 60 + 1) * 60);
    let elsewhere = Arc::new(Mutex::new(Vec::new()));
    let victim = lock(&cluster).master_of("{edge|tenant=acme}");
    // Cluster: the master holding acme's counters SIGKILLed; its replica takes over.
    let cluster_run = async {
        let kill = async {
            at(start, OUTAGE.0 as f64).await;
            lock(&cluster).node_mut(victim).stop();
        };
        let (answers, (), ()) = tokio::join!(
            window(&rc, None, Fault::None, start),
            kill,
            offer_as(
                rc.envoy.front,
                start,
                &other,
                "/api/hot",
                &[(LOAD.0, LOAD.1, 4)],
                Arc::clone(&elsewhere)
            ),
        );
        answers
    };
    // Sentinel: the master SIGKILLed; the sentinels promote the replica.
    let sentinel_run = async {
        let kill = async {
            at(start, OUTAGE.0 as f64).await;
            let s = Arc::clone(&sentinel);
            tokio::task::spawn_blocking(move || lock(&s).kill_master_and_fail_over())
                .await
                .expect("failover");
        };
        let (answers, ()) = tokio::join!(window(&rs, None, Fault::None, start), kill);
        answers
    };
    let (ac, asn) = tokio::join!(cluster_run, sentinel_run);
    assert!(
        unix() < start + Duration::from_secs(60),
        "the run left its window"
    );
    tokio::join!(settled(&rc), settled(&rs));

    assert_within_bound("cluster failover", &rc, &ac).await;
    assert_within_bound("sentinel failover", &rs, &asn).await;
    // The promoted masters hold the usage written back: all of the fresh key's (first seen in
    // the outage), and the hot key's (a write the dead master had not yet replicated may be
    // gone: a few at most).
    let c = lock(&cluster);
    let fresh = Answers::admitted(&ac.fresh, 0.0) as u64;
    holds_admitted(
        cluster_count(&c, "acme", "/api/fresh"),
        fresh,
        &ac.fresh,
        "cluster: fresh counter",
    );
    let hot = Answers::admitted(&ac.hot, 0.0) as u64;
    holds_after_failover(
        cluster_count(&c, "acme", "/api/hot"),
        hot,
        &ac.hot,
        "cluster: hot counter",
    );
    // A key on another master is decided on the store throughout: its answers count down one
    // by one (the cluster runs with `cluster-require-full-coverage no`, so the other masters
    // keep serving while the dead one's replica takes over). What sluice controls is asserted:
    // every answer is the store's. A 500 is Envoy giving up on its own 20 ms timer (counted in
    // its `ratelimit.error`; sluice's own time to answer is asserted above), reported here, not
    // asserted: that request may or may not have reached the counter, so the count down may
    // step by two across it, never otherwise.
    let elsewhere = lock(&elsewhere);
    let n = elsewhere.len() as u32;
    let mut by_time: Vec<&Answer> = elsewhere.iter().collect();
    by_time.sort_by(|a, b| a.0.total_cmp(&b.0));
    let envoy_gave_up = by_time.iter().filter(|(_, s, _)| *s == 500).count() as u32;
    let not_the_store: Vec<&&Answer> = by_time
        .iter()
        .filter(|(_, s, r)| *s != 500 && (*s != 200 || r.is_none()))
        .collect();
    assert!(
        not_the_store.is_empty(),
        "all admitted (600/min), each with the store's remaining: {not_the_store:?}"
    );
    // The store's own count down, in the order they were sent: 599, 598, ... On a busy machine
    // a call to a healthy master can miss REDIS_TIMEOUT too; sluice then decides locally, as
    // FAILURE_MODE=local says, logs the episode ("deciding locally" .. "deciding on the store
    // again") and writes the decision back. An answer off the count down is excused only
    // within such an episode that sluice itself logged (a second either side: `t` is when the
    // request was due, not when a busy test sent it), and the store's count down may then step
    // by what was written back; `held` below checks every admitted answer reached the store.
    let episodes = [&rc.a, &rc.b]
        .iter()
        .flat_map(|s| local_episodes(&s.log(), start))
        .collect::<Vec<_>>();
    let in_episode = |t: f64| episodes.iter().any(|(a, b)| t >= a - 1.0 && t <= b + 1.0);
    let (mut want, mut skips, mut after_500) = (599u32, 0u32, false);
    let (mut local, mut owed) = (0u32, 0u32);
    let mut off: Vec<(f64, Option<u32>)> = Vec::new();
    for (t, status, r) in by_time.iter().copied() {
        if *status == 500 {
            after_500 = true;
            continue;
        }
        match *r {
            Some(got) if got == want => {}
            Some(got) if after_500 && want.checked_sub(1) == Some(got) => skips += 1,
            Some(got) if got < want && want - got <= owed => owed -= want - got,
            Some(_) if in_episode(*t) => {
                (local, owed) = (local + 1, owed + 1);
                continue;
            }
            _ => off.push((*t, *r)),
        }
        want = r.unwrap_or(want).saturating_sub(1);
        after_500 = false;
    }
    eprintln!(
        "cluster failover: {} of {n} answers for a key on another master were not the store's \
         count down {off:?}; Envoy gave up on {envoy_gave_up}; {local} decided locally within \
         the episodes sluice logged {episodes:?}",
        off.len()
    );
    assert!(
        off.is_empty(),
        "decided other than on a healthy master: {off:?}"
    );
    let admitted = n - envoy_gave_up;
    let held = cluster_count(&c, &other, "/api/hot");
    assert!(
        held >= u64::from(admitted + skips) && held <= u64::from(admitted + skips + envoy_gave_up),
        "its counter is whole: {held}, for {admitted} admitted, {skips} counted behind Envoy's \
         500s, {envoy_gave_up} 500s"
    );
    drop(c);
    let s = lock(&sentinel);
    let fresh = Answers::admitted(&asn.fresh, 0.0) as u64;
    holds_admitted(
        redis_count(&s.replica, "/api/fresh"),
        fresh,
        &asn.fresh,
        "sentinel: fresh counter",
    );
    let hot = Answers::admitted(&asn.hot, 0.0) as u64;
    holds_after_failover(
        redis_count(&s.replica, "/api/hot"),
        hot,
        &asn.hot,
        "sentinel: hot counter",
    );
}

/// 100 000 distinct keys while Redis is down: every request answered (locally), the local state
/// under its cap (`LOCAL_MAX_COUNTERS`, each of its three parts), evictions counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_state_stays_under_its_cap_with_100000_keys_in_an_outage() {
    let mut redis = start_redis(&[]).await;
    let rules = tempfile::tempdir().expect("tempdir");
    std::fs::write(rules.path().join("edge.yaml"), RULES).expect("write rules");
    let mut cmd = binary::serve(rules.path());
    cmd.env("REDIS_URL", redis.url())
        .env("FAILURE_MODE", "local")
        .env("LOCAL_MAX_COUNTERS", "1000");
    let s = SluiceProcess::spawn(cmd).await;
    redis.stop();
    let mut decisions = 0;
    for _ in 0..60 {
        if decisions >= 100_000 {
            break;
        }
        let summary = binary::bench(
            &[
                "--target",
                &s.grpc_url(),
                "--domain",
                "edge",
                "--descriptor",
                "user={id}",
                "--consumers",
                "1000000000000",
                "--concurrency",
                "16",
                "--duration",
                "5s",
                // No deadline: this load saturates both cores (a debug build, the load generator
                // beside it), which is not what this test is about; Envoy's deadlines are the
                // other tests'.
                "--timeout",
                "0s",
                "--seed",
                &decisions.to_string(),
            ]
            .map(String::from),
        )
        .await
        .expect("bench runs");
        let n = |k: &str| summary[k].as_u64().unwrap_or(0);
        assert_eq!(n("errors"), 0, "every request answered: {summary}");
        decisions += n("decisions");
    }
    assert!(decisions >= 100_000, "{decisions} decisions");
    // The gauge is refreshed every second by the layer's background task.
    eventually("the local state is reported", || async {
        metric(&s, "sluice_local_decisions_total").await.is_some()
            && metric(&s, "sluice_local_counters").await.unwrap_or(0.0) > 0.0
    })
    .await;
    let held = metric(&s, "sluice_local_counters")
        .await
        .unwrap_or(f64::MAX);
    assert!(
        held <= 3000.0,
        "local store, learned and owed each under 1000: {held}"
    );
    let evicted = metric(&s, "sluice_local_evictions_total")
        .await
        .unwrap_or(0.0);
    assert!(evicted > 0.0, "the cap was reached and counted");
}
