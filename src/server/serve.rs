//! The gRPC side of the server: one set of routes (RLS, RLQS, health, reflection) shared by every
//! serving thread, and one tonic server per thread, each accepting from its own handle on the
//! one listening socket until drained.

use super::listener::{GrpcListener, StdListener};
use super::signal::ShutdownWatch;
use super::workers::Workers;
use super::{grpc, incoming, tls, ConnectionAge, Http2Limits, ServerError};
use crate::service::RateLimiter;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::task::{JoinHandle, JoinSet};
use tonic::service::RoutesBuilder;

/// Everything the gRPC servers need that can fail, built before any task is spawned.
pub(super) struct GrpcServing {
    listener: GrpcListener,
    addr: SocketAddr,
    tls: Option<tls::GrpcTls>,
    workers: Workers,
    worker_listeners: Vec<StdListener>,
    /// Services every thread serves; [`GrpcServing::spawn`] adds the RLS itself.
    pub(super) routes: RoutesBuilder,
}

impl GrpcServing {
    pub(super) fn prepare(
        listener: GrpcListener,
        addr: SocketAddr,
        tls: Option<&tls::TlsSettings>,
        threads: usize,
    ) -> Result<Self, ServerError> {
        let (reflection_v1, reflection_v1alpha) = grpc::reflection_services()?;
        let mut routes = RoutesBuilder::default();
        routes.add_service(reflection_v1);
        routes.add_service(reflection_v1alpha);
        let tls = tls.map(tls::GrpcTls::load).transpose()?;
        let workers = Workers::start(threads.saturating_sub(1))
            .map_err(|source| ServerError::Threads { threads, source })?;
        // Each serving thread accepts from its own handle on the one listening socket.
        let worker_listeners = workers
            .handles()
            .iter()
            .map(|_| listener.try_clone_std())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| ServerError::Bind {
                what: "gRPC",
                addr,
                source,
            })?;
        Ok(Self {
            listener,
            addr,
            tls,
            workers,
            worker_listeners,
            routes,
        })
    }

    /// Starts one server per serving thread. Returns the task that joins them and the threads,
    /// which must outlive the drain.
    ///
    /// The accept stream itself ends on drain (after sweeping the backlog), so tonic's own
    /// shutdown signal never fires first; passing one still makes tonic drain its connections
    /// gracefully once the stream ends.
    pub(super) fn spawn(
        self,
        limiter: &Arc<RateLimiter>,
        (age, http2): (Option<ConnectionAge>, Http2Limits),
        quota: crate::quota::QuotaSettings,
        draining: &ShutdownWatch,
    ) -> (JoinHandle<Result<(), ServerError>>, Workers) {
        let mut routes = self.routes;
        // An RLQS stream never ends by itself: it ends at the connection's age, so that
        // connection closes too (tonic waits for a closing connection's streams).
        let quota = crate::quota::QuotaSettings {
            max_stream_age: quota.max_stream_age.or(age.map(|a| a.max)),
            ..quota
        };
        routes.add_service(super::rls_codec::RlsServer::new(Arc::clone(limiter)));
        routes.add_service(
            crate::quota::QuotaService::new(Arc::clone(limiter), quota, draining.receiver())
                .into_server(),
        );
        let routes = routes.routes();
        // Each serving thread gets its own router: its own jittered connection age.
        let router = |n: u64| {
            let keepalive = http2.keepalive;
            let mut builder = tonic::transport::Server::builder()
                .max_concurrent_streams(http2.max_concurrent_streams)
                .http2_keepalive_interval(keepalive.map(|k| k.0))
                .http2_keepalive_timeout(keepalive.map(|k| k.1));
            if let Some(age) = age {
                builder = builder.max_connection_age(age.jittered(n));
            }
            builder.add_routes(routes.clone())
        };
        let tls = self.tls.map(tls::GrpcTls::start);
        let mut servers = JoinSet::new();
        let tcp_keepalive = http2.keepalive.map(|k| k.0);
        servers.spawn(serve_grpc(
            router(0),
            self.listener,
            (draining.clone(), tcp_keepalive),
            tls.clone(),
        ));
        let addr = self.addr;
        let threads = self.workers.handles().iter().zip(self.worker_listeners);
        for (n, (handle, listener)) in threads.enumerate() {
            let (router, drain, tls) = (router(n as u64 + 1), draining.clone(), tls.clone());
            // The listener joins the worker's own I/O driver, so it is registered there.
            servers.spawn_on(
                async move {
                    match listener.into_tokio() {
                        Ok(l) => serve_grpc(router, l, (drain, tcp_keepalive), tls).await,
                        Err(source) => Err(ServerError::Bind {
                            what: "gRPC",
                            addr,
                            source,
                        }),
                    }
                },
                handle,
            );
        }
        (tokio::spawn(join_grpc_servers(servers)), self.workers)
    }
}

/// One serving thread's gRPC server on its own accept stream, until drained.
pub(super) async fn serve_grpc(
    router: tonic::transport::server::Router,
    listener: GrpcListener,
    (drain, tcp_keepalive): (ShutdownWatch, Option<std::time::Duration>),
    tls: Option<tls::TlsAcceptors>,
) -> Result<(), ServerError> {
    let pending = std::future::pending::<()>;
    let listener = match listener {
        GrpcListener::Tcp(l) => l,
        // TLS on a Unix socket is refused at start.
        GrpcListener::Unix(l) => {
            let incoming = incoming::DrainingIncoming::new(l, drain);
            return router
                .serve_with_incoming_shutdown(incoming, pending())
                .await
                .map_err(ServerError::Grpc);
        }
    };
    let incoming = incoming::DrainingIncoming::new(incoming::Tcp(listener, tcp_keepalive), drain);
    let served = match tls {
        None => {
            router
                .serve_with_incoming_shutdown(incoming, pending())
                .await
        }
        // With TLS the same draining accept stream feeds per-connection handshakes.
        Some(tls) => {
            router
                .serve_with_incoming_shutdown(tls.incoming(incoming), pending())
                .await
        }
    };
    served.map_err(ServerError::Grpc)
}

/// Waits for every serving thread's server. The first failure ends the wait; the set is then
/// dropped, which aborts the other servers (so does aborting the task that runs this).
async fn join_grpc_servers(
    mut servers: JoinSet<Result<(), ServerError>>,
) -> Result<(), ServerError> {
    while let Some(r) = servers.join_next().await {
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(source) => {
                return Err(ServerError::Task {
                    what: "gRPC",
                    source,
                })
            }
        }
    }
    Ok(())
}
