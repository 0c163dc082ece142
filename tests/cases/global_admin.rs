//! Operators see and steer a global limit across regions, through `sluice admin` against real
//! processes: a home `redis-server`, two regions each with its own `redis-server` and one
//! `sluice`, each 25 ms from home each way through a test-owned link.
//!
//! - Inspect on either region shows the home counter's usage and every region's pool, and
//!   what the pools account for (`pool + taken`, each region's share of home's grants) adds up
//!   to the home counter.
//! - A reset through region A zeroes the home counter and empties region B's pool too: what
//!   the regions admit after it never exceeds the limit (a pool kept, or given back home on
//!   top of the fresh count, would admit past it), and the home counter holds exactly that
//!   once the pools are back.
//! - Overrides set through region B are applied by both regions and decided there: a limit
//!   raised past the config (home at it) admits again in both; `--deny` denies in region A
//!   although the raised limit has room, with no home call per request; raised again, the two
//!   admit up to it and no further; removed, both deny again (home is past the config's limit).
//!
//! Nothing here is timed: the window is an hour long and a run starts early in one; what is
//! asserted are counts, waited for with `eventually`.

use super::global::{home_counters, load, region, write_config, Region, Store};
use crate::support::binary::bin;
use crate::support::redis::start_redis;
use crate::support::{eventually, poll_until};
use std::net::SocketAddr;
use std::time::Duration;

pub(crate) const LIMIT: u64 = 3_000;

/// A global 3 000 an hour: the test's steps take half a minute, all in one window.
pub(crate) fn config() -> String {
    format!(
        "domain: g\ncounting: all_or_nothing\ndescriptors:\n  - key: resource\n    value: api\n    \
         global: {{}}\n    rate_limit: {{unit: hour, requests_per_unit: {LIMIT}}}\n"
    )
}

/// Waits for the next hour when less than two minutes of this one are left (a wait, never a
/// measurement).
pub(crate) async fn early_in_an_hour() {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs();
    let into = now % 3600;
    if into + 120 >= 3600 {
        tokio::time::sleep(Duration::from_secs(3601 - into)).await;
    }
}

/// `sluice admin --url <region's first replica> ARGS`: its JSON, or a panic with its stderr.
async fn admin(r: &Region, args: &[&str]) -> serde_json::Value {
    let mut cmd = std::process::Command::new(bin());
    cmd.arg("admin").arg("--url").arg(r.replicas[0].admin_url());
    cmd.args(args).env_remove("SLUICE_ADMIN_TOKEN");
    let out = tokio::task::spawn_blocking(move || cmd.output().expect("run sluice admin"))
        .await
        .expect("join");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "sluice admin {args:?}: {stderr}");
    serde_json::from_str(&stdout).unwrap_or(serde_json::Value::Null)
}

/// The global limit as Inspect through `r` shows it: (home usage, [(region, pool, taken)]).
pub(crate) async fn inspect(r: &Region) -> (u64, Vec<(String, u64, u64)>) {
    let v = admin(r, &["inspect", "g", "resource=api"]).await;
    let limit = &v["limits"][0];
    // proto3 JSON: a uint64 is a string, an absent one is zero.
    let n = |x: &serde_json::Value| -> u64 {
        x.as_str()
            .and_then(|s| s.parse().ok())
            .or_else(|| x.as_u64())
            .unwrap_or(0)
    };
    let regions = limit["regions"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|p| {
                    let name = p["region"].as_str().unwrap_or("").to_string();
                    (name, n(&p["pool"]), n(&p["taken"]))
                })
                .collect()
        })
        .unwrap_or_default();
    (n(&limit["usage"]), regions)
}

/// Inspect through `r` until both regions are listed and their pools account for the home
/// counter (each region reports after its refills and give-backs, off the request path).
async fn pools_account_for_home(r: &Region, what: &str) -> u64 {
    poll_until(what, || async {
        let (usage, regions) = inspect(r).await;
        let names: Vec<&str> = regions.iter().map(|(n, _, _)| n.as_str()).collect();
        let held: u64 = regions.iter().map(|(_, pool, taken)| pool + taken).sum();
        if names == ["a", "b"] && held == usage {
            Ok(usage)
        } else {
            Err((usage, regions))
        }
    })
    .await
}

/// Both regions loaded at `rate` a second each for `duration`: (admitted, denied).
async fn both(regions: &[Region], rate: u32, duration: &str) -> (u64, u64) {
    let runs = regions
        .iter()
        .map(|r| load(r.replicas[0].grpc_url(), rate, duration));
    let answers = futures_util::future::join_all(runs).await;
    answers
        .iter()
        .fold((0, 0), |(ok, over), a| (ok + a.0, over + a.1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_see_every_regions_pool_and_resets_and_overrides_reach_every_region() {
    let (home, ra, rb) = tokio::join!(start_redis(&[]), start_redis(&[]), start_redis(&[]));
    let (_dir, path) = write_config(&config());
    let home_addr = SocketAddr::from(([127, 0, 0, 1], home.port()));
    let delay = Duration::from_millis(25);
    let (a, b) = (Store::Single(ra), Store::Single(rb));
    let regions = vec![
        region("a", &a, home_addr, delay, &path, 1).await,
        region("b", &b, home_addr, delay, &path, 1).await,
    ];
    early_in_an_hour().await;

    // Both regions spend part of the limit: each region's pool shows in Inspect, from either.
    let (before, _) = both(&regions, 300, "2s").await;
    assert!(before > 0 && before <= LIMIT, "{before}");

    // A reset through region A, at once (the pools still hold what they were refilled with).
    admin(
        &regions[0],
        &["reset", "g", "resource=api", "--reason", "test"],
    )
    .await;
    eventually(
        "every replica applies the reset recorded at home",
        || async {
            regions.iter().all(|r| {
                r.replicas
                    .iter()
                    .all(|s| s.log().contains("a reset at home"))
            })
        },
    )
    .await;
    for r in &regions {
        for s in &r.replicas {
            let log = s.log();
            let line = log.lines().rev().find(|l| l.contains("a reset at home"));
            eprintln!("{}", line.unwrap_or_default());
        }
    }

    // After it, both regions offered ~3x the limit: never more than the limit admitted (what
    // the pools held before the reset is not spent, nor given back onto the fresh count).
    let (after, denied) = both(&regions, 1_500, "3s").await;
    eprintln!("before the reset {before} admitted; after it {after} admitted, {denied} denied");
    assert!(
        after <= LIMIT,
        "{after} admitted after the reset, past {LIMIT}"
    );
    assert!(
        denied > 0,
        "the load after the reset was meant to reach the limit"
    );
    let usage = pools_account_for_home(&regions[1], "the pools account for home").await;
    assert!(usage >= after, "home {usage} < admitted {after}");
    let (usage_a, _) = inspect(&regions[0]).await;
    assert_eq!(usage_a, usage, "both regions read one home counter");

    // Once the pools are back home, the home counter holds what was admitted since the reset.
    poll_until("home holds what was admitted since the reset", || async {
        let counters = home_counters(&home);
        if counters.iter().map(|(_, v)| *v).sum::<u64>() == after {
            Ok(())
        } else {
            Err(counters)
        }
    })
    .await;

    // Overrides set through region B reach region A, and are decided in the regions. Home is
    // at the config's limit: raised past it, both regions admit again.
    let raised = 2 * LIMIT; // the `--limit 6000` below
    let set = |limit: &'static [&'static str]| {
        let mut args = vec!["override", "set", "g", "resource=api", "--ttl", "600s"];
        args.extend_from_slice(limit);
        args
    };
    for r in &regions {
        eventually("each region denies at the config's limit", || async {
            load(r.replicas[0].grpc_url(), 20, "1s").await.0 == 0
        })
        .await;
    }
    admin(&regions[1], &set(&["--limit", "6000"])).await;
    for r in &regions {
        eventually("each region applies the raised override", || async {
            load(r.replicas[0].grpc_url(), 20, "1s").await.0 > 0
        })
        .await;
    }
    // Part of the raise spent, room left under it; then `deny` through B: region A denies
    // although the raised limit has room, at once from the region (decided at home, each
    // request would be a home call).
    let (spent, _) = both(&regions, 200, "1s").await;
    assert!(spent > 0, "the raised limit admitted nothing");
    admin(&regions[1], &set(&["--deny"])).await;
    eventually("region A applies the deny set through region B", || async {
        load(regions[0].replicas[0].grpc_url(), 20, "1s").await.0 == 0
    })
    .await;
    let calls = home.evalsha_calls();
    let (ok, denied) = load(regions[0].replicas[0].grpc_url(), 200, "1s").await;
    let calls = home.evalsha_calls() - calls;
    assert_eq!(ok, 0, "admitted under a deny override");
    assert!(
        calls * 10 < denied,
        "{calls} home calls for {denied} requests denied by an override: decided at home"
    );

    // Raised again: both regions admit up to the override, no further, and still decide in
    // the region (a refill now and then, not a home call each).
    admin(&regions[1], &set(&["--limit", "6000"])).await;
    for r in &regions {
        eventually("each region applies the raised override again", || async {
            load(r.replicas[0].grpc_url(), 20, "1s").await.0 > 0
        })
        .await;
    }
    let calls = home.evalsha_calls();
    let (more, denied) = both(&regions, 1_500, "3s").await;
    let calls = home.evalsha_calls() - calls;
    let usage = pools_account_for_home(&regions[0], "the pools account for home, raised").await;
    eprintln!(
        "raised to {raised}: {more} more admitted, {denied} denied, {calls} home calls; home \
         {usage}"
    );
    assert!(usage <= raised, "home {usage} past the override {raised}");
    assert!(denied > 0, "the load was meant to reach the override");
    assert!(
        calls * 20 < more + denied,
        "{calls} home calls for {} decisions under an override",
        more + denied
    );

    // Removed: back to the config's limit (home is past it): both regions deny, their slices
    // and pools granted on the override given back.
    admin(&regions[1], &["override", "delete", "g", "resource=api"]).await;
    for r in &regions {
        eventually("each region applies the override's removal", || async {
            load(r.replicas[0].grpc_url(), 20, "1s").await.0 == 0
        })
        .await;
    }
}
