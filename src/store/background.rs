//! Where a store layer's own tasks run: a slice's refill, a give-back, a pool's drain. Why not
//! `tokio::spawn`: a request is decided on the serving thread that accepted its connection, and
//! each serving thread but the first has a runtime of its own (`server/workers.rs`) that ends
//! at shutdown, cancelling what still runs on it. A refill cancelled there loses what the store
//! granted it, and a give-back waiting for it waits in vain (the give-back at SIGTERM once gave
//! nothing back for that). So a layer keeps the runtime it was built on (the process's first:
//! a serving thread too, but the one that runs the shutdown and outlives the others) and starts
//! its tasks there, as the Redis store does its batcher. A task started there is also one
//! that never carries a timer or socket of a serving thread's runtime: it is built there.

use std::future::Future;
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

/// The runtime a layer was built on (the caller's when it was built outside one).
#[derive(Debug, Clone)]
pub struct Background(Option<Handle>);

impl Background {
    /// The runtime of the caller (none outside a runtime: tasks then start on the runtime of
    /// whoever starts them).
    pub fn here() -> Self {
        Self(Handle::try_current().ok())
    }

    /// Starts `task` on the layer's runtime; `None` when there is no runtime at all.
    pub fn spawn<F>(&self, task: F) -> Option<JoinHandle<F::Output>>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let rt = self.0.clone().or_else(|| Handle::try_current().ok())?;
        Some(rt.spawn(task))
    }
}
