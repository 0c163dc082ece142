//! The end of the service's life: waits for the shutdown trigger (or a server dying early),
//! turns health NOT_SERVING, drains both servers within the grace period, then releases the
//! serving threads, the Unix socket file and the trace exporter, in that order.

use super::health::set_health;
use super::signal::{ShutdownHandle, ShutdownWatch};
use super::workers::Workers;
use super::ServerError;
use crate::telemetry::trace::Tracing;
use std::path::PathBuf;
use std::time::Duration;
use tokio::task::JoinHandle;

/// What the supervisor owns besides the two server tasks.
pub(super) struct Supervised {
    pub(super) trigger: ShutdownWatch,
    pub(super) drain: ShutdownHandle,
    pub(super) health: tonic_health::server::HealthReporter,
    pub(super) background: Vec<JoinHandle<()>>,
    pub(super) grace: Duration,
    pub(super) drain_delay: Duration,
    pub(super) workers: Workers,
    pub(super) grpc_socket: Option<PathBuf>,
    pub(super) tracing: Option<Tracing>,
    /// Gives the unspent slices back once drained, before the serving threads stop: their
    /// runtimes still drive what a request started there (a Redis connection the pool opened
    /// on one, a task spawned on one).
    pub(super) limiter: std::sync::Arc<crate::service::RateLimiter>,
}

impl Supervised {
    pub(super) fn spawn(
        self,
        grpc_task: JoinHandle<Result<(), ServerError>>,
        http_task: JoinHandle<std::io::Result<()>>,
    ) -> JoinHandle<Result<(), ServerError>> {
        tokio::spawn(async move {
            let Self {
                trigger,
                drain,
                health,
                background,
                grace,
                drain_delay,
                workers,
                grpc_socket,
                tracing,
                limiter,
            } = self;
            let result = supervise(
                trigger,
                drain,
                health,
                background,
                (grpc_task, http_task),
                Timing { grace, drain_delay },
            )
            .await;
            // Drained: no request spends a slice any more, so what is left goes back.
            limiter.give_back_slices(Duration::from_secs(2)).await;
            // The serving threads stop once their servers have drained (or the grace ran out)
            // and the slices are back.
            drop(workers);
            // As Go's listener does on close: no stale socket file is left behind.
            if let Some(path) = grpc_socket {
                let _ = std::fs::remove_file(path);
            }
            // Spans of the last requests are flushed after those requests finished.
            if let Some(t) = tracing {
                t.shutdown().await;
            }
            // And the decision log's last lines are on disk (its writer is a thread: waited
            // for off the runtime).
            if let Some(log) = limiter.options().decision_log.clone() {
                let flushed =
                    tokio::task::spawn_blocking(move || log.flush(Duration::from_secs(2))).await;
                if !matches!(flushed, Ok(true)) {
                    tracing::warn!("the decision log's last lines may not be on disk");
                }
            }
            result
        })
    }
}

/// How the end unfolds: NOT_SERVING while still answering for `drain_delay`, then the drain,
/// bounded by `grace`.
struct Timing {
    grace: Duration,
    drain_delay: Duration,
}

type ServerTasks = (
    JoinHandle<Result<(), ServerError>>,
    JoinHandle<std::io::Result<()>>,
);

/// Owns both server tasks: waits for the shutdown trigger (or a server dying early), stops the
/// store health task, turns health to NOT_SERVING and keeps answering for the drain delay (so
/// load balancers and Envoy's health checks take the instance out before it stops accepting),
/// then lets the servers drain, bounded by the grace period.
async fn supervise(
    trigger: ShutdownWatch,
    drain: ShutdownHandle,
    health: tonic_health::server::HealthReporter,
    background: Vec<JoinHandle<()>>,
    (mut grpc_task, mut http_task): ServerTasks,
    Timing { grace, drain_delay }: Timing,
) -> Result<(), ServerError> {
    let grpc_abort = grpc_task.abort_handle();
    let http_abort = http_task.abort_handle();

    // A server only returns before the trigger if it failed; the other one is then stopped too.
    let mut grpc_done = None;
    let mut http_done = None;
    tokio::select! {
        () = trigger.triggered() => {}
        r = &mut grpc_task => grpc_done = Some(grpc_result(r, true)),
        r = &mut http_task => http_done = Some(http_result(r, true)),
    }

    // The health task is stopped (and joined) first, so a probe finishing during the drain
    // can never turn a service back to SERVING.
    // Config reloads stop too: the drain finishes on the rules in force.
    for task in background {
        task.abort();
        let _ = task.await;
    }
    // Probes see NOT_SERVING from now on (the HTTP /healthcheck reads the trigger).
    set_health(&health, false).await;
    if grpc_done.is_none() && http_done.is_none() && !drain_delay.is_zero() {
        // Still accepting and answering: Envoy's active health checks and the endpoint's
        // removal (Kubernetes) take this replica out first, so no call finds it gone.
        tracing::info!(delay = ?drain_delay, "reporting NOT_SERVING; still serving until the drain delay ends");
        tokio::select! {
            () = tokio::time::sleep(drain_delay) => {}
            r = &mut grpc_task => grpc_done = Some(grpc_result(r, true)),
            r = &mut http_task => http_done = Some(http_result(r, true)),
        }
    }
    // Stop accepting on both listeners (HTTP/2 GOAWAY); in-flight calls continue.
    drain.shutdown();

    let drain = async {
        let g = match grpc_done {
            Some(r) => r,
            None => grpc_result((&mut grpc_task).await, false),
        };
        let h = match http_done {
            Some(r) => r,
            None => http_result((&mut http_task).await, false),
        };
        g.and(h)
    };
    match tokio::time::timeout(grace, drain).await {
        Ok(r) => {
            if r.is_ok() {
                tracing::info!("shutdown complete");
            }
            r
        }
        Err(_) => {
            tracing::warn!(
                grace = ?grace,
                "grace period elapsed with requests still in flight; closing remaining connections"
            );
            grpc_abort.abort();
            http_abort.abort();
            Ok(())
        }
    }
}

fn grpc_result(
    r: Result<Result<(), ServerError>, tokio::task::JoinError>,
    early: bool,
) -> Result<(), ServerError> {
    match r {
        Ok(Ok(())) if early => Err(ServerError::StoppedEarly("gRPC")),
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e),
        Err(source) => Err(ServerError::Task {
            what: "gRPC",
            source,
        }),
    }
}

fn http_result(
    r: Result<std::io::Result<()>, tokio::task::JoinError>,
    early: bool,
) -> Result<(), ServerError> {
    match r {
        Ok(Ok(())) if early => Err(ServerError::StoppedEarly("HTTP")),
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(ServerError::Http(e)),
        Err(source) => Err(ServerError::Task {
            what: "HTTP",
            source,
        }),
    }
}
