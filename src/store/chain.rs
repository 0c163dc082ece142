//! The store stack `serve` runs on Redis, built in one place: the Redis store, the circuit
//! breaker in front of it and, when configured, the local deny cache in front of that, each
//! reporting to the stack's [`StoreSignals`].

use super::breaker::{BreakerSettings, CircuitBreaker};
use super::local_cache::LocalDenyCache;
use super::redis::{RedisKind, RedisSettings, RedisStore};
use super::{DenialFinality, StoreError, StoreSignals, StoreStack};
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
    pub fn build(&self, clock: Arc<dyn Clock>) -> Result<StoreStack, StoreError> {
        let signals = StoreSignals::new(self.redis.kind.backend_name());
        let redis = RedisStore::new(&self.redis)?.reporting_to(&signals);
        let board: Arc<dyn super::demand::DemandBoard> = Arc::new(redis.board());
        let breaker =
            CircuitBreaker::new(redis, self.breaker, Arc::clone(&clock)).reporting_to(&signals);
        if self.local_cache_bytes == 0 {
            return Ok(StoreStack {
                store: Arc::new(breaker),
                signals,
                demand: board,
            });
        }
        // A Cluster request spanning slots charges each slot and undoes the charges if one
        // slot denies: only a domain kept in one slot has denials no such charge caused.
        let finality = match self.redis.kind {
            RedisKind::Cluster => DenialFinality::DomainTaggedOnly,
            RedisKind::Single | RedisKind::Sentinel => DenialFinality::Always,
        };
        let cache = LocalDenyCache::new(breaker, self.local_cache_bytes, clock, finality);
        Ok(StoreStack {
            store: Arc::new(cache),
            signals,
            demand: board,
        })
    }
}
