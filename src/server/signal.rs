//! Process signals and the shutdown trigger. As in linkerd2-proxy, a signal only starts the drain:
//! it flips one shared trigger that every listener and health endpoint watches, and the servers
//! then finish their in-flight work within the grace period.

use std::future::Future;
use tokio::sync::watch;

/// Installs the SIGTERM and SIGINT handlers now and returns a future that resolves on the first
/// of them (Ctrl-C elsewhere than Unix). Kubernetes sends SIGTERM; a developer presses Ctrl-C;
/// both mean "drain, then exit 0". Call it before loading config or binding: until a handler is
/// installed, a SIGTERM kills the process with the default action instead of draining it.
/// Must be called within a Tokio runtime.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    let handlers = {
        use tokio::signal::unix::{signal, SignalKind};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(term), Ok(int)) => Some((term, int)),
            (Err(e), _) | (_, Err(e)) => {
                // Without handlers the default action would kill the process mid-request;
                // Ctrl-C handling below is the best remaining option.
                tracing::error!(error = %e, "cannot install SIGTERM/SIGINT handlers");
                None
            }
        }
    };
    async move {
        #[cfg(unix)]
        if let Some((mut term, mut int)) = handlers {
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            tracing::info!(signal = name, "shutdown signal received, draining");
            return;
        }
        match tokio::signal::ctrl_c().await {
            Ok(()) => tracing::info!(signal = "SIGINT", "shutdown signal received, draining"),
            Err(e) => {
                tracing::error!(
                    error = %e,
                    "cannot listen for Ctrl-C; only an explicit shutdown stops the server"
                );
                std::future::pending::<()>().await;
            }
        }
    }
}

/// Starts a shutdown: cheap to clone, idempotent, usable from any task or test.
#[derive(Debug, Clone)]
pub struct ShutdownHandle {
    tx: watch::Sender<bool>,
}

/// Observes the trigger.
#[derive(Debug, Clone)]
pub(crate) struct ShutdownWatch {
    rx: watch::Receiver<bool>,
}

pub(crate) fn channel() -> (ShutdownHandle, ShutdownWatch) {
    let (tx, rx) = watch::channel(false);
    (ShutdownHandle { tx }, ShutdownWatch { rx })
}

impl ShutdownHandle {
    /// Begins the graceful shutdown; later calls do nothing.
    pub fn shutdown(&self) {
        self.tx.send_replace(true);
    }

    pub fn is_shutting_down(&self) -> bool {
        *self.tx.borrow()
    }
}

impl ShutdownWatch {
    /// The flag itself, for a task that selects on it.
    pub(crate) fn receiver(&self) -> watch::Receiver<bool> {
        self.rx.clone()
    }

    pub(crate) fn is_shutting_down(&self) -> bool {
        *self.rx.borrow()
    }

    /// Resolves once shutdown has begun. If every handle is gone nobody can trigger it any more,
    /// which only happens while tearing down, so that also counts as shutdown.
    pub(crate) async fn triggered(mut self) {
        let _ = self.rx.wait_for(|v| *v).await;
    }
}
