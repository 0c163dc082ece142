//! A global limit's refill capped at home (`FairAsk`, `CounterStore::grant_fair`): on a real
//! Redis and a real 3-master Cluster the script computes the region's max-min share from the
//! regions' reports in the same call as the charge; it must be the share `fair.rs` computes
//! (`share_left`) on the same reports, at the same time, for random boards (fresh, stale,
//! short, idle, from a release before fairness, and this region's own report, which is not
//! another's claim), and the charge must be the ask capped at it, all or nothing. The memory
//! board's composition (`grant_on_board`, the models' home) is held to the same.

use crate::cases::store::redis_settings;
use crate::support::redis::{start_cluster, start_redis};
use crate::support::{Rng, T0};
use sluice::clock::ManualClock;
use sluice::config::{Limit, Unit};
use sluice::store::global::{
    grant_on_board, share_left, Demand, FairAsk, MemoryBoard, RegionBoard, RegionReport,
};
use sluice::store::memory::MemoryStore;
use sluice::store::redis::{RedisKind, RedisStore};
use sluice::store::{CounterStore, LimitCheck};
use std::sync::Arc;
use std::time::Duration;

const LIMIT: u32 = 30_000;
/// Random boards per store.
const CASES: u64 = 60;

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
    let at = now_ms - rng.below(25_000);
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

/// The store and board under test, with what keeps their servers alive.
async fn home(
    kind: &str,
    clock: &ManualClock,
) -> (
    Arc<dyn CounterStore>,
    Arc<dyn RegionBoard>,
    Box<dyn std::any::Any>,
) {
    let redis = |urls: Vec<String>, kind: RedisKind| {
        RedisStore::new(&redis_settings(urls, kind))
            .expect("redis store")
            .with_test_clock(Arc::new(clock.clone()))
    };
    match kind {
        "redis" => {
            let server = start_redis(&[]).await;
            let store = redis(vec![server.url()], RedisKind::Single);
            let board = Arc::new(store.regions());
            (Arc::new(store), board, Box::new(server))
        }
        "cluster" => {
            let cluster = start_cluster().await;
            let store = redis(cluster.seeds(), RedisKind::Cluster);
            let board = Arc::new(store.regions());
            (Arc::new(store), board, Box::new(cluster))
        }
        _ => {
            let store = Arc::new(MemoryStore::new(Arc::new(clock.clone())));
            (store, Arc::new(MemoryBoard::default()), Box::new(()))
        }
    }
}

async fn capped_at_the_share_fair_rs_computes(kind: &str) {
    let clock = ManualClock::new(T0 + Duration::from_secs(20));
    let now_ms = u64::try_from((T0 + Duration::from_secs(20)).as_millis()).expect("in range");
    let end_ms = u64::try_from(T0.as_millis()).expect("in range") + 60_000;
    let window_ms = u64::try_from(T0.as_millis()).expect("in range");
    let (store, board, _keep) = home(kind, &clock).await;
    let memory_board = Arc::new(MemoryBoard::default());
    let (mut capped, mut zero, mut denied) = (0, 0, 0);
    for case in 0..CASES {
        let mut rng = Rng::new(0xFA1 + case);
        let value = format!("case{case}");
        let check = grant(&value, 1);
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
        // What home already granted, what this region was granted, what it asks.
        let used = rng.below(u64::from(LIMIT) + 1);
        if used > 0 {
            let d = store.decide(&[grant(&value, used)]).await.expect("charge");
            assert!(
                d.admitted,
                "{kind} case {case}: the premise charge of {used}"
            );
        }
        let ask = FairAsk {
            region: "here".into(),
            mine: rng.below(12_000),
            end_ms,
        };
        let want = 1 + rng.below(12_000);
        let got = if kind == "memory" {
            grant_on_board(&*store, &memory_board, &grant(&value, want), &ask, now_ms).await
        } else {
            store.grant_fair(&grant(&value, want), &ask).await
        };
        let got = got.expect("home answers").expect("home caps");
        let others: Vec<RegionReport> = reports[1..].to_vec();
        let share = share_left(u64::from(LIMIT), ask.mine, &others, now_ms, end_ms);
        let expected = want.min(share);
        let fits = used + expected <= u64::from(LIMIT);
        if share == 0 {
            zero += 1;
            assert_eq!(got.hits, 0, "{kind} case {case}: share 0, {got:?}");
            assert!(
                got.outcome.is_none(),
                "{kind} case {case}: share 0 charged {got:?}"
            );
        } else {
            capped += u64::from(expected < want);
            denied += u64::from(!fits);
            assert_eq!(
                got.hits, expected,
                "{kind} case {case}: asked {want}, share {share} ({reports:?}, mine {})",
                ask.mine
            );
            let o = got.outcome.expect("charged or denied");
            assert_eq!(
                o.allowed, fits,
                "{kind} case {case}: {used} used + {expected}"
            );
            assert_eq!(
                u64::from(o.remaining),
                u64::from(LIMIT) - used - if fits { expected } else { 0 },
                "{kind} case {case}"
            );
        }
        // The counter holds the charge and nothing else (all or nothing).
        let after = store.decide(&[grant(&value, 0)]).await.expect("read");
        let charged = if share > 0 && fits { expected } else { 0 };
        assert_eq!(
            u64::from(after.outcomes[0].remaining),
            u64::from(LIMIT) - used - charged,
            "{kind} case {case}: the home counter"
        );
    }
    eprintln!("{kind}: {CASES} boards, {capped} capped, {zero} at a share of 0, {denied} denied");
    // The random boards reach every branch.
    assert!(
        capped > 0 && zero > 0 && denied > 0,
        "{kind}: {capped}/{zero}/{denied}"
    );
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
