//! The store stack `serve` runs on Redis, built in one place: the Redis store, the circuit
//! breaker in front of it and, when configured, the local deny cache in front of that.

use super::breaker::{BreakerSettings, CircuitBreaker};
use super::local_cache::LocalDenyCache;
use super::redis::{RedisSettings, RedisStore};
use super::{CounterStore, StoreError};
use crate::clock::Clock;
use std::sync::Arc;

/// The Redis counter store as `serve` stacks it: [`RedisStore`], behind a [`CircuitBreaker`]
/// (so a dead Redis is answered at once instead of after a timeout per request), behind a
/// [`LocalDenyCache`] when `local_cache_bytes` > 0 (so known-full counters cost no Redis call,
/// even while Redis is down).
#[derive(Debug, Clone)]
pub struct StoreChain {
    pub redis: RedisSettings,
    pub breaker: BreakerSettings,
    /// `LOCAL_CACHE_SIZE_IN_BYTES`; 0 leaves the cache out.
    pub local_cache_bytes: usize,
}

impl StoreChain {
    /// Builds the stack without touching the network (Redis connects on first use). `clock`
    /// drives the breaker's open timer and the deny cache's expiry. Must run inside a Tokio
    /// runtime (the connection pool is created here).
    pub fn build(&self, clock: Arc<dyn Clock>) -> Result<Arc<dyn CounterStore>, StoreError> {
        let redis: Arc<dyn CounterStore> = Arc::new(RedisStore::new(&self.redis)?);
        let breaker: Arc<dyn CounterStore> =
            Arc::new(CircuitBreaker::new(redis, self.breaker, Arc::clone(&clock)));
        if self.local_cache_bytes == 0 {
            return Ok(breaker);
        }
        Ok(Arc::new(LocalDenyCache::new(
            breaker,
            self.local_cache_bytes,
            clock,
        )))
    }
}
