//! The rate-limit decision: validate a `RateLimitRequest`, resolve each descriptor to its limit on
//! one config snapshot, let the store decide all of them at once, and fold the outcomes into a
//! `RateLimitResponse`. STUB: being written.

use crate::config::RuleSet;
use crate::proto::{RateLimitRequest, RateLimitResponse};
use crate::store::{CounterStore, StoreError};
use std::sync::{Arc, RwLock};

/// Service-wide switches.
#[derive(Debug, Clone, Default)]
pub struct ServiceOptions {
    /// `SHADOW_MODE`: decide and count as usual, but always answer OK overall.
    pub global_shadow_mode: bool,
}

/// Why a request got no decision.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<RequestError> for tonic::Status {
    fn from(e: RequestError) -> Self {
        match e {
            RequestError::Invalid(m) => tonic::Status::invalid_argument(m),
            // Transient store failures are UNAVAILABLE so Envoy's failure_mode_deny decides;
            // permanent ones are INTERNAL: retrying the same request will not help.
            RequestError::Store(StoreError::Transient(m)) => tonic::Status::unavailable(m),
            RequestError::Store(StoreError::Permanent(m)) => tonic::Status::internal(m),
        }
    }
}

/// The decision engine shared by the gRPC and HTTP front ends.
#[derive(Debug)]
pub struct RateLimiter {
    rules: RwLock<Arc<RuleSet>>,
    store: Arc<dyn CounterStore>,
    options: ServiceOptions,
}

impl RateLimiter {
    pub fn new(rules: RuleSet, store: Arc<dyn CounterStore>, options: ServiceOptions) -> Self {
        Self {
            rules: RwLock::new(Arc::new(rules)),
            store,
            options,
        }
    }

    /// The current config snapshot.
    pub fn rules(&self) -> Arc<RuleSet> {
        self.rules
            .read()
            .map(|g| Arc::clone(&g))
            .unwrap_or_else(|e| Arc::clone(&e.into_inner()))
    }

    /// Swaps in a new config; requests already running keep the snapshot they started with.
    pub fn replace_rules(&self, rules: RuleSet) {
        let new = Arc::new(rules);
        match self.rules.write() {
            Ok(mut g) => *g = new,
            Err(e) => *e.into_inner() = new,
        }
    }

    pub fn store(&self) -> &Arc<dyn CounterStore> {
        &self.store
    }

    pub async fn should_rate_limit(
        &self,
        _request: RateLimitRequest,
    ) -> Result<RateLimitResponse, RequestError> {
        let _ = &self.options;
        Err(RequestError::Invalid("not implemented yet".into()))
    }
}
