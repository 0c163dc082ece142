//! The store stack `serve` runs on Redis, built in one place: the Redis store, the circuit
//! breaker in front of it and, when configured, the local deny cache in front of that, each
//! reporting to the stack's [`StoreSignals`].

use super::breaker::{BreakerSettings, CircuitBreaker};
use super::fallback::{LocalFallback, LocalSettings, Membership};
use super::local_cache::LocalDenyCache;
use super::redis::{RedisKind, RedisSettings, RedisStore};
use super::{CounterStore, DenialFinality, StoreError, StoreSignals, StoreStack, WriteBack};
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
    /// `FAILURE_MODE=local`: the layer that decides when the store cannot, on top.
    pub local: Option<LocalChain>,
}

/// `FAILURE_MODE=local`'s part of the stack.
#[derive(Debug, Clone, Copy)]
pub struct LocalChain {
    pub settings: LocalSettings,
    /// `LOCAL_STORE_PATIENCE`: how long a decision's script call may take (see
    /// [`RedisStore::patient`]).
    pub patience: std::time::Duration,
}

impl StoreChain {
    /// Builds the stack without touching the network (Redis connects on first use). `clock`
    /// drives the breaker's open timer and the deny cache's expiry. Must run inside a Tokio
    /// runtime (the connection pool is created here).
    pub fn build(&self, clock: Arc<dyn Clock>) -> Result<StoreStack, StoreError> {
        let signals = StoreSignals::new(self.redis.kind.backend_name());
        let redis = match &self.local {
            Some(l) => RedisStore::patient(&self.redis, l.patience)?,
            None => RedisStore::new(&self.redis)?,
        }
        .reporting_to(&signals);
        let board: Arc<dyn super::demand::DemandBoard> = Arc::new(redis.board());
        let admin: Arc<dyn super::admin::CounterAdmin> = Arc::new(redis.admin());
        let members: Arc<dyn Membership> = Arc::new(redis.members());
        let pool: Arc<dyn super::global::RegionPool> = Arc::new(redis.pool());
        // Under FAILURE_MODE=local a Cluster has no breaker: one slot's master failing must not
        // send the other slots' counters local (each request meets its own slots' health, and
        // the local layer bounds its wait).
        let store: Arc<dyn WriteBack> = match (&self.local, self.redis.kind) {
            (Some(_), RedisKind::Cluster) => Arc::new(redis),
            _ => Arc::new(
                CircuitBreaker::new(redis, self.breaker, Arc::clone(&clock)).reporting_to(&signals),
            ),
        };
        let mut forget: Option<Arc<dyn super::admin::Forget>> = None;
        let store = if self.local_cache_bytes == 0 {
            store
        } else {
            // A Cluster request spanning slots charges each slot and undoes the charges if one
            // slot denies: only a domain kept in one slot has denials no such charge caused.
            let finality = match self.redis.kind {
                RedisKind::Cluster => DenialFinality::DomainTaggedOnly,
                RedisKind::Single | RedisKind::Sentinel => DenialFinality::Always,
            };
            let cache = Arc::new(LocalDenyCache::new(
                store,
                self.local_cache_bytes,
                Arc::clone(&clock),
                finality,
            ));
            forget = Some(Arc::clone(&cache) as Arc<dyn super::admin::Forget>);
            cache
        };
        // The local layer on top: what it decides alone is never cached as a store denial.
        let stack = |store: Arc<dyn CounterStore>, signals: StoreSignals| {
            let stack = StoreStack::new(store, signals)
                .with_board(Arc::clone(&board))
                .with_admin(Arc::clone(&admin))
                .with_pool(Arc::clone(&pool));
            match &forget {
                Some(f) => stack.with_forget(Arc::clone(f)),
                None => stack,
            }
        };
        let Some(l) = &self.local else {
            return Ok(stack(store, signals));
        };
        let layer = Arc::new(LocalFallback::new(
            store,
            Some(members),
            l.settings,
            clock,
            &signals,
        ));
        Ok(stack(Arc::clone(&layer) as Arc<dyn CounterStore>, signals).with_decider(layer))
    }
}
