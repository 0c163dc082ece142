//! Live config reload over real sockets: a Kubernetes ConfigMap-style `..data` symlink swap while
//! requests flow, a broken config that leaves the old rules in force, counters that survive a
//! reload, and in-flight requests that finish on the snapshot they started with.

use crate::support::*;
use sluice::app::Ingredients;
use sluice::clock::ManualClock;
use sluice::config::{fingerprint, load_path, LoadOptions};
use sluice::proto::rate_limit_response::Code;
use sluice::server::reload::ReloadSettings;
use sluice::server::{self, ServerConfig};
use sluice::store::fake::FakeStore;
use sluice::store::CounterStore;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn config(limit: u32) -> String {
    format!(
        "domain: live\ndescriptors:\n  - key: k\n    rate_limit: {{unit: minute, requests_per_unit: {limit}}}\n"
    )
}

const BROKEN: &str =
    "domain: live\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n";

/// A ConfigMap volume as the kubelet writes it: the data in a timestamped directory, `..data`
/// pointing at it, and each key a symlink through `..data`.
struct ConfigMapDir {
    dir: tempfile::TempDir,
    version: usize,
}

impl ConfigMapDir {
    fn new(yaml: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut me = Self { dir, version: 0 };
        me.write_version(yaml);
        std::os::unix::fs::symlink(me.data_dir_name(), me.path().join("..data")).expect("..data");
        std::os::unix::fs::symlink("..data/live.yaml", me.path().join("live.yaml"))
            .expect("key symlink");
        me
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn data_dir_name(&self) -> String {
        format!(
            "..2026_11_21_00_00_0{}.000000{}",
            self.version, self.version
        )
    }

    fn write_version(&mut self, yaml: &str) {
        self.version += 1;
        let data = self.path().join(self.data_dir_name());
        std::fs::create_dir(&data).expect("data dir");
        std::fs::write(data.join("live.yaml"), yaml).expect("write config");
    }

    /// The kubelet's atomic update: new data directory, a temporary symlink to it, renamed over
    /// `..data`.
    fn swap(&mut self, yaml: &str) {
        self.write_version(yaml);
        let tmp = self.path().join("..data_tmp");
        std::os::unix::fs::symlink(self.data_dir_name(), &tmp).expect("tmp symlink");
        std::fs::rename(&tmp, self.path().join("..data")).expect("atomic swap");
    }
}

const OPTIONS: LoadOptions = LoadOptions {
    merge_domains: false,
    calendar_months: false,
    global_store: false,
    ignore_dotfiles: true,
};

/// An in-process server on the ConfigMap directory, checking for changes every 20 ms.
async fn serve(dir: &Path, store: Option<Arc<dyn CounterStore>>) -> server::Running {
    let digest = fingerprint(dir, &OPTIONS);
    let rules = load_path(dir, &OPTIONS).expect("initial config loads");
    let base = Ingredients::for_tests(rules, Arc::new(ManualClock::new(T0)));
    let store = match store {
        Some(s) => crate::support::stack(s, "test"),
        None => base.store.clone(),
    };
    let config = ServerConfig {
        reload: Some(ReloadSettings {
            path: dir.to_path_buf(),
            options: OPTIONS,
            interval: Duration::from_millis(20),
            candidate: false,
        }),
        loaded_fingerprint: digest,
        ..ServerConfig::from_ingredients(Ingredients { store, ..base })
    };
    server::start(config).await.expect("server starts")
}

fn limit(r: &sluice::proto::RateLimitResponse) -> u32 {
    r.statuses[0]
        .current_limit
        .as_ref()
        .map_or(0, |l| l.requests_per_unit)
}

async fn status(running: &server::Running) -> serde_json::Value {
    let (code, body) = http(running.http_addr(), "GET", "/config/status", "").await;
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).expect("JSON status")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_swap_takes_effect_while_requests_flow_and_a_broken_one_is_refused() {
    let mut cm = ConfigMapDir::new(&config(1000));
    let running = serve(cm.path(), None).await;
    let url = running.grpc_url();

    // Requests flow the whole time, on several connections; every answer is kept.
    let stop = Arc::new(AtomicBool::new(false));
    let mut flows = Vec::new();
    for f in 0..4 {
        let (url, stop) = (url.clone(), Arc::clone(&stop));
        flows.push(tokio::spawn(async move {
            let mut c =
                sluice::proto::rate_limit_service_client::RateLimitServiceClient::connect(url)
                    .await
                    .expect("connect");
            let mut seen = Vec::new();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let r = c
                    .should_rate_limit(one("live", &[("k", &format!("flow{f}-{i}"))]))
                    .await
                    .map(|r| r.into_inner());
                seen.push(r.map(|r| (code(&r), limit(&r))).map_err(|e| e.to_string()));
            }
            seen
        }));
    }

    let c = running.grpc_url();
    let probe = || {
        let c = c.clone();
        async move {
            let mut client =
                sluice::proto::rate_limit_service_client::RateLimitServiceClient::connect(c)
                    .await
                    .expect("connect");
            let r = client
                .should_rate_limit(one("live", &[("k", "probe")]))
                .await
                .expect("ShouldRateLimit succeeds")
                .into_inner();
            limit(&r)
        }
    };
    assert_eq!(probe().await, 1000);

    cm.swap(&config(2000));
    eventually("the new limit is in force", || async {
        probe().await == 2000
    })
    .await;
    let s = status(&running).await;
    assert_eq!(s["reloads_ok"], 1, "{s}");
    assert_eq!(s["last_reload"]["ok"], true, "{s}");

    cm.swap(BROKEN);
    eventually("the broken config is reported", || async {
        status(&running).await["reloads_failed"] == 1
    })
    .await;
    let s = status(&running).await;
    assert_eq!(s["last_reload"]["ok"], false, "{s}");
    let error = s["last_reload"]["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("live.yaml:4:") && error.contains("fortnight"),
        "the error names file, line and the bad value: {error}"
    );
    assert_eq!(probe().await, 2000, "the previous rules stay in force");
    let (_, metrics) = http(running.http_addr(), "GET", "/metrics", "").await;
    assert!(
        metrics.contains("sluice_config_loads_total{result=\"failure\"} 1"),
        "{metrics}"
    );

    // Fixing the config is picked up again.
    cm.swap(&config(3000));
    eventually("the fixed config is in force", || async {
        probe().await == 3000
    })
    .await;

    stop.store(true, Ordering::Relaxed);
    let mut answers = Vec::new();
    for f in flows {
        answers.extend(f.await.expect("flow task"));
    }
    let failed: Vec<_> = answers.iter().filter(|a| a.is_err()).collect();
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    assert!(answers
        .iter()
        .all(|a| matches!(a, Ok((Code::Ok, 1000 | 2000 | 3000)))));
    running.stop().await.expect("clean stop");
}

#[tokio::test]
async fn counters_survive_a_reload_that_keeps_their_limit() {
    let mut cm = ConfigMapDir::new(&config(5));
    let running = serve(cm.path(), None).await;
    let c = sluice::proto::rate_limit_service_client::RateLimitServiceClient::connect(
        running.grpc_url(),
    )
    .await
    .expect("connect");
    let call = |value: &'static str| {
        let mut c = c.clone();
        async move {
            c.should_rate_limit(one("live", &[("k", value)]))
                .await
                .expect("call")
                .into_inner()
        }
    };
    for _ in 0..3 {
        call("a").await;
    }
    // Same limit, another descriptor added: the counter of k=a carries on.
    cm.swap(&format!(
        "{}  - key: other\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n",
        config(5)
    ));
    eventually("the reload took effect", || async {
        status(&running).await["reloads_ok"] == 1
    })
    .await;
    let r = call("a").await;
    assert_eq!(r.statuses[0].limit_remaining, 1, "3 + 1 of 5 used");
    // A changed limit is a different counter (its key includes the limit): it starts afresh.
    cm.swap(&config(10));
    eventually("the second reload took effect", || async {
        status(&running).await["reloads_ok"] == 2
    })
    .await;
    let r = call("a").await;
    assert_eq!(limit(&r), 10);
    assert_eq!(r.statuses[0].limit_remaining, 9);
    running.stop().await.expect("clean stop");
}

#[tokio::test]
async fn an_in_flight_request_finishes_on_the_rules_it_started_with() {
    let mut cm = ConfigMapDir::new(&config(7));
    let store = Arc::new(FakeStore::gated(Arc::new(ManualClock::new(T0))));
    let running = serve(cm.path(), Some(store.clone())).await;
    let url = running.grpc_url();
    let in_flight = tokio::spawn(async move {
        let mut c = sluice::proto::rate_limit_service_client::RateLimitServiceClient::connect(url)
            .await
            .expect("connect");
        c.should_rate_limit(one("live", &[("k", "x")]))
            .await
            .expect("call")
            .into_inner()
    });
    eventually("the request waits in the store", || async {
        store.calls() == 1
    })
    .await;
    cm.swap(&config(70));
    eventually("the reload took effect", || async {
        status(&running).await["reloads_ok"] == 1
    })
    .await;
    store.open(2);
    let r = in_flight.await.expect("task");
    assert_eq!(limit(&r), 7, "answered on the snapshot it started with");
    let mut c = sluice::proto::rate_limit_service_client::RateLimitServiceClient::connect(
        running.grpc_url(),
    )
    .await
    .expect("connect");
    let r = c
        .should_rate_limit(one("live", &[("k", "x")]))
        .await
        .expect("call")
        .into_inner();
    assert_eq!(limit(&r), 70, "the next request uses the new rules");
    running.stop().await.expect("clean stop");
}

/// A YAML alias bomb reloaded into the running binary (issue 38): a 500 KiB string aliased
/// 90 000 times fits a 1 MiB ConfigMap and would expand to 45 GB. The reload is refused with an
/// error naming the file, its line and the alias budget, the old rules stay in force, and the
/// process's peak resident memory grows by less than 64 MB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alias_bomb_reload_is_refused_and_costs_no_memory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("live.yaml");
    std::fs::write(&file, config(7)).expect("config");
    let mut command = crate::support::binary::serve(dir.path());
    command.env("CONFIG_RELOAD_INTERVAL", "100ms");
    let sluice = crate::support::binary::SluiceProcess::spawn(command).await;
    let probe = || async {
        let mut c = sluice::proto::rate_limit_service_client::RateLimitServiceClient::connect(
            sluice.grpc_url(),
        )
        .await
        .expect("connect");
        let r = c
            .should_rate_limit(one("live", &[("k", "probe")]))
            .await
            .expect("decides")
            .into_inner();
        limit(&r)
    };
    assert_eq!(probe().await, 7);
    let baseline = crate::support::binary::resident(sluice.pid(), "VmRSS:");

    let mut bomb = config(9);
    bomb.push_str(&format!("x: &a \"{}\"\ny: [", "a".repeat(500 * 1024)));
    bomb.push_str(&vec!["*a"; 90_000].join(","));
    bomb.push_str("]\n");
    assert!(
        bomb.len() < 1 << 20,
        "fits a ConfigMap: {} bytes",
        bomb.len()
    );
    std::fs::write(&file, &bomb).expect("bomb");

    let http_addr = sluice.http;
    eventually("the bomb's reload is refused", || async {
        let (_, body) = http(http_addr, "GET", "/config/status", "").await;
        body.contains("\"reloads_failed\":1")
    })
    .await;
    let (_, body) = http(http_addr, "GET", "/config/status", "").await;
    let status: serde_json::Value = serde_json::from_str(&body).expect("JSON status");
    let error = status["last_reload"]["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("live.yaml:6:") && error.contains("aliases expand to more than 8 MiB"),
        "the error names the file, the line and the budget: {error}"
    );
    assert_eq!(probe().await, 7, "the old rules stay in force");
    let peak = crate::support::binary::resident(sluice.pid(), "VmHWM:");
    println!(
        "alias bomb: resident {} MiB before, peak {} MiB",
        baseline >> 20,
        peak >> 20
    );
    assert!(
        peak < baseline + (64 << 20),
        "peak {} MiB, {} MiB before the bomb",
        peak >> 20,
        baseline >> 20
    );
}

/// A resource at 1000/min above a consumer at 5/day, with or without `leased:` on the resource.
fn toggled(leased: bool) -> String {
    format!(
        "domain: live\ndescriptors:\n  - key: resource\n    value: api\n{}    rate_limit: \
         {{unit: minute, requests_per_unit: 1000, applies_to_descendants: true}}\n    \
         descriptors:\n      - key: consumer\n        rate_limit: {{unit: day, \
         requests_per_unit: 5}}\n",
        if leased { "    leased: {}\n" } else { "" }
    )
}

/// Turning `leased:` on or off on a resource is no reset (issue 50): a consumer who spent her
/// 5/day stays denied through both live reloads, on every store (before: a fresh counter each
/// time, her 5 again).
async fn toggling_leased_keeps_the_counters_below(kind: &str) {
    let (store, _clock, _backend) = crate::cases::store::make_store(kind).await;
    let mut cm = ConfigMapDir::new(&toggled(false));
    let running = serve(cm.path(), Some(store)).await;
    let c = sluice::proto::rate_limit_service_client::RateLimitServiceClient::connect(
        running.grpc_url(),
    )
    .await
    .expect("connect");
    let alice = || {
        let mut c = c.clone();
        async move {
            let r = c
                .should_rate_limit(one("live", &[("resource", "api"), ("consumer", "alice")]))
                .await
                .expect("call")
                .into_inner();
            code(&r)
        }
    };
    for i in 0..5 {
        assert_eq!(alice().await, Code::Ok, "{kind}: request {i} of her 5");
    }
    assert_eq!(alice().await, Code::OverLimit, "{kind}: her 6th");
    for (n, leased) in [(1, true), (2, false)] {
        cm.swap(&toggled(leased));
        eventually("the reload took effect", || async {
            status(&running).await["reloads_ok"] == n
        })
        .await;
        assert_eq!(
            alice().await,
            Code::OverLimit,
            "{kind}: after `leased:` was turned {} she was admitted again",
            if leased { "on" } else { "off" }
        );
    }
    running.stop().await.expect("clean stop");
}

test_with_stores!(toggling_leased_on, [memory, redis, cluster], kind => toggling_leased_keeps_the_counters_below);
