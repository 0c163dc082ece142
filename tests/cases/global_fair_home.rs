//! A global limit's refill capped at home (`FairAsk`, `CounterStore::grant_fair`): on a real
//! Redis and a real 3-master Cluster the script computes the region's max-min share from the
//! regions' reports in the same call as the charge; it must be the share `fair.rs` computes
//! (`share_left`) on the same reports as `RegionReport::decode` reads them, at the same time,
//! for random boards (fresh, stale, stamped ahead of home's clock, short, idle, this region's
//! own report, which is not another's claim, and on Redis values written raw: a release before
//! fairness, and values decode reads otherwise or skips), under an admin override, and the
//! charge must be the ask capped at it, all or nothing (a share of 0: nothing charged, what home
//! has left answered). The memory board's composition (`grant_on_board`, the models' home) is
//! held to the same.

use crate::cases::store::redis_settings;
use crate::support::redis::{start_cluster, start_redis};
use crate::support::{Rng, T0};
use sluice::clock::ManualClock;
use sluice::config::{Limit, Unit};
use sluice::store::global::{
    grant_on_board, share_left, Demand, FairAsk, MemoryBoard, RegionBoard, RegionReport,
};
use sluice::store::memory::MemoryStore;
use sluice::store::redis::{regions_key, RedisKind, RedisStore};
use sluice::store::{CounterStore, LimitCheck};
use std::sync::Arc;
use std::time::Duration;

const LIMIT: u32 = 30_000;
/// Random boards per store.
const CASES: u64 = 120;

/// A charge of `hits` on the home counter of `value`'s global limit in the minute at `T0`, as
/// a refill's grant is (pinned to the window, all or nothing).
fn grant(value: &str, hits: u64) -> LimitCheck {
    let mut c = LimitCheck::for_tests("fair", value, Limit::fixed(LIMIT, Unit::Minute), hits);
    let start = u64::try_from(T0.as_micros()).expect("in range");
    c.window = Some((start, start + 60_000_000));
    c.leased = true;
    c
}

/// One random report of `region` at `now_ms`: fresh or stale, short or not, with a rate or
/// none, or a release before fairness (no demand: idle).
fn report(rng: &mut Rng, region: &str, now_ms: u64) -> RegionReport {
    let (pool, taken) = (rng.below(8_000), rng.below(8_000));
    // Up to 25 s old, or up to 3 s ahead of home's clock (a region's clock runs ahead).
    let at = now_ms - rng.below(25_000) + rng.below(3_000);
    let demand = match rng.below(4) {
        0 => Demand::IDLE,
        1 => Demand {
            per_ks: 1 + rng.below(400_000),
            short: true,
        },
        _ => Demand {
            per_ks: rng.below(400_000),
            short: false,
        },
    };
    RegionReport {
        region: region.to_string(),
        pool,
        taken,
        owed: rng.below(3),
        at_unix_ms: at,
        demand,
    }
}

/// Values written raw into the reports' hash (a release before fairness, and what decode reads
/// otherwise or skips), `{at}` the report's time.
const RAW: [&str; 9] = [
    "700 300 0 {at}",
    "700 300 0 {at} x 1",
    "700  300 0 {at} 5000 0",
    "+700 300 0 {at} 90000 1",
    "700 300 0 {at} 90000",
    "not a report",
    "0700 300 0 {at} 90000 2",
    "700 300 0 {at} 90000 1 extra",
    "99999999999999999999 1 0 {at} 0 0",
];

/// Writes a raw report value, on the backends that hold them as text.
type RawWriter = Box<dyn Fn(&str, &str, &str)>;

/// The store and board under test, a writer of raw values (none on memory), and what keeps
/// their servers alive.
async fn home(
    kind: &str,
    clock: &ManualClock,
) -> (
    Arc<dyn CounterStore>,
    Arc<dyn RegionBoard>,
    Option<RawWriter>,
    Box<dyn std::any::Any>,
) {
    let redis = |urls: Vec<String>, kind: RedisKind| {
        RedisStore::new(&redis_settings(urls, kind))
            .expect("redis store")
            .with_test_clock(Arc::new(clock.clone()))
    };
    match kind {
        "redis" => {
            let server = Arc::new(start_redis(&[]).await);
            let store = redis(vec![server.url()], RedisKind::Single);
            let board = Arc::new(store.regions());
            let s = Arc::clone(&server);
            let raw: RawWriter = Box::new(move |k, f, v| {
                s.cli(&["HSET", k, f, v]);
            });
            (Arc::new(store), board, Some(raw), Box::new(server))
        }
        "cluster" => {
            let cluster = Arc::new(start_cluster().await);
            let store = redis(cluster.seeds(), RedisKind::Cluster);
            let board = Arc::new(store.regions());
            let c = Arc::clone(&cluster);
            let raw: RawWriter = Box::new(move |k, f, v| {
                c.cli_cluster(&["HSET", k, f, v]);
            });
            (Arc::new(store), board, Some(raw), Box::new(cluster))
        }
        _ => {
            let store = Arc::new(MemoryStore::new(Arc::new(clock.clone())));
            (store, Arc::new(MemoryBoard::default()), None, Box::new(()))
        }
    }
}

async fn capped_at_the_share_fair_rs_computes(kind: &str) {
    let clock = ManualClock::new(T0 + Duration::from_secs(20));
    let now_ms = u64::try_from((T0 + Duration::from_secs(20)).as_millis()).expect("in range");
    let end_ms = u64::try_from(T0.as_millis()).expect("in range") + 60_000;
    let window_ms = u64::try_from(T0.as_millis()).expect("in range");
    let (store, board, raw, _keep) = home(kind, &clock).await;
    let memory_board = Arc::new(MemoryBoard::default());
    let (mut capped, mut zero, mut denied, mut raws, mut overridden) = (0, 0, 0, 0, 0);
    for case in 0..CASES {
        let mut rng = Rng::new(0xFA1 + case);
        let value = format!("case{case}");
        let mut check = grant(&value, 1);
        // This region's own report, and up to four others'.
        let mine_report = report(&mut rng, "here", now_ms);
        let mut reports = vec![mine_report];
        for r in 0..rng.below(5) {
            reports.push(report(&mut rng, &format!("r{r}"), now_ms));
        }
        for r in &reports {
            let b: &dyn RegionBoard = if kind == "memory" {
                &*memory_board
            } else {
                &*board
            };
            b.report(&check.key, window_ms, r, 120_000)
                .await
                .expect("report");
        }
        // Raw values, read at home as `RegionReport::decode` reads them.
        let mut others: Vec<RegionReport> = reports[1..].to_vec();
        if let Some(raw) = &raw {
            for n in 0..rng.below(3) {
                let at = (now_ms - rng.below(20_000)).to_string();
                let value = RAW[rng.below(RAW.len() as u64) as usize].replace("{at}", &at);
                let field = format!("raw{n}");
                let hash = regions_key("sluice_test:", &check.key, window_ms);
                raw(&hash, &field, &value);
                others.extend(RegionReport::decode(&field, &value));
                raws += 1;
            }
        }
        // What home already granted, what this region was granted, what it asks.
        let used = rng.below(u64::from(LIMIT) + 1);
        if used > 0 {
            let d = store.decide(&[grant(&value, used)]).await.expect("charge");
            assert!(
                d.admitted,
                "{kind} case {case}: the premise charge of {used}"
            );
        }
        // An admin override in force: the share and the charge are judged on it.
        let limit = if rng.below(4) == 0 {
            overridden += 1;
            let o = 1_000 + u32::try_from(rng.below(u64::from(LIMIT))).expect("small");
            check.admin_limit = Some(o);
            u64::from(o)
        } else {
            u64::from(LIMIT)
        };
        let ask = FairAsk {
            region: "here".into(),
            mine: if rng.below(10) == 0 {
                limit + rng.below(100)
            } else {
                rng.below(12_000)
            },
            end_ms,
        };
        let want = 1 + rng.below(12_000);
        check.hits = want;
        let got = if kind == "memory" {
            grant_on_board(&*store, &memory_board, &check, &ask, now_ms).await
        } else {
            store.grant_fair(&check, &ask).await
        };
        let got = got.expect("home answers").expect("home caps");
        let share = share_left(limit, ask.mine, &others, now_ms, end_ms);
        let expected = want.min(share);
        let fits = share > 0 && used + expected <= limit;
        let charged = if fits { expected } else { 0 };
        assert_eq!(
            got.hits, expected,
            "{kind} case {case}: asked {want}, share {share} (limit {limit}, mine {}, others \
             {others:?})",
            ask.mine
        );
        let o = got.outcome.expect("an answer");
        if share == 0 {
            zero += 1;
        } else {
            capped += u64::from(expected < want);
            denied += u64::from(!fits);
            assert_eq!(
                o.allowed, fits,
                "{kind} case {case}: {used} used + {expected}"
            );
        }
        assert_eq!(
            u64::from(o.remaining),
            limit.saturating_sub(used + charged),
            "{kind} case {case}: what home has left, answered"
        );
        // The counter holds the charge and nothing else (all or nothing).
        let after = store.decide(&[grant(&value, 0)]).await.expect("read");
        assert_eq!(
            u64::from(after.outcomes[0].remaining),
            u64::from(LIMIT).saturating_sub(used + charged),
            "{kind} case {case}: the home counter"
        );
    }
    eprintln!(
        "{kind}: {CASES} boards, {capped} capped, {zero} at a share of 0, {denied} denied, \
         {raws} raw values, {overridden} under an override"
    );
    // The random boards reach every branch.
    assert!(
        capped > 0 && zero > 0 && denied > 0 && overridden > 0,
        "{kind}"
    );
    assert!(raw.is_none() || raws >= 20, "{kind}: {raws} raw values");
}

#[tokio::test]
async fn a_refill_capped_at_home_on_redis_takes_the_share_fair_rs_computes() {
    capped_at_the_share_fair_rs_computes("redis").await;
}

#[tokio::test]
async fn a_refill_capped_at_home_on_a_cluster_takes_the_share_fair_rs_computes() {
    capped_at_the_share_fair_rs_computes("cluster").await;
}

#[tokio::test]
async fn a_refill_capped_on_a_memory_board_takes_the_share_fair_rs_computes() {
    capped_at_the_share_fair_rs_computes("memory").await;
}
