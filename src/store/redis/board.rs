//! The demand board on Redis (see `store::demand`): a hash beside the counter, in its Cluster
//! slot, read and written by `board.lua` in one atomic call, so every replica's streams share
//! one board per counter.

use super::cluster::Cluster;
use super::conn::{Conn, Manager};
use super::{batch::single_connection, keys, Common};
use crate::store::demand::{DemandBoard, Posting, MAX_POSTINGS_PER_BOARD};
use crate::store::{BoxFuture, CounterKey, StoreError};
use redis::Script;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

static BOARD_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("board.lua")));

/// The Redis key of `key`'s board: the counter's key and a suffix no counter key ends with (a
/// counter key ends in its limit, which sluice writes).
pub fn board_key(prefix: &str, key: &CounterKey) -> String {
    let mut k = keys::counter_key(prefix, key);
    k.push_str("#rlqs");
    k
}

/// Where the board's calls get a connection: the standalone pool, or the Cluster client.
#[derive(Clone)]
pub(super) enum Source {
    Pool(bb8::Pool<Manager>),
    Cluster(Arc<Cluster>),
}

/// Demand boards in the Redis the counters live in.
pub struct RedisBoard {
    pub(super) common: Arc<Common>,
    pub(super) source: Source,
}

impl std::fmt::Debug for RedisBoard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBoard")
            .field("prefix", &self.common.prefix)
            .finish_non_exhaustive()
    }
}

impl RedisBoard {
    async fn connection(&self) -> Result<Conn, StoreError> {
        match &self.source {
            Source::Pool(p) => single_connection(p).await,
            Source::Cluster(c) => c.connection().await,
        }
    }

    /// One call on the key of hash tag `tag` (its Cluster slot is what its answer says the
    /// health of), within `REDIS_TIMEOUT`.
    pub(super) async fn call<T: redis::FromRedisValue + Send>(
        &self,
        tag: &str,
        run: impl AsyncFnOnce(&mut Conn) -> redis::RedisResult<T>,
    ) -> Result<T, StoreError> {
        self.call_within(tag, self.common.quick, run).await
    }

    /// [`RedisBoard::call`] within `bound` (at most what the connections themselves wait).
    pub(super) async fn call_within<T: redis::FromRedisValue + Send>(
        &self,
        tag: &str,
        bound: std::time::Duration,
        run: impl AsyncFnOnce(&mut Conn) -> redis::RedisResult<T>,
    ) -> Result<T, StoreError> {
        let call = async { self.connection().await?.query(run).await };
        let r = match tokio::time::timeout(bound, call).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Transient(format!(
                "Redis did not answer within {bound:?}"
            ))),
        };
        self.common.record_health(Some(keys::tag_slot(tag)), &r);
        r
    }

    async fn post_now(
        &self,
        key: &CounterKey,
        mine: &Posting,
        fresh: Duration,
    ) -> Result<Vec<Posting>, StoreError> {
        let now = self.common.time.now().as_millis();
        let fresh_ms = fresh.as_millis().max(1);
        let rate = mine
            .rate
            .map_or_else(|| "-".to_string(), |r| format!("{r:.3}"));
        let board = board_key(&self.common.prefix, key);
        let reply: Vec<String> = self
            .call(&keys::hash_tag(key), async |c| {
                let mut inv = BOARD_SCRIPT.key(&board);
                inv.arg(&*mine.stream)
                    .arg(&rate)
                    .arg(mine.reserved)
                    .arg(now.to_string())
                    .arg((now + fresh_ms).to_string())
                    .arg(fresh_ms.to_string())
                    .arg(MAX_POSTINGS_PER_BOARD);
                inv.invoke_async(c).await
            })
            .await?;
        Ok(reply
            .chunks_exact(3)
            .map(|l| Posting {
                stream: Arc::from(l[0].as_str()),
                rate: l[1].parse::<f64>().ok().filter(|r| r.is_finite()),
                reserved: l[2].parse().unwrap_or(0),
            })
            .collect())
    }
}

impl DemandBoard for RedisBoard {
    fn post<'a>(
        &'a self,
        key: &'a CounterKey,
        mine: &'a Posting,
        fresh: Duration,
    ) -> BoxFuture<'a, Result<Vec<Posting>, StoreError>> {
        Box::pin(self.post_now(key, mine, fresh))
    }

    fn withdraw<'a>(
        &'a self,
        key: &'a CounterKey,
        stream: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let board = board_key(&self.common.prefix, key);
            self.call(&keys::hash_tag(key), async |c| {
                redis::cmd("HDEL")
                    .arg(&board)
                    .arg(stream)
                    .query_async::<()>(c)
                    .await
            })
            .await
        })
    }
}
