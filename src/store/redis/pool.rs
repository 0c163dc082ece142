//! A region's pools of global limits on Redis (see `store::global`): a hash beside the limit's
//! regional key, in its Cluster slot, changed by `pool.lua` in one atomic call on the Redis
//! server clock.

use super::board::RedisBoard;
use super::keys;
use crate::store::global::{PoolOp, PoolState, RegionPool};
use crate::store::{BoxFuture, CounterKey, StoreError};
use redis::Script;
use std::sync::LazyLock;

static POOL_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("pool.lua")));

/// The Redis key of `key`'s pool for the window starting at `window_ms`: the counter's key and
/// a suffix no counter key ends with (a counter key ends in its limit, which sluice writes).
/// One pool per window: the next window's is filled while the current one still serves.
pub fn pool_key(prefix: &str, key: &CounterKey, window_ms: u64) -> String {
    keys::window_key(prefix, key, "pool", window_ms)
}

/// The pools in the region's Redis, on its connections. A pool call waits up to the store's
/// decision bound (`REDIS_TIMEOUT`, or the patience of a store built with
/// [`RedisStore::patient`](super::RedisStore::patient), as global limits' pools are: no
/// request waits on these calls, and a reply given up on while Redis still runs the call
/// would lose the units it moved).
#[derive(Debug)]
pub struct RedisPool {
    pub(super) board: RedisBoard,
    pub(super) stamp: crate::store::global::Stamp,
}

impl RegionPool for RedisPool {
    fn run<'a>(
        &'a self,
        key: &'a CounterKey,
        window_ms: u64,
        op: PoolOp,
        ttl_ms: u64,
    ) -> BoxFuture<'a, Result<PoolState, StoreError>> {
        Box::pin(async move {
            // ARGV[7]: a give's `cleared`, a fill's `fence`.
            let mark = match op {
                PoolOp::Give { cleared, .. } => cleared,
                PoolOp::Fill { fence, .. } => fence,
                _ => 0,
            };
            let (name, n, token, extra) = match op {
                PoolOp::Take(n) => ("take", n, 0, 0),
                PoolOp::Give { units, .. } => ("give", units, 0, 0),
                PoolOp::Lock { token, lease_ms } => ("lock", 0, token, lease_ms),
                PoolOp::Fill {
                    units,
                    token,
                    dry_ms,
                    ..
                } => ("fill", units, token, dry_ms),
                PoolOp::Drain { idle_ms } => ("drain", 0, 0, idle_ms),
                PoolOp::Trim { keep, have } => ("trim", keep, 0, have),
                PoolOp::Credit {
                    share,
                    token,
                    dry_ms,
                } => ("credit", share, token, dry_ms),
                PoolOp::Settle(n) => ("settle", n, 0, 0),
                PoolOp::Clear { seq, .. } => ("clear", seq, 0, op.keep_from()),
            };
            let pool = pool_key(&self.board.common.prefix, key, window_ms);
            let reply: Vec<i64> = self
                .board
                .call_within(&keys::hash_tag(key), self.board.common.timeout, async |c| {
                    let mut inv = POOL_SCRIPT.key(&pool);
                    inv.arg(name)
                        .arg(n)
                        .arg(token)
                        .arg(extra)
                        .arg(ttl_ms.max(1))
                        .arg(self.stamp.get())
                        .arg(mark);
                    inv.invoke_async(c).await
                })
                .await?;
            let at = |i: usize| reply.get(i).copied().unwrap_or(0);
            let u = |i: usize| u64::try_from(at(i)).unwrap_or(0);
            Ok(PoolState {
                ok: u(0),
                have: u(1),
                taken: u(2),
                dry_until: u(3),
                now: u(4),
                locked: at(5) == 1,
                last_fill: u(6),
                owed: u(7),
                last_take: u(8),
                cleared: u(9),
            })
        })
    }

    fn stamp(&self, seq: u64) {
        self.stamp.set(seq);
    }
}
