//! Config over xDS (`CONFIG_TYPE=GRPC_XDS_SOTW`): the rules come from a management server (Envoy
//! Gateway's, say) on a state-of-the-world ADS stream, as envoyproxy/ratelimit's client speaks
//! it (go-control-plane's `sotw` ADS client): one `DiscoveryRequest` for
//! [`RATE_LIMIT_CONFIG_TYPE`] carrying the node, then for every `DiscoveryResponse` an ACK (the
//! response's version and nonce) or a NACK (the last accepted version, the nonce, and the load
//! errors in `error_detail`).
//!
//! A response is the whole config: every resource is loaded together, through the same loader
//! as files, and replaces the rules only if all of it loads. Anything else keeps the rules in
//! force: a bad push (NACKed), a stream that breaks, a server that is down. The client then
//! reconnects, waiting `CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL` between failed connection
//! attempts and a growing, jittered backoff (`XDS_CLIENT_BACKOFF_*`) after a stream that broke,
//! and asks again with the last accepted version. Certificates are read at every connection
//! attempt, so a renewed client certificate is used from the next reconnect on.

use crate::config::load_xds;
use crate::proto::envoy::config::core::v3::Node;
use crate::proto::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use crate::proto::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use crate::proto::google::rpc::Status as RpcStatus;
use crate::proto::ratelimit::config::ratelimit::v3::RateLimitConfig;
use crate::service::RateLimiter;
use prost::Message;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// The resource type sluice subscribes to (envoyproxy/ratelimit's `RateLimitConfig`).
pub const RATE_LIMIT_CONFIG_TYPE: &str =
    "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// Bound on one connection attempt (TCP and TLS handshakes).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where and how to reach the management server (envoyproxy's `CONFIG_GRPC_XDS_*` settings).
#[derive(Debug, Clone, PartialEq)]
pub struct XdsSettings {
    /// `host:port` (`CONFIG_GRPC_XDS_SERVER_URL`).
    pub server_url: String,
    /// `CONFIG_GRPC_XDS_NODE_ID`: the node the server keys its snapshots by.
    pub node_id: String,
    /// `CONFIG_GRPC_XDS_NODE_METADATA` (`key=value,...`): string fields of the node metadata.
    pub node_metadata: Vec<(String, String)>,
    /// `CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS` (`key:value,...`): gRPC metadata on the stream.
    pub headers: Vec<(AsciiMetadataKey, AsciiMetadataValue)>,
    /// `CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL`: between failed connection attempts.
    pub connect_retry_interval: Duration,
    /// TLS to the server (`CONFIG_GRPC_XDS_SERVER_USE_TLS`); `None` is plaintext.
    pub tls: Option<XdsTls>,
    pub backoff: Backoff,
    /// `XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES`: the largest response accepted (default 4 MiB, as
    /// gRPC's).
    pub max_message_bytes: Option<usize>,
    /// `MERGE_DOMAIN_CONFIG`: resources with the same domain are merged.
    pub merge_domains: bool,
    /// `USE_CALENDAR_MONTH_RATE_LIMIT`: `unit: month` fixed windows are UTC calendar months.
    pub calendar_months: bool,
}

/// TLS (and, with a client certificate, mutual TLS) to the management server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdsTls {
    /// `CONFIG_GRPC_XDS_SERVER_TLS_CACERT`: the CA the server's certificate must chain to.
    pub ca_cert: PathBuf,
    /// `CONFIG_GRPC_XDS_CLIENT_TLS_CERT` and `_KEY`: the client certificate, for mutual TLS.
    pub client_identity: Option<(PathBuf, PathBuf)>,
    /// `CONFIG_GRPC_XDS_SERVER_TLS_SAN`: the name the server's certificate must carry, when it
    /// is not the host of the URL.
    pub server_name: Option<String>,
}

/// Backoff after a stream breaks (`XDS_CLIENT_BACKOFF_*`): `initial`, doubling per consecutive
/// failure up to `max`; with `jitter`, each wait is spread by +-`random_factor` of itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
    pub random_factor: f64,
    pub jitter: bool,
}

impl Default for Backoff {
    /// envoyproxy/ratelimit's defaults.
    fn default() -> Self {
        Self {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(60),
            random_factor: 0.5,
            jitter: true,
        }
    }
}

impl Backoff {
    /// The wait before reconnect number `attempt` (0 for the first after a break).
    pub fn delay(&self, attempt: u32, random: f64) -> Duration {
        let base = self
            .initial
            .saturating_mul(1u32 << attempt.min(16))
            .min(self.max);
        if !self.jitter || self.random_factor <= 0.0 {
            return base;
        }
        // random in [0, 1) -> a factor in [1 - f, 1 + f).
        let factor = 1.0 + self.random_factor * (2.0 * random - 1.0);
        base.mul_f64(factor.max(0.0)).min(self.max)
    }
}

/// Why one session with the management server ended.
#[derive(Debug)]
enum SessionError {
    /// No stream was established (the next try waits the connect retry interval).
    Connect(String),
    /// The stream broke after it was established (the next try waits the backoff).
    Stream(String),
}

impl fmt::Display for SessionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SessionError::Connect(e) => write!(f, "cannot connect: {e}"),
            SessionError::Stream(e) => write!(f, "stream ended: {e}"),
        }
    }
}

/// Follows the management server until aborted (at shutdown), feeding every accepted config to
/// `limiter`.
pub(crate) async fn watch(limiter: Arc<RateLimiter>, settings: XdsSettings) {
    let mut state = State::default();
    let mut breaks = 0u32;
    loop {
        let result = session(&limiter, &settings, &mut state).await;
        let delay = match result {
            Err(SessionError::Connect(e)) => {
                tracing::warn!(
                    server = %settings.server_url,
                    error = %e,
                    retry_in = ?settings.connect_retry_interval,
                    "cannot reach the xDS server; the rules in force stay"
                );
                settings.connect_retry_interval
            }
            Err(SessionError::Stream(e)) => {
                // A stream that delivered a config starts the backoff afresh.
                if std::mem::take(&mut state.received) {
                    breaks = 0;
                }
                let delay = settings.backoff.delay(breaks, random_unit());
                breaks = breaks.saturating_add(1);
                tracing::warn!(
                    server = %settings.server_url,
                    error = %e,
                    retry_in = ?delay,
                    "xDS stream ended; the rules in force stay"
                );
                delay
            }
            Ok(never) => match never {},
        };
        tokio::time::sleep(delay.max(Duration::from_millis(10))).await;
    }
}

/// What survives a reconnect: the version last accepted (sent again so the server knows what
/// sluice runs), and whether the last session delivered anything.
#[derive(Debug, Default)]
struct State {
    acked_version: String,
    received: bool,
}

async fn session(
    limiter: &Arc<RateLimiter>,
    settings: &XdsSettings,
    state: &mut State,
) -> Result<std::convert::Infallible, SessionError> {
    let channel = connect(settings).await.map_err(SessionError::Connect)?;
    let mut client = AggregatedDiscoveryServiceClient::new(channel);
    if let Some(n) = settings.max_message_bytes {
        client = client.max_decoding_message_size(n);
    }
    let node = node(settings);
    let (tx, rx) = mpsc::channel::<DiscoveryRequest>(4);
    let request = |version: &str, nonce: &str, error: Option<RpcStatus>| DiscoveryRequest {
        version_info: version.to_string(),
        node: Some(node.clone()),
        type_url: RATE_LIMIT_CONFIG_TYPE.to_string(),
        response_nonce: nonce.to_string(),
        error_detail: error,
        ..Default::default()
    };
    // Queued before the call: the subscription goes out with the stream's first frames.
    let first = request(&state.acked_version, "", None);
    tx.send(first)
        .await
        .map_err(|_| SessionError::Connect("request channel closed".into()))?;
    let mut call = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    for (k, v) in &settings.headers {
        call.metadata_mut().insert(k.clone(), v.clone());
    }
    let mut inbound = client
        .stream_aggregated_resources(call)
        .await
        .map_err(|s| SessionError::Connect(status_text(&s)))?
        .into_inner();
    tracing::info!(server = %settings.server_url, node = %settings.node_id, "xDS stream open");
    loop {
        let response = match inbound.message().await {
            Ok(Some(r)) => r,
            Ok(None) => return Err(SessionError::Stream("closed by the server".into())),
            Err(s) => return Err(SessionError::Stream(status_text(&s))),
        };
        state.received = true;
        let load = (settings.merge_domains, settings.calendar_months);
        let reply = match apply(limiter, &response, load).await {
            Ok(()) => {
                state.acked_version = response.version_info.clone();
                request(&response.version_info, &response.nonce, None)
            }
            Err(message) => request(
                &state.acked_version,
                &response.nonce,
                Some(RpcStatus {
                    code: tonic::Code::InvalidArgument as i32,
                    message,
                    details: Vec::new(),
                }),
            ),
        };
        if tx.send(reply).await.is_err() {
            return Err(SessionError::Stream("request stream closed".into()));
        }
    }
}

/// Loads one response; `Err` is the NACK's message (the rules in force stay).
async fn apply(
    limiter: &Arc<RateLimiter>,
    response: &DiscoveryResponse,
    (merge_domains, calendar_months): (bool, bool),
) -> Result<(), String> {
    let version = response.version_info.clone();
    let resources = response.resources.clone();
    // Decoding and building the rules is CPU work proportional to the push: off the workers.
    let loaded = tokio::task::spawn_blocking(move || {
        let mut configs = Vec::with_capacity(resources.len());
        for (i, any) in resources.iter().enumerate() {
            if any.type_url != RATE_LIMIT_CONFIG_TYPE {
                return Err(format!(
                    "resource #{} has type {:?}, expected {RATE_LIMIT_CONFIG_TYPE}",
                    i + 1,
                    any.type_url
                ));
            }
            let config = RateLimitConfig::decode(any.value.as_slice())
                .map_err(|e| format!("resource #{} is not a RateLimitConfig: {e}", i + 1))?;
            configs.push(config);
        }
        load_xds(&configs, merge_domains, calendar_months).map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| format!("config load failed: {e}"))?;
    match loaded {
        Ok(rules) => {
            let source = format!("xds version {version:?}");
            super::log_config_loaded(&rules, Some(Path::new(&source)), limiter.options().counting);
            limiter.replace_rules(rules);
            Ok(())
        }
        Err(message) => {
            tracing::error!(
                version = %version,
                errors = %message,
                "config pushed over xDS refused (NACK); the previous rules stay in force"
            );
            limiter.config_load_failed(&message);
            Err(message)
        }
    }
}

async fn connect(settings: &XdsSettings) -> Result<Channel, String> {
    let scheme = if settings.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let url = format!("{scheme}://{}", settings.server_url);
    let mut endpoint = Endpoint::from_shared(url.clone())
        .map_err(|e| format!("invalid server URL {url:?}: {e}"))?
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_while_idle(true);
    if let Some(tls) = &settings.tls {
        endpoint = endpoint
            .tls_config(client_tls(tls)?)
            .map_err(|e| format!("TLS setup: {e}"))?;
    }
    endpoint.connect().await.map_err(|e| error_chain(&e))
}

fn client_tls(tls: &XdsTls) -> Result<ClientTlsConfig, String> {
    let read = |p: &Path| std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()));
    let mut config =
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(&tls.ca_cert)?));
    if let Some((cert, key)) = &tls.client_identity {
        config = config.identity(Identity::from_pem(read(cert)?, read(key)?));
    }
    if let Some(name) = &tls.server_name {
        config = config.domain_name(name.clone());
    }
    Ok(config)
}

fn node(settings: &XdsSettings) -> Node {
    use prost_types::value::Kind;
    let fields = settings
        .node_metadata
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                prost_types::Value {
                    kind: Some(Kind::StringValue(v.clone())),
                },
            )
        })
        .collect();
    Node {
        id: settings.node_id.clone(),
        metadata: Some(prost_types::Struct { fields }),
        ..Default::default()
    }
}

fn status_text(s: &tonic::Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

/// An error with its sources: tonic's own message ("transport error") says little alone.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let part = s.to_string();
        // Layers often repeat their inner error's text: say it once.
        if !text.ends_with(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text
}

/// A number in [0, 1) for jitter; the standard library's randomly keyed hasher is enough here.
fn random_unit() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_max_and_jitters_within_the_factor() {
        let b = Backoff {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(60),
            random_factor: 0.5,
            jitter: false,
        };
        let waits: Vec<_> = (0..5).map(|a| b.delay(a, 0.0).as_secs()).collect();
        assert_eq!(waits, [10, 20, 40, 60, 60]);
        let b = Backoff { jitter: true, ..b };
        assert_eq!(b.delay(0, 0.0), Duration::from_secs(5));
        assert_eq!(b.delay(0, 0.5), Duration::from_secs(10));
        assert_eq!(b.delay(1, 0.75), Duration::from_secs(25));
        assert_eq!(
            b.delay(3, 0.99),
            Duration::from_secs(60),
            "never past the max"
        );
        let r = random_unit();
        assert!((0.0..1.0).contains(&r), "{r}");
    }
}
