//! Global limits across regions (`global: {}`), with real processes and real latency: a home
//! `redis-server`, three regions each with its own store (two standalone `redis-server`s and a
//! 3-master Cluster), two `sluice` processes per region, and between each region and home a
//! test-owned TCP link ([`Link`]) that delays every byte 25, 50 or 75 ms each way (round trips
//! of 50-150 ms). Load is `sluice bench` over gRPC, on every replica at once.
//!
//! - A global 30 000/min offered ~2.8x in uneven shares (4:2:1 between the regions): never more
//!   than 30 000 admitted in the window, at least 28 500 (95 %), each region at least 90 % of
//!   its max-min share (a third: each was offered more), and
//!   once the replicas' slices and the idle pools are back the home counter holds exactly what
//!   was admitted.
//! - A global limit never reached: at most 0.001 calls to the home store per decision (counted
//!   by the home Redis), and nothing denied.
//! - Without `GLOBAL_REDIS_URL` a config with `global` does not load; the error names the file,
//!   the line and the block.
//!
//! Nothing here is timed: the window is a minute long and a run starts early in one (it waits
//! for the next when fewer than 20 s are left); what is asserted are counts.

use crate::support::binary::{bench_load, serve, SluiceProcess};
use crate::support::eventually;
use crate::support::link::Link;
use crate::support::redis::{start_cluster, start_redis, RedisCluster, RedisServer};
use std::net::SocketAddr;
use std::time::Duration;

pub(crate) fn config(limit: u64) -> String {
    // all_or_nothing: a request the slices cannot decide is never a hit recorded past the
    // limit, so the home counter equals what was admitted once every unit is back.
    format!(
        "domain: g\ncounting: all_or_nothing\ndescriptors:\n  - key: resource\n    value: api\n    \
         global: {{}}\n    rate_limit: {{unit: minute, requests_per_unit: {limit}}}\n"
    )
}

/// One region: its store's settings and its replicas.
pub(crate) struct Region {
    name: &'static str,
    pub(crate) replicas: Vec<SluiceProcess>,
    _link: Link,
}

/// A region's own store.
pub(crate) enum Store {
    Single(RedisServer),
    Cluster(RedisCluster),
}

impl Store {
    fn settings(&self) -> Vec<(&'static str, String)> {
        match self {
            Store::Single(r) => vec![("REDIS_URL", r.url()), ("REDIS_TYPE", "single".into())],
            Store::Cluster(c) => vec![
                ("REDIS_URL", c.seeds().join(",")),
                ("REDIS_TYPE", "cluster".into()),
            ],
        }
    }
}

/// `n` replicas of region `name` on `store`, reaching `home` through a link of `delay` each way.
pub(crate) async fn region(
    name: &'static str,
    store: &Store,
    home: SocketAddr,
    delay: Duration,
    config: &std::path::Path,
    n: usize,
) -> Region {
    let link = Link::start(home, delay).await;
    let mut replicas = Vec::new();
    for _ in 0..n {
        let mut c = serve(config);
        for (k, v) in store.settings() {
            c.env(k, v);
        }
        c.env("GLOBAL_REDIS_URL", link.url())
            .env("REGION", name)
            // Each refill's size and the board it was sized on, for `accounts` on a failure.
            .env("RUST_LOG", "sluice::store::global::ask=debug");
        replicas.push(SluiceProcess::spawn(c).await);
    }
    Region {
        name,
        replicas,
        _link: link,
    }
}

fn unix_minute() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs()
        / 60
}

fn seconds_into_the_minute() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970");
    now.as_secs() % 60
}

/// Waits for the next minute when fewer than `need` seconds of this one are left (a wait,
/// never a measurement).
pub(crate) async fn early_in_a_minute(need: u64) {
    let into = seconds_into_the_minute();
    if into + need >= 60 {
        tokio::time::sleep(Duration::from_secs(61 - into)).await;
    }
}

/// `sluice bench` on `target`: `rate` requests a second (0: closed loop) for `duration`;
/// (ok, over_limit).
pub(crate) async fn load(target: String, rate: u32, duration: &str) -> (u64, u64) {
    bench_load(&target, ("g", "resource=api", 1), rate, duration).await
}

/// The global counter in the home store (one key per window).
pub(crate) fn home_counters(home: &RedisServer) -> Vec<(String, u64)> {
    let keys = home.cli(&["KEYS", "*resource=api*"]);
    // The counters only: not the regions' reports beside them (`…#regions:<window>`).
    keys.lines()
        .filter(|k| !k.is_empty() && !k.contains('#'))
        .map(|k| {
            let v = home.cli(&["GET", k]).trim().parse().unwrap_or(0);
            (k.to_string(), v)
        })
        .collect()
}

/// Each replica's tallies of global limits and slices, its store errors and its warnings: what
/// a failed count says about where the units went.
async fn accounts(regions: &[Region], stores: &[Store]) -> String {
    let mut out = String::new();
    // Each standalone region store's pools, as Redis holds them (have - taken is unspent).
    for (r, store) in regions.iter().zip(stores) {
        if let Store::Single(redis) = store {
            for key in redis
                .cli(&["KEYS", "*#pool:*"])
                .lines()
                .filter(|k| !k.is_empty())
            {
                let fields = redis.cli(&["HGETALL", key]).replace('\n', " ");
                out.push_str(&format!("region {} pool {key}: {fields}\n", r.name));
            }
        }
    }
    for r in regions {
        for (i, s) in r.replicas.iter().enumerate() {
            let metrics = crate::support::http(s.http, "GET", "/metrics", "").await.1;
            let tallies: Vec<&str> = metrics
                .lines()
                .filter(|l| {
                    !l.starts_with('#')
                        && (l.starts_with("sluice_global_")
                            || l.starts_with("sluice_slice")
                            || l.starts_with("sluice_store_errors")
                            || l.starts_with("sluice_refund_failures"))
                })
                .collect();
            let log = s.log();
            let warnings: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("WARN") || l.contains("ERROR"))
                .take(20)
                .collect();
            let refills: Vec<&str> = log.lines().filter(|l| l.contains("refill sized")).collect();
            out.push_str(&format!(
                "region {} replica {i}:\n  {}\n  warnings: {warnings:#?}\n  refills: {refills:#?}\n",
                r.name,
                tallies.join("\n  ")
            ));
        }
    }
    out
}

pub(crate) fn write_config(yaml: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("g.yaml");
    std::fs::write(&path, yaml).expect("write config");
    (dir, path)
}

/// The three regions of these tests: A and B on standalone Redis, C on a Cluster; 25, 50 and
/// 75 ms from home each way.
async fn three_regions(home: &RedisServer, config: &std::path::Path) -> (Vec<Region>, Vec<Store>) {
    let (a, b, c) = tokio::join!(start_redis(&[]), start_redis(&[]), start_cluster());
    let stores = vec![Store::Single(a), Store::Single(b), Store::Cluster(c)];
    let home_addr = SocketAddr::from(([127, 0, 0, 1], home.port()));
    let mut regions = Vec::new();
    for (i, (name, ms)) in [("a", 25), ("b", 50), ("c", 75)].into_iter().enumerate() {
        let delay = Duration::from_millis(ms);
        regions.push(region(name, &stores[i], home_addr, delay, config, 2).await);
    }
    (regions, stores)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_regions_share_a_global_limit_never_over_and_spend_nearly_all_of_it() {
    const LIMIT: u64 = 30_000;
    let home = start_redis(&[]).await;
    let (_dir, path) = write_config(&config(LIMIT));
    let (regions, stores) = three_regions(&home, &path).await;
    // 30 s of load started at most 14 s into a minute: it ends in the same window with room
    // for a slow start on a busy machine (checked below).
    early_in_a_minute(46).await;
    let minute = unix_minute();
    // Uneven shares, 4:2:1 between the regions, ~2.8x the limit over 30 s.
    let rates = [800, 400, 200];
    let mut runs = Vec::new();
    for (r, rate) in regions.iter().zip(rates) {
        for s in &r.replicas {
            runs.push(load(s.grpc_url(), rate, "30s"));
        }
    }
    let answers = futures_util::future::join_all(runs).await;
    assert_eq!(unix_minute(), minute, "the load stayed in one window");
    let per_region: Vec<(u64, u64)> = answers
        .chunks(2)
        .map(|c| (c[0].0 + c[1].0, c[0].1 + c[1].1))
        .collect();
    let ok: u64 = per_region.iter().map(|r| r.0).sum();
    let offered: u64 = per_region.iter().map(|r| r.0 + r.1).sum();
    eprintln!("per region (admitted, denied): {per_region:?}; admitted {ok} of {offered}");
    assert!(
        offered >= LIMIT * 5 / 2,
        "the load exceeds the limit well: {offered}"
    );
    assert!(ok <= LIMIT, "{ok} admitted against a global {LIMIT}");
    assert!(
        ok * 100 >= LIMIT * 95,
        "{ok} admitted of {LIMIT} with {offered} offered"
    );
    // Max-min fairness (`store/global/fair.rs`): every region was offered more than a third of
    // the limit, so each is admitted about a third, whatever its request rate.
    for ((admitted, denied), r) in per_region.iter().zip(&regions) {
        assert!(
            admitted + denied > LIMIT / 3,
            "region {} offered a third",
            r.name
        );
        if admitted * 10 < LIMIT / 3 * 9 {
            // Where the units went (trims, moved pools, refills), before failing.
            let accounts = accounts(&regions, &stores).await;
            panic!(
                "region {} admitted {admitted}, under 90 % of its max-min share \
                 ({per_region:?})\n{accounts}",
                r.name
            );
        }
    }
    // The replicas' idle slices go back to their pools, idle pools back home: the home counter
    // is then what was admitted.
    let home_ref = &home;
    let whole = || async move {
        let c = home_counters(home_ref);
        if c.len() == 1 && c[0].1 == ok {
            Ok(())
        } else {
            Err(format!(
                "home {c:?}, admitted {ok}, {} s into the minute",
                seconds_into_the_minute()
            ))
        }
    };
    // Not whole after 15 s (pools go home 2 s after their last take): the regions' pools are
    // read then, for the report, while they exist (they expire a minute after their window).
    // Only what the report shows depends on it, never the verdict.
    let soon = tokio::time::timeout(
        Duration::from_secs(15),
        crate::support::try_poll_until(whole),
    );
    let (whole, pools_then) = match soon.await {
        Ok(r) => (r, String::new()),
        Err(_) => {
            let pools = accounts(&regions, &stores).await;
            (crate::support::try_poll_until(whole).await, pools)
        }
    };
    if let Err(last) = whole {
        panic!(
            "the home counter never held what was admitted: {last}\nwhere the units went \
             (15 s after the load):\n{pools_then}\nand at the end:\n{}",
            accounts(&regions, &stores).await
        );
    }
    let windows = home_counters(&home);
    assert_eq!(windows.len(), 1, "one window: {windows:?}");
    assert_eq!(windows[0].1, ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_limit_never_reached_costs_at_most_a_thousandth_of_a_home_call_per_decision() {
    let home = start_redis(&[]).await;
    let (_dir, path) = write_config(&config(100_000_000));
    let (regions, _stores) = three_regions(&home, &path).await;
    early_in_a_minute(20).await;
    let before = home.evalsha_calls();
    let mut runs = Vec::new();
    for r in &regions {
        for s in &r.replicas {
            runs.push(load(s.grpc_url(), 0, "3s"));
        }
    }
    let answers = futures_util::future::join_all(runs).await;
    let calls = home.evalsha_calls() - before;
    let decisions: u64 = answers.iter().map(|a| a.0).sum();
    let denied: u64 = answers.iter().map(|a| a.1).sum();
    eprintln!("{calls} home calls for {decisions} decisions");
    assert_eq!(denied, 0, "nothing denied");
    // Each region's first calls to home load the script (NOSCRIPT, then EVAL): a handful of
    // calls, so the load must be well above a few thousand decisions to judge the rate.
    assert!(decisions >= 20_000, "{decisions}");
    assert!(
        calls * 1_000 <= decisions,
        "{calls} calls to the home store for {decisions} decisions: more than 0.001 per decision"
    );
    // The region's metrics carry its name (the Grafana row sums by it): region a refilled
    // (whichever of its replicas held the refill's lease), and was never cut off from home.
    let mut refills = 0.0;
    for s in &regions[0].replicas {
        let metrics = crate::support::http(s.http, "GET", "/metrics", "").await.1;
        let value = |name: &str| -> f64 {
            let prefix = format!("{name}{{region=\"a\"}} ");
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(prefix.as_str()))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .unwrap_or_else(|| panic!("no {name} of region a in /metrics:\n{metrics}"))
        };
        refills += value("sluice_global_refills_total");
        let cut_off = value("sluice_global_cut_off_seconds_total");
        assert!(cut_off == 0.0, "never cut off: {cut_off}");
    }
    assert!(refills >= 1.0, "{refills}");
}

#[tokio::test]
async fn without_a_home_store_a_global_limit_does_not_load() {
    let (_dir, path) = write_config(&config(100));
    let mut c = serve(&path);
    c.env_remove("GLOBAL_REDIS_URL");
    let out = c.output().await.expect("sluice runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("g.yaml:6")
            && err.contains("descriptors[0].global")
            && err.contains("GLOBAL_REDIS_URL"),
        "the error names the file, the line, the block and the setting: {err}"
    );
}

/// A partition setting that does not add up stops the start with the setting named: `share`
/// without a share, a share with `deny` (the operator would believe in a behaviour they do not
/// get), a share of 0 or above the whole limit, an unknown mode; and a home store without a
/// REGION, or with one that is not a name.
#[tokio::test]
async fn a_partition_setting_that_does_not_add_up_stops_the_start() {
    let (_dir, path) = write_config(&config(100));
    let cases = [
        (
            Some("share"),
            None,
            Some("a"),
            "GLOBAL_UNREACHABLE=share needs GLOBAL_UNREACHABLE_SHARE",
        ),
        (None, Some("0.5"), Some("a"), "GLOBAL_UNREACHABLE is deny"),
        (
            Some("share"),
            Some("1.5"),
            Some("a"),
            "GLOBAL_UNREACHABLE_SHARE",
        ),
        (
            Some("share"),
            Some("0"),
            Some("a"),
            "GLOBAL_UNREACHABLE_SHARE",
        ),
        (
            Some("share"),
            Some("0.0000001"),
            Some("a"),
            "GLOBAL_UNREACHABLE_SHARE",
        ),
        (Some("maybe"), None, Some("a"), "GLOBAL_UNREACHABLE"),
        // Two regions left unnamed would read as one at home.
        (None, None, None, "REGION is empty"),
        (None, None, Some("eu west"), "REGION \"eu west\""),
    ];
    for (mode, share, region, says) in cases {
        let mut c = serve(&path);
        c.env("GLOBAL_REDIS_URL", "127.0.0.1:1").kill_on_drop(true);
        c.env_remove("REGION");
        if let Some(r) = region {
            c.env("REGION", r);
        }
        if let Some(m) = mode {
            c.env("GLOBAL_UNREACHABLE", m);
        }
        if let Some(s) = share {
            c.env("GLOBAL_UNREACHABLE_SHARE", s);
        }
        let out = tokio::time::timeout(Duration::from_secs(60), c.output())
            .await
            .unwrap_or_else(|_| panic!("{mode:?} {share:?}: sluice started"))
            .expect("sluice runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{mode:?} {share:?}: {err}");
        assert!(err.contains(says), "{mode:?} {share:?}: {err}");
    }
}

/// A region cut off from home spends what its pool and slices hold, then denies (never a
/// regional counter of the same limit: that would be a limit per region); once the link heals
/// it is refilled again, and when its pool is idle every unit it did not spend is back home.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_cut_off_from_home_spends_what_it_holds_then_denies() {
    cut_off(None).await;
}

/// `GLOBAL_UNREACHABLE=share` with a share of 0.001 (1 000 of 1 000 000): the region cut off
/// spends what it holds, then admits its share on credit and no more (two replicas, one pool:
/// the credit is the window's, not each replica's); once healed, the credit is charged at home
/// and the home counter ends at exactly what was admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_cut_off_with_share_admits_its_share_more_and_home_is_charged_once_healed() {
    cut_off(Some("0.001")).await;
}

/// A region of two replicas cut off from home for 30 s under load, with `share` (the part of
/// the limit on credit) or without (`deny`). The window is an hour, so the cut lies in one.
async fn cut_off(share: Option<&str>) {
    let credit: u32 = if share.is_some() { 1_000 } else { 0 };
    let home = start_redis(&[]).await;
    // Small slices, so the region's pool holds a few seconds of its demand (refills of its
    // rate over 5 s): a 30 s cut at three times the rate runs it dry.
    let yaml = config(1_000_000)
        .replace("global: {}", "global: {max_slice: 100}")
        .replace("unit: minute", "unit: hour");
    let (_dir, path) = write_config(&yaml);
    let store = Store::Single(start_redis(&[]).await);
    let home_addr = SocketAddr::from(([127, 0, 0, 1], home.port()));
    let link = Link::start(home_addr, Duration::from_millis(25)).await;
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let mut c = serve(&path);
        for (k, v) in store.settings() {
            c.env(k, v);
        }
        c.env("GLOBAL_REDIS_URL", link.url()).env("REGION", "a");
        if let Some(share) = share {
            c.env("GLOBAL_UNREACHABLE", "share")
                .env("GLOBAL_UNREACHABLE_SHARE", share);
        }
        replicas.push(SluiceProcess::spawn(c).await);
    }
    super::global_admin::early_in_an_hour().await;
    let before =
        futures_util::future::join_all(replicas.iter().map(|s| load(s.grpc_url(), 500, "2s")))
            .await;
    let admitted_before: u64 = before.iter().map(|a| a.0).sum();
    assert!(admitted_before > 0);
    // No refill in flight when the link is cut (its reply lost, home would keep the charge):
    // the load has stopped, so once the pool's lease is free none starts.
    let Store::Single(regional) = &store else {
        unreachable!("a standalone regional store")
    };
    eventually("no refill in flight", || async {
        // One pool per window: `…#pool:<window start ms>`.
        let keys = regional.cli(&["KEYS", "*#pool:*"]);
        let pools: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
        !pools.is_empty()
            && pools
                .iter()
                .all(|k| regional.cli(&["HGET", k, "lock"]).trim().is_empty())
    })
    .await;
    link.cut();
    let granted: u64 = home_counters(&home).iter().map(|c| c.1).sum();
    // Three times the rate before, for 30 s: more than the pool and the slices hold.
    let during =
        futures_util::future::join_all(replicas.iter().map(|s| load(s.grpc_url(), 1_500, "30s")))
            .await;
    let admitted_during: u64 = during.iter().map(|a| a.0).sum();
    let denied_during: u64 = during.iter().map(|a| a.1).sum();
    eprintln!(
        "before the cut {admitted_before} admitted, {granted} granted by home; during it \
         {admitted_during} admitted, {denied_during} denied"
    );
    assert_eq!(
        home_counters(&home).iter().map(|c| c.1).sum::<u64>(),
        granted,
        "nothing reached home through the cut"
    );
    assert!(
        admitted_before + admitted_during <= granted + u64::from(credit),
        "cut off, the region admitted {admitted_during} more after {admitted_before}: beyond \
         the {granted} home granted it and its share of {credit}"
    );
    assert!(denied_during > 0, "the region ran dry while cut off");
    let shared = metric_sum(&replicas, "sluice_global_shared_total{region=\"a\"} ").await;
    assert_eq!(shared, f64::from(credit), "the window's share, once");
    if credit > 0 {
        assert!(
            admitted_before + admitted_during > granted,
            "the share was admitted beyond what home granted ({granted})"
        );
    }
    // Some replica's refills found home cut off, and its metrics say for how long (the spell
    // still running counts).
    let cut_off = metric_sum(
        &replicas,
        "sluice_global_cut_off_seconds_total{region=\"a\"} ",
    )
    .await;
    assert!(
        cut_off > 0.0,
        "the time cut off from home is counted: {cut_off}"
    );
    link.heal();
    let after =
        futures_util::future::join_all(replicas.iter().map(|s| load(s.grpc_url(), 500, "2s")))
            .await;
    let admitted_after: u64 = after.iter().map(|a| a.0).sum();
    assert!(admitted_after > 0, "refilled once the link healed");
    let admitted = admitted_before + admitted_during + admitted_after;
    eventually("every unit not spent is back home", || async {
        home_counters(&home).iter().map(|c| c.1).sum::<u64>() == admitted
    })
    .await;
    let settled = metric_sum(&replicas, "sluice_global_settled_total{region=\"a\"} ").await;
    assert_eq!(settled, f64::from(credit), "the credit was charged at home");
}

/// The sum over `replicas` of the series whose line starts with `prefix` in their /metrics.
pub(crate) async fn metric_sum(replicas: &[SluiceProcess], prefix: &str) -> f64 {
    let mut sum = 0.0;
    for s in replicas {
        let metrics = crate::support::http(s.http, "GET", "/metrics", "").await.1;
        sum += metrics
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {prefix} in /metrics:\n{metrics}"));
    }
    sum
}

/// Envoy's per-descriptor `limit` override on a global limit's node is global too: decided on
/// the home store's counter, not on each region's (a caller-set limit per region would let the
/// caller multiply it by the regions). Two regions, an override of 5/min sent 10 times to each:
/// 5 admitted in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envoy_limit_override_on_a_global_limit_is_one_counter_across_regions() {
    use sluice::proto::rate_limit_descriptor::RateLimitOverride;
    use sluice::proto::rate_limit_service_client::RateLimitServiceClient;
    let home = start_redis(&[]).await;
    let (_dir, path) = write_config(&config(1_000));
    let home_addr = SocketAddr::from(([127, 0, 0, 1], home.port()));
    let (sa, sb) = tokio::join!(start_redis(&[]), start_redis(&[]));
    let stores = [Store::Single(sa), Store::Single(sb)];
    let mut regions = Vec::new();
    for (i, name) in ["a", "b"].into_iter().enumerate() {
        let delay = Duration::from_millis(10);
        regions.push(region(name, &stores[i], home_addr, delay, &path, 1).await);
    }
    early_in_a_minute(20).await;
    let mut admitted = 0;
    for r in &regions {
        let mut client = RateLimitServiceClient::connect(r.replicas[0].grpc_url())
            .await
            .expect("connect");
        for _ in 0..10 {
            let mut d = crate::support::desc(&[("resource", "api")]);
            d.limit = Some(RateLimitOverride {
                requests_per_unit: 5,
                unit: 2, // MINUTE
            });
            let response = client
                .should_rate_limit(crate::support::request("g", vec![d]))
                .await
                .expect("answered")
                .into_inner();
            if crate::support::code(&response) == sluice::proto::rate_limit_response::Code::Ok {
                admitted += 1;
            }
        }
    }
    assert_eq!(
        admitted, 5,
        "an override of 5/min admitted {admitted} across two regions"
    );
}

/// A replica that stops (SIGTERM) gives its slices back to its region's pool and the pool back
/// home before it exits: with no replica of the region left to notice the pool go idle, the
/// home counter is what was admitted the moment the process is gone, not at the window's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_stopped_mid_load_gives_its_pool_back_home() {
    let home = start_redis(&[]).await;
    let (_dir, path) = write_config(&config(1_000_000));
    let store = Store::Single(start_redis(&[]).await);
    let home_addr = SocketAddr::from(([127, 0, 0, 1], home.port()));
    let mut region = region("a", &store, home_addr, Duration::from_millis(25), &path, 1).await;
    early_in_a_minute(30).await;
    let minute = unix_minute();
    let target = region.replicas[0].grpc_url();
    let args: Vec<String> = [
        "--target",
        &target,
        "--domain",
        "g",
        "--descriptor",
        "resource=api",
        "--concurrency",
        "8",
        "--rate",
        "400",
        "--duration",
        "8s",
        "--timeout",
        "5s",
    ]
    .map(String::from)
    .to_vec();
    let run = tokio::spawn(async move { crate::support::binary::bench(&args).await });
    // Stopped while the load runs (a wait, not a measurement: the load lasts 8 s), so its
    // slices and its pool hold units nobody spent.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let replica = &mut region.replicas[0];
    replica.sigterm();
    let (code, log) = replica.exit().await;
    assert_eq!(code, Some(0), "{log}");
    let summary = run.await.expect("bench task");
    // What the load was answered OK before the replica went: what it admitted.
    let admitted = match &summary {
        Ok(s) => s["ok"].as_u64().expect("ok"),
        Err(e) => panic!("sluice bench failed: {e}"),
    };
    assert!(admitted > 0);
    assert_eq!(unix_minute(), minute, "the window did not end meanwhile");
    let windows = home_counters(&home);
    assert_eq!(
        windows.iter().map(|w| w.1).collect::<Vec<_>>(),
        vec![admitted],
        "the home counter is what was admitted once the replica is gone: {windows:?}"
    );
    assert!(
        log.contains("gave the region's pools back to the home store"),
        "the pool went home at SIGTERM: {log}"
    );
}

/// Units region `store`'s pools of the window starting at `minute` hold, not taken.
fn pool_left(store: &RedisServer, minute: u64) -> u64 {
    let suffix = format!("#pool:{}", minute * 60_000);
    store
        .cli(&["KEYS", "*#pool:*"])
        .lines()
        .filter(|k| k.ends_with(&suffix))
        .map(|k| {
            let v = store.cli(&["HMGET", k, "have", "taken"]);
            let n: Vec<u64> = v.lines().map(|x| x.trim().parse().unwrap_or(0)).collect();
            n.first().copied().unwrap_or(0) - n.get(1).copied().unwrap_or(0)
        })
        .sum()
}

/// Both replicas of region A killed with SIGKILL mid-window: nobody gives its pool or slices
/// back, so they are stranded for the window, at most its pool and its replicas' slices; region
/// B goes on and spends the rest of the limit (once A's last report no longer holds A's
/// max-min share); in the next window the whole limit is there again (what A stranded was that
/// window's only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_killed_strands_at_most_its_pool_and_the_others_go_on() {
    const LIMIT: u64 = 3_000;
    const MAX_SLICE: u64 = 20;
    let home = start_redis(&[]).await;
    let yaml = config(LIMIT).replace("global: {}", &format!("global: {{max_slice: {MAX_SLICE}}}"));
    let (_dir, path) = write_config(&yaml);
    let (sa, sb) = tokio::join!(start_redis(&[]), start_redis(&[]));
    let stores = [Store::Single(sa), Store::Single(sb)];
    let home_addr = SocketAddr::from(([127, 0, 0, 1], home.port()));
    let mut a = region(
        "a",
        &stores[0],
        home_addr,
        Duration::from_millis(25),
        &path,
        2,
    )
    .await;
    let b = region(
        "b",
        &stores[1],
        home_addr,
        Duration::from_millis(50),
        &path,
        2,
    )
    .await;
    // 17 s of load and the give-back, in one window.
    early_in_a_minute(35).await;
    let minute = unix_minute();
    let all = a.replicas.iter().chain(&b.replicas);
    let first = futures_util::future::join_all(all.map(|s| load(s.grpc_url(), 100, "3s"))).await;
    let admitted_first: u64 = first.iter().map(|r| r.0).sum();
    assert_eq!(first.iter().map(|r| r.1).sum::<u64>(), 0, "under the limit");
    for s in &mut a.replicas {
        s.child.start_kill().expect("SIGKILL");
        let _ = s.exit().await;
    }
    let Store::Single(store_a) = &stores[0] else {
        unreachable!("standalone")
    };
    let pool_a = pool_left(store_a, minute);
    // Region B goes on, offered far more than is left, for longer than A's last report at
    // home holds A's share of the window (max-min fairness counts a region's reported demand
    // until its report is 10 s old, or twice what its pool lasts at its rate: `fair.rs`).
    let then =
        futures_util::future::join_all(b.replicas.iter().map(|s| load(s.grpc_url(), 300, "14s")))
            .await;
    assert_eq!(unix_minute(), minute, "one window so far");
    let admitted = admitted_first + then.iter().map(|r| r.0).sum::<u64>();
    // B's idle slices and pool go back home; A's stay where they are.
    let home_ref = &home;
    eventually("region B's units back home", || async move {
        let c = home_counters(home_ref);
        c.len() == 1 && c[0].1 <= admitted + pool_a + 2 * MAX_SLICE
    })
    .await;
    let at_home = home_counters(&home)[0].1;
    let stranded = at_home - admitted;
    eprintln!(
        "admitted {admitted} ({admitted_first} before the kill), home {at_home}, region A's \
         pool {pool_a}: {stranded} stranded"
    );
    assert!(admitted <= LIMIT, "{admitted} admitted against {LIMIT}");
    assert!(
        stranded >= pool_a && stranded <= pool_a + 2 * MAX_SLICE,
        "stranded {stranded}: region A's pool {pool_a} and at most its two slices of {MAX_SLICE}"
    );
    assert!(
        admitted * 100 >= (LIMIT - stranded) * 95,
        "region B spent what A did not strand: {admitted} of {} admitted",
        LIMIT - stranded
    );
    // The next window: the whole limit again, for region B alone.
    let into = seconds_into_the_minute();
    tokio::time::sleep(Duration::from_secs(61 - into)).await;
    let next = unix_minute();
    let answers =
        futures_util::future::join_all(b.replicas.iter().map(|s| load(s.grpc_url(), 1_000, "4s")))
            .await;
    assert_eq!(unix_minute(), next, "one window");
    let again: u64 = answers.iter().map(|r| r.0).sum();
    assert!(
        again <= LIMIT && again * 100 >= LIMIT * 95,
        "the next window's whole limit, for region B alone: {again} of {LIMIT}"
    );
}
