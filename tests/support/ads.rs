//! A real xDS management server for tests: tonic serving the vendored
//! `envoy.service.discovery.v3.AggregatedDiscoveryService` over mutual TLS (a server certificate
//! and client certificates checked against a CA, as Envoy Gateway's xDS server for the rate-limit
//! service does), pushing `RateLimitConfig` snapshots state-of-the-world, and recording every
//! `DiscoveryRequest` it receives so a test can read the ACKs and NACKs.
//!
//! It runs on its own thread and runtime: [`AdsServer::stop`] drops that runtime, which closes
//! the listener and every open stream at once, as a crashed or restarted server would.
#![allow(dead_code)]

use futures_util::Stream;
use prost::Message;
use sluice::proto::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use sluice::proto::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use sluice::proto::ratelimit::config::ratelimit::v3::RateLimitConfig;
use sluice::server::xds::RATE_LIMIT_CONFIG_TYPE;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, watch};
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};

/// One request as the server saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    /// Which server run (0 for the first start, 1 after the first restart...).
    pub run: usize,
    pub node_id: String,
    pub type_url: String,
    pub version_info: String,
    pub response_nonce: String,
    /// `error_detail.message` of a NACK.
    pub error: Option<String>,
    /// The client presented a certificate (mutual TLS).
    pub client_cert: bool,
}

impl Seen {
    /// An ACK of `version`.
    pub fn acks(&self, version: &str) -> bool {
        self.error.is_none() && !self.response_nonce.is_empty() && self.version_info == version
    }
}

/// What the server pushes and what it heard, shared across restarts.
#[derive(Clone)]
pub struct AdsState {
    snapshot: watch::Sender<(String, Vec<RateLimitConfig>)>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl AdsState {
    pub fn new(version: &str, configs: Vec<RateLimitConfig>) -> Self {
        Self {
            snapshot: watch::channel((version.to_string(), configs)).0,
            seen: Arc::new(Mutex::new(Vec::new())),
        }
    }

    /// Pushes a new snapshot to every open stream (and to streams opened later).
    pub fn push(&self, version: &str, configs: Vec<RateLimitConfig>) {
        self.snapshot.send_replace((version.to_string(), configs));
    }

    /// Every request received so far, in order.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("seen").clone()
    }

    fn record(&self, seen: Seen) {
        self.seen.lock().expect("seen").push(seen);
    }
}

/// PEM material of the server: its certificate and key, and the CA client certificates must
/// chain to.
#[derive(Clone)]
pub struct AdsTls {
    pub cert_pem: String,
    pub key_pem: String,
    pub client_ca_pem: String,
}

pub struct AdsServer {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl AdsServer {
    /// Serves on `addr` (port 0 for a free one); `run` tags the requests of this run.
    pub fn start(addr: SocketAddr, state: AdsState, tls: AdsTls, run: usize) -> Self {
        let listener = std::net::TcpListener::bind(addr).expect("bind the ADS server");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("ADS address");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("ADS runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
                let tls_config = ServerTlsConfig::new()
                    .identity(Identity::from_pem(&tls.cert_pem, &tls.key_pem))
                    .client_ca_root(Certificate::from_pem(&tls.client_ca_pem));
                let serve = Server::builder()
                    .tls_config(tls_config)
                    .expect("ADS TLS")
                    .add_service(AggregatedDiscoveryServiceServer::new(Ads { state, run }))
                    .serve_with_incoming(incoming);
                tokio::select! {
                    r = serve => r.expect("ADS server"),
                    _ = stopped => {}
                }
            });
            // Dropping the runtime ends every connection task: streams break, the port closes.
            drop(rt);
        });
        Self {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Stops the server the hard way: listener and open streams are closed at once.
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            thread.join().expect("ADS thread");
        }
    }
}

impl Drop for AdsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Ads {
    state: AdsState,
    run: usize,
}

fn response(version: &str, configs: &[RateLimitConfig], nonce: u64) -> DiscoveryResponse {
    DiscoveryResponse {
        version_info: version.to_string(),
        resources: configs
            .iter()
            .map(|c| prost_types::Any {
                type_url: RATE_LIMIT_CONFIG_TYPE.to_string(),
                value: c.encode_to_vec(),
            })
            .collect(),
        type_url: RATE_LIMIT_CONFIG_TYPE.to_string(),
        nonce: nonce.to_string(),
        ..Default::default()
    }
}

type Outbound<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = Outbound<DiscoveryResponse>;
    type DeltaAggregatedResourcesStream = Outbound<DeltaDiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let client_cert = request.peer_certs().is_some_and(|c| !c.is_empty());
        let mut inbound = request.into_inner();
        let state = self.state.clone();
        let run = self.run;
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            let mut snapshot = state.snapshot.subscribe();
            let mut subscribed = false;
            let mut nonce = 0u64;
            loop {
                let send_now = tokio::select! {
                    m = inbound.message() => {
                        let Ok(Some(r)) = m else { return };
                        state.record(Seen {
                            run,
                            node_id: r.node.as_ref().map(|n| n.id.clone()).unwrap_or_default(),
                            type_url: r.type_url.clone(),
                            version_info: r.version_info.clone(),
                            response_nonce: r.response_nonce.clone(),
                            error: r.error_detail.as_ref().map(|e| e.message.clone()),
                            client_cert,
                        });
                        // The first request subscribes: answer it with the current snapshot.
                        !std::mem::replace(&mut subscribed, true)
                    }
                    changed = snapshot.changed(), if subscribed => {
                        if changed.is_err() { return }
                        true
                    }
                };
                if send_now {
                    nonce += 1;
                    let r = {
                        let current = snapshot.borrow_and_update();
                        response(&current.0, &current.1, nonce)
                    };
                    if tx.send(Ok(r)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn delta_aggregated_resources(
        &self,
        _: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Err(Status::unimplemented(
            "this test server speaks state of the world only",
        ))
    }
}
