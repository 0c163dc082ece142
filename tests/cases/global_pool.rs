//! A region's pool of a global limit on real Redis and a real 3-master Cluster (`pool.lua`)
//! against the embedded [`MemoryPool`]: the same random operations on several windows' pools of
//! two limits give the same answers. One pool per window: operations on the next window's pool
//! leave the current one's whole (before, one pool per limit moved on and forgot the current
//! window's units). Credit while cut off from home (`GLOBAL_UNREACHABLE=share`) is at most the
//! window's share, and a pool that owes home is never drained. Times are left out (leases
//! long, drains not waiting on idleness): what is compared is what each operation did and left.

use crate::cases::store::redis_settings;
use crate::support::redis::{start_cluster, start_redis};
use crate::support::{Rng, T0};
use sluice::clock::ManualClock;
use sluice::config::{Limit, Unit};
use sluice::store::global::{MemoryPool, PoolOp, PoolState, RegionPool};
use sluice::store::redis::{RedisKind, RedisStore};
use sluice::store::{CounterKey, LimitCheck};
use std::sync::Arc;

fn key(value: &str) -> CounterKey {
    LimitCheck::for_tests("g", value, Limit::fixed(1_000, Unit::Minute), 1).key
}

/// What an operation did and left, without the pool's clock.
fn seen(st: &PoolState) -> (u64, u64, u64, bool, u64, bool, u64, u64) {
    (
        st.ok,
        st.have,
        st.taken,
        st.locked,
        st.last_fill,
        st.dry_until > st.now,
        st.owed,
        st.cleared,
    )
}

async fn same_as_memory(redis: &dyn RegionPool, seed: u64) {
    let memory = MemoryPool::new(Arc::new(ManualClock::new(T0)), 1_000);
    let mut rng = Rng::new(seed);
    let keys = [key("a"), key("b")];
    // Three windows a minute apart, on a prefix of their own per seed.
    let base = 1_000_000 * seed;
    let tokens = [11, 12, 13];
    for step in 0..400 {
        let k = &keys[rng.below(2) as usize];
        let w = base + 60_000 * rng.below(3);
        let token = tokens[rng.below(3) as usize];
        let op = match rng.below(10) {
            0 | 1 => PoolOp::Take(rng.below(12)),
            // A slice given back, taken after one of the resets (refused past its clear).
            2 => PoolOp::Give {
                units: rng.below(8),
                cleared: rng.below(4),
            },
            3 => PoolOp::Lock {
                token,
                lease_ms: 600_000,
            },
            // A refill, charged past one of home's fences (0: none, most of them).
            4 | 5 => PoolOp::Fill {
                units: rng.below(30),
                token,
                dry_ms: if rng.below(5) == 0 { 600_000 } else { 0 },
                fence: rng.below(6).saturating_sub(2),
            },
            6 if rng.below(2) == 0 => PoolOp::Drain { idle_ms: 0 },
            // Demand fell while home is nearly dry: the pool keeps a few units.
            6 => PoolOp::Trim {
                keep: rng.below(10),
                // As last seen, or not (a refill landed since: no trim).
                have: if rng.below(4) == 0 {
                    rng.below(30)
                } else {
                    memory
                        .run(k, w, PoolOp::Take(0), 600_000)
                        .await
                        .expect("look")
                        .have
                },
            },
            // A region cut off (`GLOBAL_UNREACHABLE=share`): credit at most the window's share
            // (the share asked varies: what was credited already counts), settled later.
            7 => PoolOp::Credit {
                share: rng.below(40),
                token,
                dry_ms: if rng.below(2) == 0 { 600_000 } else { 0 },
            },
            8 => PoolOp::Settle(rng.below(20)),
            // A reset at home: the pool counts afresh, once per record, unless cleared for
            // `keep_from` (a closing record's fence) already.
            _ => {
                let seq = rng.below(4);
                PoolOp::Clear {
                    seq,
                    keep_from: rng.below(seq + 1),
                }
            }
        };
        let m = memory.run(k, w, op, 600_000).await.expect("memory");
        let r = redis.run(k, w, op, 600_000).await.expect("redis");
        assert_eq!(
            seen(&r),
            seen(&m),
            "seed {seed}, step {step}: {op:?} on window {w} of {k:?}: Redis {r:?}, memory {m:?}"
        );
    }
}

#[tokio::test]
async fn pools_on_redis_and_on_a_cluster_answer_as_the_embedded_one() {
    let server = start_redis(&[]).await;
    let single = RedisStore::new(&redis_settings(vec![server.url()], RedisKind::Single))
        .expect("redis store")
        .pool();
    let cluster = start_cluster().await;
    let clustered = RedisStore::new(&redis_settings(cluster.seeds(), RedisKind::Cluster))
        .expect("cluster store")
        .pool();
    for seed in [1, 2, 3] {
        same_as_memory(&single, seed).await;
        same_as_memory(&clustered, seed + 10).await;
    }
}

#[tokio::test]
async fn the_next_windows_pool_leaves_the_current_ones_units_whole() {
    let server = start_redis(&[]).await;
    let redis = RedisStore::new(&redis_settings(vec![server.url()], RedisKind::Single))
        .expect("redis store")
        .pool();
    let memory = MemoryPool::new(Arc::new(ManualClock::new(T0)), 1_000);
    let k = key("api");
    for pool in [&redis as &dyn RegionPool, &memory] {
        let fill = |units| PoolOp::Fill {
            units,
            token: 1,
            dry_ms: 0,
            fence: 0,
        };
        pool.run(&k, 0, fill(100), 600_000).await.expect("fill");
        pool.run(&k, 0, PoolOp::Take(30), 600_000)
            .await
            .expect("take");
        // The next window's pool is filled and taken from ...
        pool.run(&k, 60_000, fill(50), 600_000).await.expect("next");
        pool.run(&k, 60_000, PoolOp::Take(5), 600_000)
            .await
            .expect("next take");
        // ... and the current one still holds its 70.
        let st = pool
            .run(&k, 0, PoolOp::Take(70), 600_000)
            .await
            .expect("take");
        assert_eq!((st.ok, st.have, st.taken), (1, 100, 100), "{pool:?}");
        let next = pool
            .run(&k, 60_000, PoolOp::Take(0), 600_000)
            .await
            .expect("look");
        assert_eq!((next.have, next.taken), (50, 5), "{pool:?}");
    }
}

/// A region cut off (`GLOBAL_UNREACHABLE=share`): however many replicas ask, a window's credit
/// is its share at most; a pool that owes home is not drained (credit refunded before it was
/// charged would leave home short) until it is settled; the lease is released by the credit.
#[tokio::test]
async fn credit_is_the_windows_share_at_most_and_a_pool_that_owes_is_never_drained() {
    let server = start_redis(&[]).await;
    let redis = RedisStore::new(&redis_settings(vec![server.url()], RedisKind::Single))
        .expect("redis store")
        .pool();
    let memory = MemoryPool::new(Arc::new(ManualClock::new(T0)), 1_000);
    let k = key("cut");
    for pool in [&redis as &dyn RegionPool, &memory] {
        let run = |op| pool.run(&k, 0, op, 600_000);
        let lock = PoolOp::Lock {
            token: 7,
            lease_ms: 600_000,
        };
        assert_eq!(run(lock).await.expect("lock").ok, 1, "{pool:?}");
        let credit = |token| PoolOp::Credit {
            share: 25,
            token,
            dry_ms: 600_000,
        };
        let st = run(credit(7)).await.expect("credit");
        assert_eq!((st.ok, st.have, st.owed), (25, 25, 25), "{pool:?}");
        assert!(!st.locked, "the credit released its lease: {pool:?}");
        assert!(st.dry_until > st.now, "dry after home did not answer");
        // Another replica, cut off too, asks again: the window's share is spent.
        let again = run(credit(8)).await.expect("credit again");
        assert_eq!((again.ok, again.have, again.owed), (0, 25, 25), "{pool:?}");
        run(PoolOp::Take(10)).await.expect("take");
        let drain = PoolOp::Drain { idle_ms: 0 };
        let owes = run(drain).await.expect("drain");
        assert_eq!(
            (owes.ok, owes.have, owes.owed),
            (0, 25, 25),
            "a pool that owes is not drained: {pool:?}"
        );
        let settled = run(PoolOp::Settle(25)).await.expect("settle");
        assert_eq!(settled.owed, 0, "{pool:?}");
        let drained = run(drain).await.expect("drain");
        assert_eq!((drained.ok, drained.have), (15, 10), "{pool:?}");
        // Settling more than is owed owes nothing (never below zero).
        let over = run(PoolOp::Settle(5)).await.expect("settle again");
        assert_eq!(over.owed, 0, "{pool:?}");
    }
}

/// The embedded pools' bound never drops a pool that gave credit (`GLOBAL_UNREACHABLE=share`):
/// a new pool of its key would give the window's share again, and what it owes home would never
/// be charged. Full of such pools, a new pool is refused (its grant is denied).
#[tokio::test]
async fn the_embedded_pools_never_drop_one_that_gave_credit() {
    let memory = MemoryPool::new(Arc::new(ManualClock::new(T0)), 2);
    let credit = PoolOp::Credit {
        share: 10,
        token: 1,
        dry_ms: 0,
    };
    let look = PoolOp::Take(0);
    let (a, b, c, d) = (key("a"), key("b"), key("c"), key("d"));
    assert_eq!(memory.run(&a, 0, credit, 600_000).await.expect("a").ok, 10);
    memory.run(&b, 0, look, 600_000).await.expect("b");
    // Full: b goes, not a.
    memory.run(&c, 0, look, 600_000).await.expect("c");
    let again = memory.run(&a, 0, credit, 600_000).await.expect("a again");
    assert_eq!(
        (again.ok, again.owed),
        (0, 10),
        "a kept its credit and its debt"
    );
    assert_eq!(memory.run(&c, 0, credit, 600_000).await.expect("c").ok, 10);
    // Full of pools that gave credit: a new one is refused.
    assert!(memory.run(&d, 0, look, 600_000).await.is_err());
    let a_now = memory.run(&a, 0, look, 600_000).await.expect("a");
    assert_eq!(a_now.owed, 10);
}

#[tokio::test]
async fn a_reset_clears_the_pool_once_keeps_the_refills_lease_and_lets_it_land() {
    let server = start_redis(&[]).await;
    let redis = RedisStore::new(&redis_settings(vec![server.url()], RedisKind::Single))
        .expect("redis store")
        .pool();
    let memory = MemoryPool::new(Arc::new(ManualClock::new(T0)), 1_000);
    let k = key("reset");
    for pool in [&redis as &dyn RegionPool, &memory] {
        let run = |op| pool.run(&k, 0, op, 600_000);
        let fill = |units, token| PoolOp::Fill {
            units,
            token,
            dry_ms: 0,
            fence: 0,
        };
        let clear = |seq, keep_from| PoolOp::Clear { seq, keep_from };
        run(fill(100, 1)).await.expect("fill");
        run(PoolOp::Take(30)).await.expect("take");
        let credit = PoolOp::Credit {
            share: 20,
            token: 0,
            dry_ms: 0,
        };
        assert_eq!(run(credit).await.expect("credit").ok, 20);
        let lock = PoolOp::Lock {
            token: 7,
            lease_ms: 600_000,
        };
        assert_eq!(run(lock).await.expect("lock").ok, 1);
        // 90 units dropped (100 + 20 credited - 30 taken); nothing taken or owed any more.
        let cleared = run(clear(5, 5)).await.expect("clear");
        assert_eq!(
            (
                cleared.ok,
                cleared.have,
                cleared.taken,
                cleared.owed,
                cleared.locked
            ),
            (90, 0, 0, 0, true),
            "{cleared:?}"
        );
        // A refund home of what the pool holds from now on shows the record it was cleared
        // for (`store/global/admin.rs`: home refuses one from before its reset).
        assert_eq!(cleared.cleared, 5, "{cleared:?}");
        // A slice given back from before the reset adds nothing; the refill under way lands.
        let give = |units, cleared| PoolOp::Give { units, cleared };
        let refused = run(give(10, 4)).await.expect("give");
        assert_eq!((refused.ok, refused.left()), (0, 0), "{refused:?}");
        let landed = run(fill(40, 7)).await.expect("fill");
        assert_eq!((landed.left(), landed.locked), (40, false), "{landed:?}");
        // Another replica of the region applies the same record: what the refill brought
        // from the fresh count stays; a later record clears again.
        let again = run(clear(5, 5)).await.expect("clear again");
        assert_eq!((again.ok, again.left()), (0, 40), "{again:?}");
        let older = run(clear(4, 4)).await.expect("an older record");
        assert_eq!((older.ok, older.left()), (0, 40), "{older:?}");
        run(PoolOp::Take(10)).await.expect("take");
        let next = run(clear(6, 6)).await.expect("the next record");
        assert_eq!(
            (next.ok, next.left(), next.taken, next.cleared),
            (30, 0, 0, 6),
            "{next:?}"
        );
        assert_eq!(
            older.cleared, 5,
            "an older record leaves the pool's clear as it was"
        );
        // The window's share was credited once already: a reset does not give it again.
        let again = PoolOp::Credit {
            share: 20,
            token: 0,
            dry_ms: 0,
        };
        assert_eq!(run(again).await.expect("credit").ok, 0);
        // A replica that applied record 9 creates a pool: it starts cleared for 9 (its units
        // are all granted after that reset, and home takes them back); one it finds is kept.
        pool.stamp(9);
        let fresh = pool.run(&k, 60_000, PoolOp::Take(0), 600_000).await;
        assert_eq!(fresh.expect("a new pool").cleared, 9);
        assert_eq!(run(PoolOp::Take(0)).await.expect("look").cleared, 6);
        assert_eq!(run(clear(9, 9)).await.expect("clear").cleared, 9);
        assert_eq!(run(clear(9, 9)).await.expect("again").ok, 0);
        // A refill charged after home's next reset (fenced at 12) lands in a pool cleared for
        // it (what it held was on the old count); that reset's closing record (13, its fence 12)
        // keeps it; a refill charged before that fence, landing late, brings nothing.
        run(fill(25, 12)).await.expect("fill");
        let fenced = run(PoolOp::Fill {
            units: 50,
            token: 12,
            dry_ms: 0,
            fence: 12,
        })
        .await
        .expect("a fenced fill");
        assert_eq!((fenced.left(), fenced.cleared), (50, 12), "{fenced:?}");
        let closing = run(clear(13, 12)).await.expect("the closing record");
        assert_eq!((closing.ok, closing.left()), (0, 50), "{closing:?}");
        let late = run(fill(30, 13)).await.expect("a late fill");
        assert_eq!((late.ok, late.left()), (0, 50), "{late:?}");
        let given = run(give(5, 12)).await.expect("give");
        assert_eq!(
            given.ok, 1,
            "a slice taken after the fence goes back: {given:?}"
        );
    }
}
