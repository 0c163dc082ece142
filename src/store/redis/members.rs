//! Replica heartbeats in Redis, for `FAILURE_MODE=local`: each replica that shares the store
//! beats every second into one small hash (`members.lua`), and learns how many replicas are
//! alive and its rank among them, which is how it splits a limit when it must decide alone.

use super::board::RedisBoard;
use crate::store::fallback::{Membership, Roster};
use crate::store::{BoxFuture, StoreError};
use redis::Script;
use std::sync::LazyLock;
use std::time::Duration;

static MEMBERS_SCRIPT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("members.lua")));

/// Most replicas one hash keeps (a bound on the script's work, far above any deployment).
pub const MAX_REPLICAS: u32 = 1024;

/// The heartbeats' hash tag: one slot, whatever the counters' tags.
const TAG: &str = "sluice-replicas";

/// The heartbeats' hash in the Redis the counters live in (one Cluster slot).
pub struct RedisMembers {
    pub(super) board: RedisBoard,
}

impl std::fmt::Debug for RedisMembers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisMembers").finish_non_exhaustive()
    }
}

impl RedisMembers {
    fn key(&self) -> String {
        let prefix = &self.board.common.prefix;
        format!("{prefix}{{{TAG}}}")
    }

    async fn beat_now(&self, id: &str, lease: Duration) -> Result<Roster, StoreError> {
        let key = self.key();
        let lease_ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX).max(1);
        let reply: Vec<i64> = self
            .board
            .call(TAG, async |c| {
                let mut inv = MEMBERS_SCRIPT.key(&key);
                inv.arg(id).arg(lease_ms).arg(MAX_REPLICAS);
                inv.invoke_async(c).await
            })
            .await?;
        match reply.as_slice() {
            &[n, rank, 1] if n >= 1 && (0..n).contains(&rank) => Ok(Roster {
                replicas: u32::try_from(n).unwrap_or(MAX_REPLICAS),
                rank: Some(u32::try_from(rank).unwrap_or(0)),
            }),
            // The hash is full: this replica counts itself but has no place in the split.
            &[n, _, 0] => Ok(Roster {
                replicas: u32::try_from(n).unwrap_or(MAX_REPLICAS).saturating_add(1),
                rank: None,
            }),
            other => Err(StoreError::Permanent(format!(
                "members.lua returned {other:?}"
            ))),
        }
    }
}

impl Membership for RedisMembers {
    fn beat<'a>(
        &'a self,
        id: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Roster, StoreError>> {
        Box::pin(self.beat_now(id, lease))
    }
}
