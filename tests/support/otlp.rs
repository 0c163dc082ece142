//! An in-process OTLP/gRPC trace collector for the tracing tests: a real tonic server on a free
//! loopback port implementing `opentelemetry.proto.collector.trace.v1.TraceService`, which
//! keeps every batch it receives so tests can assert on the exported spans.
#![allow(dead_code)]

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, Span};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, Notify};
use tonic::{Request, Response, Status};

/// How long [`Collector::wait_for`] waits at most by default: only there so a broken pipeline
/// fails the test instead of hanging it; a passing test never gets near it.
pub const WAIT_CAP: Duration = Duration::from_secs(30);

#[derive(Default)]
struct Store {
    batches: Mutex<Vec<ResourceSpans>>,
    /// Woken on every batch, so waiters re-check at once instead of on a timer only.
    arrived: Notify,
}

struct Service(Arc<Store>);

#[tonic::async_trait]
impl TraceService for Service {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let resource_spans = request.into_inner().resource_spans;
        self.0
            .batches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(resource_spans);
        self.0.arrived.notify_waiters();
        Ok(Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// A running collector; stops when dropped.
pub struct Collector {
    addr: SocketAddr,
    store: Arc<Store>,
    stop: Option<oneshot::Sender<()>>,
}

impl Collector {
    /// Binds `127.0.0.1:0` and serves until dropped.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the OTLP collector");
        let addr = listener.local_addr().expect("collector address");
        let store = Arc::new(Store::default());
        let (stop, stopped) = oneshot::channel::<()>();
        let service = TraceServiceServer::new(Service(Arc::clone(&store)));
        tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await;
        });
        Self {
            addr,
            store,
            stop: Some(stop),
        }
    }

    /// `http://127.0.0.1:PORT`, the form `OTEL_EXPORTER_OTLP_ENDPOINT` takes.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every `ResourceSpans` received so far, in arrival order.
    pub fn resource_spans(&self) -> Vec<ResourceSpans> {
        self.store
            .batches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Every span received so far (all resources and scopes), in arrival order.
    pub fn spans(&self) -> Vec<Span> {
        self.resource_spans()
            .into_iter()
            .flat_map(|rs| rs.scope_spans)
            .flat_map(|ss| ss.spans)
            .collect()
    }

    /// The resource attributes that came with `span` (matched by trace and span id).
    pub fn resource_of(&self, span: &Span) -> Vec<KeyValue> {
        self.resource_spans()
            .into_iter()
            .find(|rs| {
                rs.scope_spans
                    .iter()
                    .flat_map(|ss| &ss.spans)
                    .any(|s| s.span_id == span.span_id && s.trace_id == span.trace_id)
            })
            .and_then(|rs| rs.resource)
            .map(|r| r.attributes)
            .unwrap_or_default()
    }

    /// Polls until `pred` holds on all spans received so far and returns them; panics with what
    /// arrived after [`WAIT_CAP`].
    pub async fn wait_for(&self, pred: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        self.wait_for_within(pred, WAIT_CAP).await
    }

    /// [`Collector::wait_for`] with an explicit cap.
    pub async fn wait_for_within(
        &self,
        pred: impl Fn(&[Span]) -> bool,
        cap: Duration,
    ) -> Vec<Span> {
        let deadline = Instant::now() + cap;
        loop {
            // Registered before the check, so a batch landing in between still wakes us.
            let arrived = self.store.arrived.notified();
            let spans = self.spans();
            if pred(&spans) {
                return spans;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                panic!(
                    "the collector did not receive the expected spans within {cap:?}; got:\n{}",
                    describe(&spans)
                );
            }
            // The short timer is only a fallback: `arrived` normally wakes us first.
            let _ = tokio::time::timeout(left.min(Duration::from_millis(200)), arrived).await;
        }
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Lower-case hex of an id (trace or span id bytes).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The value of attribute `key`, if present.
pub fn attr<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a Value> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
}

/// A string attribute of `span`; panics (listing the attributes) if absent or not a string.
pub fn str_attr<'a>(span: &'a Span, key: &str) -> &'a str {
    match attr(&span.attributes, key) {
        Some(Value::StringValue(s)) => s,
        other => panic!(
            "span {:?}: attribute {key:?} is {other:?}, not a string; attributes: {:?}",
            span.name, span.attributes
        ),
    }
}

/// An integer attribute of `span`; panics (listing the attributes) if absent or not an int.
pub fn int_attr(span: &Span, key: &str) -> i64 {
    match attr(&span.attributes, key) {
        Some(Value::IntValue(i)) => *i,
        other => panic!(
            "span {:?}: attribute {key:?} is {other:?}, not an integer; attributes: {:?}",
            span.name, span.attributes
        ),
    }
}

/// One line per span (name, ids, attributes), for failure messages.
pub fn describe(spans: &[Span]) -> String {
    spans
        .iter()
        .map(|s| {
            format!(
                "  {} trace={} span={} parent={} attrs={:?}",
                s.name,
                hex(&s.trace_id),
                hex(&s.span_id),
                hex(&s.parent_span_id),
                s.attributes
                    .iter()
                    .map(|kv| (
                        kv.key.as_str(),
                        kv.value.as_ref().and_then(|v| v.value.clone())
                    ))
                    .collect::<Vec<_>>()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}
