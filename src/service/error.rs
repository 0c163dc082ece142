//! Why a request got no decision. Mapped to a gRPC status in `server::grpc` and to an HTTP
//! status in `server::http`, each at its own edge.

use crate::store::StoreError;

/// Why a request got no decision.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Config comes over xDS and none has been accepted yet.
    #[error("no rate limit configuration loaded yet (waiting for the xDS server)")]
    NoConfig,
}
