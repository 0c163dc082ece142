//! The regions' reports of their pools at home (see `store::global::regions`): a hash per
//! global counter and window beside the home counter (its hash tag, its Cluster slot), one
//! field per region. Written by a script (`HSET` and its expiry in one call, answering every
//! region's report), read with one `HGETALL`: a region is a deployment, so the hash holds a
//! handful of fields.

use super::board::RedisBoard;
use super::keys;
use crate::store::global::{RegionBoard, RegionReport, MAX_REGIONS};
use crate::store::{BoxFuture, CounterKey, StoreError};
use redis::Script;
use std::sync::LazyLock;

static REPORT_SCRIPT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
-- KEYS[1] the regions' reports of one counter's window; ARGV: region, report, ttl (ms).
-- Answers every region's report (the board the next refill is sized on).
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return redis.call('HGETALL', KEYS[1])
",
    )
});

/// The Redis key of the reports for `key`'s window starting at `window_ms`: the counter's key
/// and a suffix no counter key ends with (a counter key ends in its limit, which sluice writes).
pub fn regions_key(prefix: &str, key: &CounterKey, window_ms: u64) -> String {
    keys::window_key(prefix, key, "regions", window_ms)
}

/// The Redis key of the mark a region short of units leaves for `key`'s window: beside the
/// reports, in their slot.
pub fn short_key(prefix: &str, key: &CounterKey, window_ms: u64) -> String {
    keys::window_key(prefix, key, "short", window_ms)
}

fn decode_all(all: &[(String, String)]) -> Vec<RegionReport> {
    all.iter()
        .filter_map(|(region, value)| RegionReport::decode(region, value))
        .take(MAX_REGIONS)
        .collect()
}

/// The reports in the home store, on its connections.
#[derive(Debug)]
pub struct RedisRegions {
    pub(super) board: RedisBoard,
}

impl RegionBoard for RedisRegions {
    fn report<'a>(
        &'a self,
        key: &'a CounterKey,
        window_ms: u64,
        report: &'a RegionReport,
        ttl_ms: u64,
    ) -> BoxFuture<'a, Result<Vec<RegionReport>, StoreError>> {
        Box::pin(async move {
            let hash = regions_key(&self.board.common.prefix, key, window_ms);
            let value = report.encode();
            let all: Vec<(String, String)> = self
                .board
                .call(&keys::hash_tag(key), async |c| {
                    let mut inv = REPORT_SCRIPT.key(&hash);
                    inv.arg(&report.region).arg(&value).arg(ttl_ms.max(1));
                    inv.invoke_async(c).await
                })
                .await?;
            Ok(decode_all(&all))
        })
    }

    fn read<'a>(
        &'a self,
        key: &'a CounterKey,
        window_ms: u64,
    ) -> BoxFuture<'a, Result<Vec<RegionReport>, StoreError>> {
        Box::pin(async move {
            let hash = regions_key(&self.board.common.prefix, key, window_ms);
            let all: Vec<(String, String)> = self
                .board
                .call(&keys::hash_tag(key), async |c| {
                    redis::cmd("HGETALL").arg(&hash).query_async(c).await
                })
                .await?;
            Ok(decode_all(&all))
        })
    }

    fn short<'a>(
        &'a self,
        key: &'a CounterKey,
        window_ms: u64,
        region: &'a str,
        ttl_ms: u64,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let mark = short_key(&self.board.common.prefix, key, window_ms);
            self.board
                .call(&keys::hash_tag(key), async |c| {
                    redis::cmd("SET")
                        .arg(&mark)
                        .arg(region)
                        .arg("PX")
                        .arg(ttl_ms.max(1))
                        .query_async::<()>(c)
                        .await
                })
                .await
        })
    }

    fn short_by<'a>(
        &'a self,
        key: &'a CounterKey,
        window_ms: u64,
    ) -> BoxFuture<'a, Result<Option<String>, StoreError>> {
        Box::pin(async move {
            let mark = short_key(&self.board.common.prefix, key, window_ms);
            self.board
                .call(&keys::hash_tag(key), async |c| {
                    redis::cmd("GET").arg(&mark).query_async(c).await
                })
                .await
        })
    }
}
