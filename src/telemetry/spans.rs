//! The OpenTelemetry spans around a decision, kept out of the decision itself: the limiter asks
//! for a `ShouldRateLimit` span when a request comes in and a `store.decide` span around the
//! store call, and hands each its outcome at the end. With tracing off (no tracer) every call
//! here is a no-op that allocates nothing.

use opentelemetry::trace::{Span as _, SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{SdkTracer, Span};

/// The front end a request came through: it sets the span's `rpc.system`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Edge {
    /// Envoy's `RateLimitService` over gRPC.
    Grpc,
    /// The HTTP `/json` endpoint (no RPC system: the span says `http`).
    Http,
}

/// The `ShouldRateLimit` span of one request, if tracing is on.
#[derive(Debug)]
pub struct RequestSpan(Option<Context>);

impl RequestSpan {
    /// Starts the span as a child of `parent` (the caller's W3C trace context).
    pub fn start(
        tracer: Option<&SdkTracer>,
        parent: &Context,
        edge: Edge,
        domain: &str,
        descriptors: usize,
    ) -> Self {
        Self(tracer.map(|tracer| {
            let mut attributes = match edge {
                Edge::Grpc => vec![
                    KeyValue::new("rpc.system", "grpc"),
                    KeyValue::new("rpc.service", crate::proto::RLS_SERVICE_NAME),
                    KeyValue::new("rpc.method", "ShouldRateLimit"),
                ],
                Edge::Http => vec![
                    KeyValue::new("http.request.method", "POST"),
                    KeyValue::new("url.path", "/json"),
                ],
            };
            // The span starts before the request is validated: a client's domain is cut here.
            let mut end = domain.len().min(crate::config::MAX_DOMAIN_BYTES);
            while !domain.is_char_boundary(end) {
                end -= 1;
            }
            attributes.push(KeyValue::new("ratelimit.domain", domain[..end].to_string()));
            attributes.push(KeyValue::new("ratelimit.descriptors", count(descriptors)));
            let span = tracer
                .span_builder("ShouldRateLimit")
                .with_kind(SpanKind::Server)
                .with_attributes(attributes)
                .start_with_context(tracer, parent);
            parent.with_span(span)
        }))
    }

    /// The context children (the store span) start in.
    pub fn context(&self) -> Option<&Context> {
        self.0.as_ref()
    }

    /// Ends the span with the overall answer (`Ok(over_limit)`) or the error.
    pub fn finish(self, result: Result<bool, &dyn std::fmt::Display>) {
        let Some(cx) = self.0 else { return };
        let span = cx.span();
        match result {
            Ok(over) => span.set_attribute(KeyValue::new(
                "ratelimit.overall_code",
                if over { "OVER_LIMIT" } else { "OK" },
            )),
            Err(e) => span.set_status(Status::error(e.to_string())),
        }
        span.end();
    }
}

/// The `store.decide` span of one store call, if tracing is on.
#[derive(Debug)]
pub struct StoreSpan(Option<Span>);

impl StoreSpan {
    /// Starts the span below `cx`: `store` names the backend, `keys` the counters asked for.
    pub fn start(
        tracer: Option<&SdkTracer>,
        cx: Option<&Context>,
        store: &'static str,
        keys: usize,
    ) -> Self {
        Self(cx.zip(tracer).map(|(cx, tracer)| {
            let kind = if store == "memory" {
                SpanKind::Internal
            } else {
                SpanKind::Client
            };
            tracer
                .span_builder("store.decide")
                .with_kind(kind)
                .with_attributes([
                    KeyValue::new("sluice.store", store),
                    KeyValue::new("sluice.store.keys", count(keys)),
                ])
                .start_with_context(tracer, cx)
        }))
    }

    /// Ends the span with the store's decision (how many atomic steps it took; admitted;
    /// answered by the local deny cache) or its error.
    pub fn finish(self, result: Result<&crate::store::Decision, &dyn std::fmt::Display>) {
        let Some(mut span) = self.0 else { return };
        match result {
            Ok(d) => {
                let (admitted, local) = (d.admitted, d.local);
                span.set_attribute(KeyValue::new("sluice.store.groups", count(d.steps)));
                let script = if admitted { "admitted" } else { "denied" };
                span.set_attribute(KeyValue::new("sluice.store.script", script));
                span.set_attribute(KeyValue::new("sluice.store.local_cache", local));
            }
            Err(e) => {
                span.set_attribute(KeyValue::new("sluice.store.script", "error"));
                span.set_status(Status::error(e.to_string()));
            }
        }
        span.end();
    }
}

fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}
