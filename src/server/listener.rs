//! The socket gRPC is served on: a TCP port (`GRPC_HOST:GRPC_PORT`) or, with `GRPC_UDS`, a Unix
//! socket instead, as envoyproxy/ratelimit does (for a proxy on the same host or pod, with no
//! TCP stack in between). Every serving thread accepts on its own handle of the one socket.

use super::ServerError;
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use tokio::net::{TcpListener, UnixListener};

pub(crate) enum GrpcListener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

/// A handle on the same socket, to move to another serving thread's runtime.
pub(crate) enum StdListener {
    Tcp(std::net::TcpListener),
    Unix(std::os::unix::net::UnixListener),
}

impl GrpcListener {
    /// Binds `uds` when given (a stale socket file left by a previous run is replaced; any other
    /// file there is an error), else `addr`. Returns the bound TCP address (`addr` itself for a
    /// Unix socket).
    pub(crate) async fn bind(
        addr: SocketAddr,
        uds: Option<&Path>,
    ) -> Result<(Self, SocketAddr), ServerError> {
        Self::bind_named("gRPC", addr, uds).await
    }

    /// [`GrpcListener::bind`] for the listener `what`.
    pub(crate) async fn bind_named(
        what: &'static str,
        addr: SocketAddr,
        uds: Option<&Path>,
    ) -> Result<(Self, SocketAddr), ServerError> {
        let Some(path) = uds else {
            let l = bind(what, addr).await?;
            let bound = local_addr(what, addr, &l)?;
            return Ok((GrpcListener::Tcp(l), bound));
        };
        let err = |source: io::Error| ServerError::BindUnix {
            what,
            path: path.to_path_buf(),
            source,
        };
        {
            use std::os::unix::fs::FileTypeExt;
            match std::fs::symlink_metadata(path) {
                Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path).map_err(err)?,
                Ok(_) => {
                    return Err(err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        "a file that is not a socket is in the way",
                    )))
                }
                Err(_) => {}
            }
        }
        let l = UnixListener::bind(path).map_err(err)?;
        Ok((GrpcListener::Unix(l), addr))
    }

    pub(crate) fn try_clone_std(&self) -> io::Result<StdListener> {
        Ok(match self {
            GrpcListener::Tcp(l) => StdListener::Tcp(l.as_fd().try_clone_to_owned()?.into()),
            GrpcListener::Unix(l) => StdListener::Unix(l.as_fd().try_clone_to_owned()?.into()),
        })
    }

    /// The socket file, for a Unix socket.
    pub(crate) fn path(&self) -> Option<PathBuf> {
        match self {
            GrpcListener::Tcp(_) => None,
            GrpcListener::Unix(l) => l
                .local_addr()
                .ok()
                .and_then(|a| a.as_pathname().map(Path::to_path_buf)),
        }
    }
}

impl StdListener {
    /// Registers the handle with the calling thread's runtime.
    pub(crate) fn into_tokio(self) -> io::Result<GrpcListener> {
        match self {
            StdListener::Tcp(l) => {
                l.set_nonblocking(true)?;
                TcpListener::from_std(l).map(GrpcListener::Tcp)
            }
            StdListener::Unix(l) => {
                l.set_nonblocking(true)?;
                UnixListener::from_std(l).map(GrpcListener::Unix)
            }
        }
    }
}

/// Binds a TCP listener; the error names what it was for.
async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, ServerError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServerError::Bind { what, addr, source })
}

/// The address a listener got (port 0 picks one).
fn local_addr(
    what: &'static str,
    addr: SocketAddr,
    listener: &TcpListener,
) -> Result<SocketAddr, ServerError> {
    listener
        .local_addr()
        .map_err(|source| ServerError::Bind { what, addr, source })
}

/// Every socket the service listens on, bound before any task starts: a port conflict is
/// reported up front, and port 0 resolves to the real port the caller needs.
pub(super) struct Listeners {
    pub(super) grpc: GrpcListener,
    pub(super) grpc_addr: SocketAddr,
    pub(super) http: TcpListener,
    pub(super) http_addr: SocketAddr,
    /// envoyproxy's Prometheus series (`USE_PROMETHEUS`): listener, address, path.
    pub(super) envoy_metrics: Option<(TcpListener, SocketAddr, String)>,
    pub(super) debug: Option<(TcpListener, SocketAddr)>,
    /// The admin API's listener and its bound address.
    pub(super) admin: Option<(GrpcListener, SocketAddr)>,
}

impl Listeners {
    pub(super) async fn bind(config: &super::ServerConfig) -> Result<Self, ServerError> {
        if config.grpc_uds.is_some() && config.grpc_tls.is_some() {
            return Err(ServerError::Unsupported(
                "TLS on a Unix socket (GRPC_UDS with GRPC_SERVER_USE_TLS)",
            ));
        }
        let (grpc, grpc_addr) =
            GrpcListener::bind(config.grpc_addr, config.grpc_uds.as_deref()).await?;
        let http = bind("HTTP", config.http_addr).await?;
        let http_addr = local_addr("HTTP", config.http_addr, &http)?;
        let prometheus = config
            .envoy_stats
            .as_ref()
            .and_then(|e| e.prometheus.clone());
        let envoy_metrics = match prometheus {
            Some((addr, path)) => {
                const WHAT: &str = "Prometheus (USE_PROMETHEUS)";
                let listener = bind(WHAT, addr).await?;
                let bound = local_addr(WHAT, addr, &listener)?;
                Some((listener, bound, path))
            }
            None => None,
        };
        let admin = match &config.admin {
            Some(a) => a.bind().await?,
            None => None,
        };
        Ok(Self {
            admin,
            grpc,
            grpc_addr,
            http,
            http_addr,
            envoy_metrics,
            debug: bind_debug(config.debug_addr).await,
        })
    }
}

/// The debug listener is optional equipment: failing to open it is logged, not fatal.
async fn bind_debug(addr: Option<SocketAddr>) -> Option<(TcpListener, SocketAddr)> {
    let addr = addr?;
    match TcpListener::bind(addr).await {
        Ok(l) => l.local_addr().ok().map(|a| (l, a)),
        Err(e) => {
            tracing::warn!(addr = %addr, error = %e, "cannot open the debug listener; running without it");
            None
        }
    }
}
