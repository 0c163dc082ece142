//! TLS, and optionally mutual TLS, on the gRPC port (envoyproxy/ratelimit's
//! `GRPC_SERVER_USE_TLS`, `GRPC_SERVER_TLS_CERT`, `GRPC_SERVER_TLS_KEY`, `GRPC_CLIENT_TLS_CACERT`).
//!
//! The PEM files are read once at start (any problem fails the start, naming the file) and then
//! polled for content changes, following symlinks, so a renewed certificate or a Kubernetes
//! Secret update (which swaps a `..data` symlink) is picked up without a restart. A new file that
//! does not parse, or a key that does not match its certificate, is logged and ignored: the last
//! good certificate and CA keep serving.
//!
//! Each accepted TCP connection is handshaken in its own task with the configuration in force
//! at accept time, so one slow or silent client never holds up the accept loop, and a reload
//! only affects connections accepted after it (established HTTP/2 connections are kept).
//! The HTTP admin port is not covered: it stays plaintext.

use super::reload::DEFAULT_RELOAD_INTERVAL;
use crate::pem;
use futures_util::Stream;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::server::danger::ClientCertVerifier;
use rustls::server::WebPkiClientVerifier;
use rustls::sign::{CertifiedKey, SingleCertAndKey};
use rustls::{RootCertStore, ServerConfig};
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::task::{AbortHandle, JoinSet};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// Bound on one TLS handshake: a client that connects and says nothing must not keep a task
/// and a socket forever (nor stretch a drain).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the gRPC server's certificate, key and (for mTLS) client CA live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    /// PEM certificate chain, leaf first (`GRPC_SERVER_TLS_CERT`).
    pub cert: PathBuf,
    /// PEM private key: PKCS#8, PKCS#1 (RSA) or SEC1 (EC) (`GRPC_SERVER_TLS_KEY`).
    pub key: PathBuf,
    /// PEM CA bundle (`GRPC_CLIENT_TLS_CACERT`): when set, every client must present a
    /// certificate that chains to it (mutual TLS).
    pub client_ca: Option<PathBuf>,
    /// How often the files are checked for changes.
    pub reload_interval: Duration,
}

impl TlsSettings {
    /// Server TLS without client certificates, reloaded every [`DEFAULT_RELOAD_INTERVAL`].
    pub fn new(cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        Self {
            cert: cert.into(),
            key: key.into(),
            client_ca: None,
            reload_interval: DEFAULT_RELOAD_INTERVAL,
        }
    }

    /// Requires client certificates signed by the CA in `ca` (mutual TLS).
    pub fn with_client_ca(mut self, ca: impl Into<PathBuf>) -> Self {
        self.client_ca = Some(ca.into());
        self
    }
}

/// Why the gRPC TLS configuration cannot be (re)built. Every variant names the file at fault.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the gRPC TLS {what} {}: {source}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("invalid gRPC TLS {what} {}: {reason}", path.display())]
    Invalid {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error(
        "the gRPC TLS private key {} does not belong to the certificate {}: {reason}",
        key.display(),
        cert.display()
    )]
    Mismatch {
        cert: PathBuf,
        key: PathBuf,
        reason: String,
    },
    #[error("cannot build the gRPC TLS configuration: {0}")]
    Config(String),
}

const CERT: &str = "certificate";
const KEY: &str = "private key";
const CLIENT_CA: &str = "client CA";

/// The contents of the watched files as last read; a read error is kept as text so the same
/// failure is logged once, not on every poll. No `Debug`: it holds the private key.
#[derive(Clone, PartialEq, Eq)]
struct Contents {
    cert: Result<Vec<u8>, String>,
    key: Result<Vec<u8>, String>,
    client_ca: Option<Result<Vec<u8>, String>>,
}

/// The configuration handshakes take, swapped whole on reload.
type SharedConfig = Arc<RwLock<Arc<ServerConfig>>>;

/// A loaded gRPC TLS configuration, ready to wrap the accept stream.
pub(crate) struct GrpcTls {
    settings: TlsSettings,
    provider: Arc<CryptoProvider>,
    identity: Arc<CertifiedKey>,
    verifier: Option<Arc<dyn ClientCertVerifier>>,
    seen: Contents,
    config: SharedConfig,
}

impl GrpcTls {
    /// Reads and checks every file now, so a missing file, a bad PEM or a key that does not
    /// match its certificate stops the start with the file's name.
    pub(crate) fn load(settings: &TlsSettings) -> Result<Self, TlsError> {
        // Explicitly ring: the process default provider is never consulted for the server side.
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let read_now = |what, path: &Path| {
            std::fs::read(path).map_err(|source| TlsError::Read {
                what,
                path: path.to_path_buf(),
                source,
            })
        };
        let cert = read_now(CERT, &settings.cert)?;
        let key = read_now(KEY, &settings.key)?;
        let ca = match &settings.client_ca {
            Some(path) => Some(read_now(CLIENT_CA, path)?),
            None => None,
        };
        let identity = parse_identity(settings, &cert, &key, &provider)?;
        let verifier = match (&settings.client_ca, &ca) {
            (Some(path), Some(pem)) => Some(parse_client_ca(path, pem, &provider)?),
            _ => None,
        };
        let config = build_config(&provider, Arc::clone(&identity), verifier.clone())?;
        Ok(Self {
            seen: Contents {
                cert: Ok(cert),
                key: Ok(key),
                client_ca: ca.map(Ok),
            },
            settings: settings.clone(),
            provider,
            identity,
            verifier,
            config: Arc::new(RwLock::new(config)),
        })
    }

    /// Starts watching the files and returns what wraps each serving thread's accept stream.
    /// The watcher lives as long as any clone of the returned value.
    pub(crate) fn start(self) -> TlsAcceptors {
        tracing::info!(
            cert = %self.settings.cert.display(),
            key = %self.settings.key.display(),
            client_ca = ?self.settings.client_ca.as_ref().map(|p| p.display().to_string()),
            mutual = self.settings.client_ca.is_some(),
            reload_interval = ?self.settings.reload_interval,
            "gRPC server uses TLS; watching the certificate files for changes"
        );
        let config = Arc::clone(&self.config);
        let watcher = tokio::spawn(self.watch()).abort_handle();
        TlsAcceptors {
            config,
            _watcher: Arc::new(AbortOnDrop(watcher)),
        }
    }

    /// Polls the files every `reload_interval` until aborted.
    async fn watch(mut self) {
        // A zero interval would spin; ten checks a second is already more than enough.
        let interval = self
            .settings
            .reload_interval
            .max(Duration::from_millis(100));
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let now = self.read_all().await;
            self.apply(now);
        }
    }

    async fn read_all(&self) -> Contents {
        // `fs::read` follows symlinks, so a swapped `..data` link reads the new target. The
        // three small reads share one trip to the blocking pool. The CA is read first and the
        // certificate last: a poll that sees a new CA never pairs it with a certificate older
        // than the CA write (the reload tests rely on that order to know what was read).
        fn read(path: &Path) -> Result<Vec<u8>, String> {
            std::fs::read(path).map_err(|e| e.to_string())
        }
        let settings = self.settings.clone();
        let reads = tokio::task::spawn_blocking(move || {
            let client_ca = settings.client_ca.as_deref().map(read);
            let key = read(&settings.key);
            Contents {
                cert: read(&settings.cert),
                key,
                client_ca,
            }
        });
        // Only a panic in `read` could fail the task: then nothing is known to have changed.
        reads.await.unwrap_or_else(|_| self.seen.clone())
    }

    /// Applies whatever changed since the last poll. The certificate (with its key) and the
    /// client CA are replaced independently; a part that fails keeps its last good value, and
    /// the failure is logged once per distinct file content.
    fn apply(&mut self, now: Contents) {
        if now == self.seen {
            return;
        }
        let mut changed = false;
        if now.cert != self.seen.cert || now.key != self.seen.key {
            match self.reload_identity(&now) {
                Ok(identity) => {
                    self.identity = identity;
                    changed = true;
                    tracing::info!(
                        cert = %self.settings.cert.display(),
                        "gRPC TLS certificate reloaded"
                    );
                }
                Err(e) => tracing::error!(
                    error = %e,
                    "gRPC TLS certificate not reloaded; the previous certificate keeps serving"
                ),
            }
        }
        if now.client_ca != self.seen.client_ca {
            match self.reload_client_ca(&now) {
                Ok(verifier) => {
                    self.verifier = verifier;
                    changed = true;
                    tracing::info!("gRPC TLS client CA reloaded");
                }
                Err(e) => tracing::error!(
                    error = %e,
                    "gRPC TLS client CA not reloaded; the previous CA keeps verifying clients"
                ),
            }
        }
        self.seen = now;
        if !changed {
            return;
        }
        match build_config(
            &self.provider,
            Arc::clone(&self.identity),
            self.verifier.clone(),
        ) {
            Ok(config) => {
                // A poisoned lock only means a panic elsewhere mid-swap of an `Arc`; the value
                // inside is still a complete configuration.
                let mut slot = self.config.write().unwrap_or_else(|e| e.into_inner());
                *slot = config;
            }
            Err(e) => tracing::error!(
                error = %e,
                "gRPC TLS configuration not rebuilt; the previous one keeps serving"
            ),
        }
    }

    fn reload_identity(&self, now: &Contents) -> Result<Arc<CertifiedKey>, TlsError> {
        let read_error = |what, path: &Path, e: &String| TlsError::Invalid {
            what,
            path: path.to_path_buf(),
            reason: format!("cannot read: {e}"),
        };
        let cert = now
            .cert
            .as_ref()
            .map_err(|e| read_error(CERT, &self.settings.cert, e))?;
        let key = now
            .key
            .as_ref()
            .map_err(|e| read_error(KEY, &self.settings.key, e))?;
        parse_identity(&self.settings, cert, key, &self.provider)
    }

    fn reload_client_ca(
        &self,
        now: &Contents,
    ) -> Result<Option<Arc<dyn ClientCertVerifier>>, TlsError> {
        match (&self.settings.client_ca, &now.client_ca) {
            (Some(path), Some(Ok(pem))) => Ok(Some(parse_client_ca(path, pem, &self.provider)?)),
            (Some(path), Some(Err(e))) => Err(TlsError::Invalid {
                what: CLIENT_CA,
                path: path.clone(),
                reason: format!("cannot read: {e}"),
            }),
            _ => Ok(None),
        }
    }
}

/// The certificate chain and its private key, checked to belong together.
fn parse_identity(
    settings: &TlsSettings,
    cert_pem: &[u8],
    key_pem: &[u8],
    provider: &CryptoProvider,
) -> Result<Arc<CertifiedKey>, TlsError> {
    let invalid = |what, path: &Path, reason: String| TlsError::Invalid {
        what,
        path: path.to_path_buf(),
        reason,
    };
    let chain = pem::cert_chain(cert_pem).map_err(|e| invalid(CERT, &settings.cert, e))?;
    let key = pem::private_key(key_pem).map_err(|e| invalid(KEY, &settings.key, e))?;
    match pem::key_pair(chain, key, provider) {
        Ok(identity) => Ok(Arc::new(identity)),
        Err(pem::KeyPairError::Key(e)) => Err(invalid(KEY, &settings.key, e)),
        Err(pem::KeyPairError::Mismatch(reason)) => Err(TlsError::Mismatch {
            cert: settings.cert.clone(),
            key: settings.key.clone(),
            reason,
        }),
    }
}

/// A verifier that requires a client certificate chaining to one of the CAs in `pem`.
fn parse_client_ca(
    path: &Path,
    pem: &[u8],
    provider: &Arc<CryptoProvider>,
) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    let invalid = |reason: String| TlsError::Invalid {
        what: CLIENT_CA,
        path: path.to_path_buf(),
        reason,
    };
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem) {
        let cert = cert.map_err(|e| invalid(e.to_string()))?;
        roots.add(cert).map_err(|e| invalid(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(invalid("no PEM CERTIFICATE block found".into()));
    }
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), Arc::clone(provider))
        .build()
        .map_err(|e| invalid(e.to_string()))
}

fn build_config(
    provider: &Arc<CryptoProvider>,
    identity: Arc<CertifiedKey>,
    verifier: Option<Arc<dyn ClientCertVerifier>>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let builder = ServerConfig::builder_with_provider(Arc::clone(provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match verifier {
        Some(v) => builder.with_client_cert_verifier(v),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_cert_resolver(Arc::new(SingleCertAndKey::from(identity)));
    // gRPC is HTTP/2 only; clients (Envoy included) insist on negotiating `h2` over TLS.
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// Aborts the file watcher when the accept stream goes away (drain, or a failed start).
struct AbortOnDrop(AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The live TLS configuration (reloaded by one file watcher) shared by every serving thread.
#[derive(Clone)]
pub(crate) struct TlsAcceptors {
    config: SharedConfig,
    _watcher: Arc<AbortOnDrop>,
}

impl TlsAcceptors {
    /// Wraps a stream of accepted TCP connections into a stream of TLS connections.
    pub(crate) fn incoming<S>(&self, tcp: S) -> TlsIncoming<S> {
        TlsIncoming {
            tcp,
            tcp_done: false,
            config: Arc::clone(&self.config),
            handshakes: JoinSet::new(),
            _watcher: Arc::clone(&self._watcher),
        }
    }
}

/// TLS connections from a stream of TCP connections. Ends once the TCP stream has ended and
/// every handshake already started has finished, so a client accepted before a drain still
/// gets served (and a graceful GOAWAY) as it would without TLS.
pub(crate) struct TlsIncoming<S> {
    tcp: S,
    tcp_done: bool,
    config: SharedConfig,
    /// Each yields the connection, or `None` when its handshake failed (already logged).
    handshakes: JoinSet<Option<TlsStream<TcpStream>>>,
    _watcher: Arc<AbortOnDrop>,
}

impl<S> TlsIncoming<S> {
    fn start_handshake(&mut self, tcp: TcpStream) {
        let config = Arc::clone(&self.config.read().unwrap_or_else(|e| e.into_inner()));
        let acceptor = TlsAcceptor::from(config);
        self.handshakes.spawn(async move {
            let peer = tcp.peer_addr().ok();
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => Some(tls),
                // Debug, not warn: load balancer TCP probes and port scans end here too.
                Ok(Err(e)) => {
                    tracing::debug!(peer = ?peer, error = %e, "gRPC TLS handshake failed");
                    None
                }
                Err(_) => {
                    tracing::debug!(peer = ?peer, timeout = ?HANDSHAKE_TIMEOUT, "gRPC TLS handshake timed out");
                    None
                }
            }
        });
    }
}

impl<S> Stream for TlsIncoming<S>
where
    S: Stream<Item = io::Result<TcpStream>> + Unpin,
{
    type Item = io::Result<TlsStream<TcpStream>>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            // Take every connection that is ready; each handshake runs in its own task.
            let mut accepted = false;
            if !this.tcp_done {
                match Pin::new(&mut this.tcp).poll_next(cx) {
                    Poll::Ready(Some(Ok(tcp))) => {
                        this.start_handshake(tcp);
                        accepted = true;
                    }
                    // tonic logs accept errors and keeps serving.
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                    Poll::Ready(None) => this.tcp_done = true,
                    Poll::Pending => {}
                }
            }
            match this.handshakes.poll_join_next(cx) {
                Poll::Ready(Some(Ok(Some(tls)))) => return Poll::Ready(Some(Ok(tls))),
                // A failed handshake (logged by its task) or a task that panicked: next.
                Poll::Ready(Some(Ok(None) | Err(_))) => continue,
                Poll::Ready(None) if this.tcp_done => return Poll::Ready(None),
                // Nothing finished yet. A connection just accepted means the TCP stream may
                // have more: look again. Otherwise both wakers are registered (the TCP stream's
                // by its `Pending`, the handshakes' by theirs; an empty set needs none).
                Poll::Ready(None) | Poll::Pending => {
                    if accepted {
                        continue;
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}
