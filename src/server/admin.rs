//! The admin API's listener (see `crate::admin`): its own TCP port or Unix socket, never the RLS
//! port nor the HTTP port, optionally TLS (with client certificates for mTLS), serving the
//! `Admin` service and its reflection. Secure by default: loopback or a Unix socket unless
//! authentication is configured; any other address without it refuses to start. Beside it, on
//! every replica whether or not its listener is on, the poll that applies admin writes.

use super::listener::GrpcListener;
use super::signal::ShutdownWatch;
use super::{serve, tls, ServerError};
use crate::admin::{AdminService, AuthSettings};
use crate::service::RateLimiter;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::task::JoinHandle;

/// Where and how the admin API is served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminListen {
    /// `ADMIN_HOST:ADMIN_PORT` (port 0 picks one).
    pub addr: SocketAddr,
    /// `ADMIN_UDS`: a Unix socket instead of `addr`.
    pub uds: Option<PathBuf>,
    pub auth: AuthSettings,
    /// `ADMIN_TLS_CERT` / `ADMIN_TLS_KEY` (and `ADMIN_TLS_CLIENT_CACERT` for mTLS).
    pub tls: Option<tls::TlsSettings>,
}

impl AdminListen {
    /// Loopback, a free port, no authentication: what tests and a local operator get.
    pub fn loopback() -> Self {
        Self {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            uds: None,
            auth: AuthSettings::default(),
            tls: None,
        }
    }

    /// Refuses what would open the admin API to the network without authentication, and a
    /// tokens file that does not parse.
    fn check(&self) -> Result<(), ServerError> {
        let refuse = |m: String| Err(ServerError::Admin(m));
        if self.uds.is_some() && self.tls.is_some() {
            return refuse(
                "ADMIN_UDS and ADMIN_TLS_CERT are both set: the admin Unix socket is \
                           plaintext only"
                    .into(),
            );
        }
        if self.uds.is_none() && !self.addr.ip().is_loopback() && !self.auth.configured() {
            return refuse(format!(
                "the admin API would listen on {} without authentication: set ADMIN_TOKENS_FILE \
                 (bearer tokens) or ADMIN_TLS_CLIENT_CACERT (client certificates), or keep \
                 ADMIN_HOST on loopback (127.0.0.1) or use ADMIN_UDS",
                self.addr
            ));
        }
        if self.uds.is_none()
            && !self.addr.ip().is_loopback()
            && self.tls.is_none()
            && self.auth.tokens_file.is_some()
        {
            tracing::warn!(
                addr = %self.addr,
                "the admin API takes bearer tokens in plaintext on a non-loopback address: set \
                 ADMIN_TLS_CERT and ADMIN_TLS_KEY so they cannot be read on the wire"
            );
        }
        self.auth.check().map_err(ServerError::Admin)
    }

    /// Binds the listener after the checks; returns it with the bound address. A listener that
    /// would be unsafe is an error; one that cannot be bound (a port taken) is logged and the
    /// service runs without it: deciding rate limits must not wait on the operators' door.
    pub(super) async fn bind(&self) -> Result<Option<(GrpcListener, SocketAddr)>, ServerError> {
        self.check()?;
        match GrpcListener::bind_named("admin", self.addr, self.uds.as_deref()).await {
            Ok(bound) => Ok(Some(bound)),
            Err(e) => {
                tracing::error!(error = %e, "cannot open the admin API listener; running without it");
                Ok(None)
            }
        }
    }
}

/// The admin server, built (everything that can fail) before any task is spawned.
pub(super) struct Prepared {
    listener: GrpcListener,
    router: tonic::transport::server::Router,
    tls: Option<tls::GrpcTls>,
}

impl Prepared {
    /// The server for the bound listener, if any, and its TCP address (none on a Unix socket).
    pub(super) fn from_bound(
        bound: Option<(GrpcListener, SocketAddr)>,
        settings: Option<&AdminListen>,
        limiter: &Arc<RateLimiter>,
    ) -> Result<(Option<Self>, Option<SocketAddr>), ServerError> {
        match (bound, settings) {
            (Some((listener, addr)), Some(settings)) => {
                let tcp = settings.uds.is_none().then_some(addr);
                Ok((Some(Self::new(listener, settings, limiter)?), tcp))
            }
            _ => Ok((None, None)),
        }
    }

    fn new(
        listener: GrpcListener,
        settings: &AdminListen,
        limiter: &Arc<RateLimiter>,
    ) -> Result<Self, ServerError> {
        // Reflection over the admin API alone: grpcurl needs no proto file here.
        let (v1, v1alpha) = crate::proto::reflection(&[crate::proto::ADMIN_FILE_DESCRIPTOR_SET])?;
        let tls = settings.tls.as_ref().map(tls::GrpcTls::load).transpose()?;
        let service = AdminService::new(Arc::clone(limiter), settings.auth.clone()).into_server();
        let router = tonic::transport::Server::builder()
            .add_service(service)
            .add_service(v1)
            .add_service(v1alpha);
        Ok(Self {
            listener,
            router,
            tls,
        })
    }

    /// Serves the admin API until the drain.
    pub(super) fn spawn(self, draining: &ShutdownWatch) -> JoinHandle<()> {
        let drain = draining.clone();
        tokio::spawn(async move {
            let tls = self.tls.map(tls::GrpcTls::start);
            let served = serve::serve_grpc(self.router, self.listener, (drain, None), tls);
            if let Err(e) = served.await {
                tracing::error!(error = %e, "the admin listener failed");
            }
        })
    }
}

/// Loads the overrides in force (a restarted replica applies them before serving), then polls.
pub(super) async fn start_poll(limiter: &Arc<RateLimiter>) -> JoinHandle<()> {
    crate::admin::poll::reload(limiter).await;
    tokio::spawn(crate::admin::poll::watch(Arc::clone(limiter)))
}
