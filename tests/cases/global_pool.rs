//! A region's pool of a global limit on real Redis and a real 3-master Cluster (`pool.lua`)
//! against the embedded [`MemoryPool`]: the same random operations on several windows' pools of
//! two limits give the same answers. One pool per window: operations on the next window's pool
//! leave the current one's whole (before, one pool per limit moved on and forgot the current
//! window's units). Times are left out (leases long, drains not waiting on idleness): what is
//! compared is what each operation did and left.

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
fn seen(st: &PoolState) -> (u64, u64, u64, bool, u64, bool) {
    (
        st.ok,
        st.have,
        st.taken,
        st.locked,
        st.last_fill,
        st.dry_until > st.now,
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
        let op = match rng.below(7) {
            0 | 1 => PoolOp::Take(rng.below(12)),
            2 => PoolOp::Give(rng.below(8)),
            3 => PoolOp::Lock {
                token,
                lease_ms: 600_000,
            },
            4 | 5 => PoolOp::Fill {
                units: rng.below(30),
                token,
                dry_ms: if rng.below(5) == 0 { 600_000 } else { 0 },
            },
            _ => PoolOp::Drain { idle_ms: 0 },
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
