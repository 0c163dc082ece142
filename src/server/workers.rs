//! Thread-per-core gRPC serving. Each serving thread runs its own single-threaded Tokio runtime
//! and accepts from the same listening socket, so a connection, its HTTP/2 streams and the
//! decisions made on them stay on one thread: no task moves between threads, no worker wakes
//! another, no work-stealing queue is touched per request. Measured against Tokio's
//! multi-threaded scheduler (docs/performance.md), this took server CPU per decision from
//! ~19 to ~14 µs on the embedded store and tightened the latency tail.
//!
//! The trade-off: a connection's requests are served by the thread that accepted it. Envoy opens
//! one HTTP/2 connection per worker thread to each rate-limit host, so a mesh spreads over the
//! threads; a single client holding a single connection uses a single core.

use std::io;
use std::thread;
use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// The extra serving threads (the caller's runtime serves too). Dropping it stops them: their
/// runtimes shut down, cancelling whatever still runs on them.
#[derive(Debug, Default)]
pub(crate) struct Workers {
    handles: Vec<Handle>,
    // Dropping a sender ends its thread's `block_on`.
    _stops: Vec<oneshot::Sender<()>>,
}

impl Workers {
    /// Starts `extra` threads, each parked on its own current-thread runtime until dropped.
    pub(crate) fn start(extra: usize) -> io::Result<Self> {
        let mut workers = Self::default();
        for index in 1..=extra {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let (stop, stopped) = oneshot::channel::<()>();
            workers.handles.push(runtime.handle().clone());
            thread::Builder::new()
                .name(format!("sluice-grpc-{index}"))
                .spawn(move || {
                    runtime.block_on(async {
                        let _ = stopped.await;
                    });
                })?;
            workers._stops.push(stop);
        }
        Ok(workers)
    }

    /// Runtimes to serve on, besides the caller's.
    pub(crate) fn handles(&self) -> &[Handle] {
        &self.handles
    }
}

/// How many threads serve gRPC by default: one per core the process may use (`available_
/// parallelism` follows the cgroup CPU quota, so a pod limited to 2 CPUs gets 2).
pub fn default_threads() -> usize {
    thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}
