//! A home store's reset fences the counters it resets (`store/global/admin.rs`): a region's
//! refund of units its pool drained is refused at home, in the refund's own script call,
//! unless the pool was cleared for a reset record at or past the fence. Before, the refund
//! read the reset records first and refunded after: a reset landing between the two took
//! the refund off the fresh count (CI, stop 65: home 2 880 after 3 000 admitted since a
//! reset, so 120 more could be admitted past the limit).
//!
//! Against a real `redis-server` and a real 3-master Cluster, through the public store API:
//! charged before the reset, refunded after it from a pool not cleared since, the fresh
//! count is untouched; from a pool cleared for the reset, the refund applies; a counter no
//! reset reached takes refunds as before; a later reset never lowers a fence; a token
//! bucket is fenced as a window is.

use crate::cases::store::redis_settings;
use crate::support::redis::{start_cluster, start_redis};
use sluice::config::{Algorithm, Limit, Unit};
use sluice::store::admin::CounterAdmin;
use sluice::store::redis::{RedisKind, RedisStore};
use sluice::store::{CounterStore, LimitCheck};

/// `value`'s check on a global limit's home counter, as a region's refill (hits) or refund
/// (`back`) sends it: the window is today's (µs), pinned as leased windows are.
fn check(value: &str, limit: Limit, hits: u64, back: bool) -> LimitCheck {
    let mut c = LimitCheck::for_tests("g", value, limit, hits);
    c.refund = back;
    c.leased = true;
    if limit.algorithm == Algorithm::FixedWindow {
        let day = 86_400_000_000u64;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_micros();
        let start = u64::try_from(now).expect("µs fit") / day * day;
        c.window = Some((start, start + day));
    }
    c
}

/// What the counter holds: the limit less what a look (no hits) says is left.
async fn count(home: &RedisStore, value: &str, limit: Limit) -> u64 {
    let look = check(value, limit, 0, false);
    let d = home
        .decide(std::slice::from_ref(&look))
        .await
        .expect("look");
    u64::from(limit.requests_per_unit - d.outcomes[0].remaining)
}

async fn charge(home: &RedisStore, value: &str, limit: Limit, hits: u64) {
    let c = check(value, limit, hits, false);
    let d = home.decide(std::slice::from_ref(&c)).await.expect("charge");
    assert!(d.admitted, "{value}: {hits} charged");
}

async fn refund(home: &RedisStore, value: &str, limit: Limit, units: u64, cleared: u64) -> bool {
    let back = check(value, limit, units, true);
    home.refund_fenced(&back, cleared).await.expect("refund")
}

async fn fences_hold(home: &RedisStore, limit: Limit) {
    let admin = home.admin();
    let prefix = |v: &str| vec![("k".to_string(), v.to_string())];
    // Charged on the old count; a pool of the region holds 40 of it when the reset comes.
    charge(home, "acme", limit, 100).await;
    charge(home, "other", limit, 50).await;
    let fence = 7;
    admin
        .reset_fenced("g", &prefix("acme"), false, fence)
        .await
        .expect("reset");
    assert_eq!(
        count(home, "acme", limit).await,
        0,
        "the reset took the count"
    );
    // The regions spend afresh, then the pool's refund from before the reset lands.
    charge(home, "acme", limit, 30).await;
    assert!(!refund(home, "acme", limit, 40, 0).await, "refused");
    assert!(!refund(home, "acme", limit, 40, fence - 1).await, "refused");
    assert_eq!(
        count(home, "acme", limit).await,
        30,
        "the fresh count whole"
    );
    // A pool cleared for the reset (the record after it) refunds what it holds.
    assert!(refund(home, "acme", limit, 10, fence).await, "applied");
    assert_eq!(count(home, "acme", limit).await, 20);
    // No reset reached this counter: its refunds apply, whatever the pool's clears.
    assert!(refund(home, "other", limit, 20, 0).await, "applied");
    assert_eq!(count(home, "other", limit).await, 30);
    // An older reset's fence never lowers a newer one.
    admin
        .reset_fenced("g", &prefix("acme"), false, 3)
        .await
        .expect("reset");
    charge(home, "acme", limit, 5).await;
    assert!(!refund(home, "acme", limit, 5, 5).await, "refused at 7");
    assert_eq!(count(home, "acme", limit).await, 5);
    // A reset without a fence (a region's own store) leaves none.
    admin
        .reset("g", &prefix("other"), false)
        .await
        .expect("reset");
    charge(home, "other", limit, 8).await;
    assert!(refund(home, "other", limit, 3, 0).await, "applied");
    assert_eq!(count(home, "other", limit).await, 5);
}

fn bucket() -> Limit {
    let mut l = Limit::fixed(1_000, Unit::Day);
    l.algorithm = Algorithm::TokenBucket;
    l.burst = 999;
    l
}

#[tokio::test]
async fn a_refund_landing_after_a_reset_never_comes_off_the_fresh_count() {
    let server = start_redis(&[]).await;
    let home = RedisStore::new(&redis_settings(vec![server.url()], RedisKind::Single))
        .expect("home store");
    fences_hold(&home, Limit::fixed(1_000, Unit::Day)).await;
    server.cli(&["FLUSHALL"]);
    fences_hold(&home, bucket()).await;
}

#[tokio::test]
async fn a_refund_landing_after_a_reset_is_fenced_on_a_cluster_too() {
    let cluster = start_cluster().await;
    let home =
        RedisStore::new(&redis_settings(cluster.seeds(), RedisKind::Cluster)).expect("home store");
    fences_hold(&home, Limit::fixed(1_000, Unit::Day)).await;
}
