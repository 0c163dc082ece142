//! OpenTelemetry tracing end to end: a real sluice exports over OTLP/gRPC to an in-process
//! collector. The `ShouldRateLimit` span continues the caller's W3C trace, the `store.decide`
//! span below it describes the store call (memory and a real redis-server), and sampling is
//! parent-based.

use super::store::redis_settings;
use crate::support::otlp::{self, Collector};
use crate::support::redis::RedisServer;
use crate::support::*;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::Span;
use sluice::app::Ingredients;
use sluice::clock::ManualClock;
use sluice::proto::rate_limit_response::Code;
use sluice::proto::rate_limit_service_client::RateLimitServiceClient;
use sluice::proto::{RateLimitRequest, RateLimitResponse};
use sluice::server::{self, Running, ServerConfig};
use sluice::store::redis::{RedisKind, RedisStore};
use sluice::store::StoreStack;
use sluice::telemetry::trace::{parent_from_metadata, TraceSettings, Tracing};
use std::sync::Arc;
use tonic::transport::Channel;

const ROOT: &str = "ShouldRateLimit";
const DECIDE: &str = "store.decide";

/// Two hash-tag groups (`tenant=acme` and `path=/login` are different first entries) and three
/// counters (the tenant has two limits); the tenant's 2 per hour is what denies the 3rd call.
const TRACED: &str = r#"
domain: traced
descriptors:
  - key: tenant
    value: acme
    rate_limits:
      - {requests_per_unit: 2, unit: hour}
      - {requests_per_unit: 100, unit: day}
  - key: path
    value: /login
    rate_limit: {requests_per_unit: 100, unit: hour}
"#;

/// A sluice exporting traces to `collector` with `sampling_rate`, on `store` (memory when
/// `None`) and a manual clock at T0.
async fn traced_server(
    collector: &Collector,
    service_name: &str,
    sampling_rate: f64,
    store: Option<StoreStack>,
    clock: ManualClock,
) -> Running {
    let base = Ingredients::for_tests(rules(TRACED), Arc::new(clock));
    let config = ServerConfig::from_ingredients(Ingredients {
        store: store.unwrap_or(base.store.clone()),
        tracing: Some(TraceSettings {
            endpoint: collector.endpoint(),
            service_name: service_name.to_string(),
            sampling_rate,
        }),
        ..base
    });
    server::start(config).await.expect("server starts")
}

async fn client(running: &Running) -> RateLimitServiceClient<Channel> {
    RateLimitServiceClient::connect(running.grpc_url())
        .await
        .expect("gRPC connect")
}

/// A `traceparent` for `trace_id`/`span_id` (hex), sampled or not.
fn traceparent(trace_id: &str, span_id: &str, sampled: bool) -> String {
    format!(
        "00-{trace_id}-{span_id}-{}",
        if sampled { "01" } else { "00" }
    )
}

/// One ShouldRateLimit call carrying `traceparent` as gRPC metadata (none when `None`).
async fn call(
    client: &mut RateLimitServiceClient<Channel>,
    request: RateLimitRequest,
    traceparent: Option<&str>,
) -> RateLimitResponse {
    let mut request = tonic::Request::new(request);
    if let Some(tp) = traceparent {
        request
            .metadata_mut()
            .insert("traceparent", tp.parse().expect("ASCII traceparent"));
    }
    client
        .should_rate_limit(request)
        .await
        .expect("ShouldRateLimit succeeds")
        .into_inner()
}

fn tenant_and_login() -> RateLimitRequest {
    request(
        "traced",
        vec![desc(&[("tenant", "acme")]), desc(&[("path", "/login")])],
    )
}

fn named<'a>(spans: &'a [Span], name: &str, trace_id: &str) -> Vec<&'a Span> {
    spans
        .iter()
        .filter(|s| s.name == name && otlp::hex(&s.trace_id) == trace_id)
        .collect()
}

/// Waits for the `ShouldRateLimit` span of `trace_id` and its `store.decide` child, checks the
/// parent links (root under the caller's `parent_span_id`, decide under root) and returns both.
async fn trace_of(collector: &Collector, trace_id: &str, parent_span_id: &str) -> (Span, Span) {
    let spans = collector
        .wait_for(|s| named(s, ROOT, trace_id).len() == 1 && named(s, DECIDE, trace_id).len() == 1)
        .await;
    let root = named(&spans, ROOT, trace_id)[0].clone();
    let decide = named(&spans, DECIDE, trace_id)[0].clone();
    assert_eq!(
        otlp::hex(&root.parent_span_id),
        parent_span_id,
        "ShouldRateLimit continues the caller's span\n{}",
        otlp::describe(&spans)
    );
    assert_eq!(
        root.kind,
        SpanKind::Server as i32,
        "ShouldRateLimit is a server span"
    );
    assert_eq!(
        otlp::hex(&decide.parent_span_id),
        otlp::hex(&root.span_id),
        "store.decide is a child of ShouldRateLimit\n{}",
        otlp::describe(&spans)
    );
    (root, decide)
}

fn service_name(collector: &Collector, span: &Span) -> String {
    match otlp::attr(&collector.resource_of(span), "service.name") {
        Some(opentelemetry_proto::tonic::common::v1::any_value::Value::StringValue(s)) => s.clone(),
        other => panic!("resource service.name is {other:?}"),
    }
}

#[tokio::test]
async fn memory_store_spans_continue_the_callers_trace() {
    const TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
    const PARENT: &str = "b7ad6b7169203331";
    let collector = Collector::start().await;
    let running = traced_server(
        &collector,
        "sluice-memory-test",
        1.0,
        None,
        ManualClock::new(T0),
    )
    .await;
    let mut c = client(&running).await;
    let r = call(
        &mut c,
        tenant_and_login(),
        Some(&traceparent(TRACE, PARENT, true)),
    )
    .await;
    assert_eq!(code(&r), Code::Ok);
    drop(c);
    // Stopping flushes the batch exporter.
    running.stop().await.expect("clean shutdown");

    let (root, decide) = trace_of(&collector, TRACE, PARENT).await;
    assert_eq!(otlp::str_attr(&root, "ratelimit.domain"), "traced");
    assert_eq!(otlp::int_attr(&root, "ratelimit.descriptors"), 2);
    assert_eq!(otlp::str_attr(&root, "ratelimit.overall_code"), "OK");
    assert_eq!(otlp::str_attr(&decide, "sluice.store"), "memory");
    assert_eq!(service_name(&collector, &root), "sluice-memory-test");
    assert_eq!(service_name(&collector, &decide), "sluice-memory-test");
}

#[tokio::test]
async fn redis_store_span_counts_groups_keys_and_the_script_answer() {
    const TRACE_OK: &str = "11111111111111111111111111111111";
    const TRACE_DENIED: &str = "22222222222222222222222222222222";
    const PARENT_OK: &str = "1111111111111111";
    const PARENT_DENIED: &str = "2222222222222222";
    let redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .expect("start redis");
    let clock = ManualClock::new(T0);
    let store = RedisStore::new(&redis_settings(vec![redis.url()], RedisKind::Single))
        .expect("redis store")
        .with_test_clock(Arc::new(clock.clone()))
        .into_stack();
    let collector = Collector::start().await;
    let running = traced_server(&collector, "sluice-redis-test", 1.0, Some(store), clock).await;
    let mut c = client(&running).await;

    let first = call(
        &mut c,
        tenant_and_login(),
        Some(&traceparent(TRACE_OK, PARENT_OK, true)),
    )
    .await;
    assert_eq!(code(&first), Code::Ok);
    // The tenant's 2 per hour: the 2nd call (untraced) uses the last one, the 3rd is denied.
    assert_eq!(
        code(&call(&mut c, tenant_and_login(), None).await),
        Code::Ok
    );
    let denied = call(
        &mut c,
        tenant_and_login(),
        Some(&traceparent(TRACE_DENIED, PARENT_DENIED, true)),
    )
    .await;
    assert_eq!(code(&denied), Code::OverLimit);
    drop(c);
    running.stop().await.expect("clean shutdown");

    let (root, decide) = trace_of(&collector, TRACE_OK, PARENT_OK).await;
    assert_eq!(otlp::str_attr(&root, "ratelimit.domain"), "traced");
    assert_eq!(otlp::int_attr(&root, "ratelimit.descriptors"), 2);
    assert_eq!(otlp::str_attr(&root, "ratelimit.overall_code"), "OK");
    assert_eq!(otlp::str_attr(&decide, "sluice.store"), "redis");
    // Standalone Redis decides the whole request in one script call, whatever its hash tags.
    assert_eq!(otlp::int_attr(&decide, "sluice.store.groups"), 1);
    assert_eq!(otlp::int_attr(&decide, "sluice.store.keys"), 3);
    assert_eq!(otlp::str_attr(&decide, "sluice.store.script"), "admitted");
    assert_eq!(service_name(&collector, &root), "sluice-redis-test");

    let (root, decide) = trace_of(&collector, TRACE_DENIED, PARENT_DENIED).await;
    assert_eq!(
        otlp::str_attr(&root, "ratelimit.overall_code"),
        "OVER_LIMIT"
    );
    assert_eq!(otlp::str_attr(&decide, "sluice.store"), "redis");
    // Standalone Redis decides the whole request in one script call, whatever its hash tags.
    assert_eq!(otlp::int_attr(&decide, "sluice.store.groups"), 1);
    assert_eq!(otlp::int_attr(&decide, "sluice.store.keys"), 3);
    assert_eq!(otlp::str_attr(&decide, "sluice.store.script"), "denied");
    drop(redis);
}

#[tokio::test]
async fn sampling_is_parent_based() {
    const SAMPLED_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const UNSAMPLED: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";
    const SAMPLED_C: &str = "cccccccccccccccccccccccccccccccc";
    const PARENT: &str = "0123456789abcdef";
    let collector = Collector::start().await;
    // Rate 0: no root span is ever sampled; only the caller's decision counts.
    let running = traced_server(
        &collector,
        "sluice-sampling-test",
        0.0,
        None,
        ManualClock::new(T0),
    )
    .await;
    let mut c = client(&running).await;
    let single = || one("traced", &[("path", "/login")]);

    // A sampled parent is followed although the rate is 0.
    call(
        &mut c,
        single(),
        Some(&traceparent(SAMPLED_A, PARENT, true)),
    )
    .await;
    trace_of(&collector, SAMPLED_A, PARENT).await;

    // No traceparent (a root span at rate 0) and an unsampled parent: nothing is exported.
    call(&mut c, single(), None).await;
    call(
        &mut c,
        single(),
        Some(&traceparent(UNSAMPLED, PARENT, false)),
    )
    .await;

    // A sampled request after them: once it has arrived, the two before it would have too
    // (the exporter sends spans in the order they end), so the check below needs no timing.
    call(
        &mut c,
        single(),
        Some(&traceparent(SAMPLED_C, PARENT, true)),
    )
    .await;
    drop(c);
    running.stop().await.expect("clean shutdown");
    trace_of(&collector, SAMPLED_C, PARENT).await;

    let spans = collector.spans();
    let mut roots: Vec<String> = spans
        .iter()
        .filter(|s| s.name == ROOT)
        .map(|s| otlp::hex(&s.trace_id))
        .collect();
    roots.sort();
    assert_eq!(
        roots,
        [SAMPLED_A, SAMPLED_C],
        "only the sampled parents' requests are exported\n{}",
        otlp::describe(&spans)
    );
    assert_eq!(
        spans.iter().filter(|s| s.name == DECIDE).count(),
        2,
        "{}",
        otlp::describe(&spans)
    );
}

// ---------------------------------------------------------------------------------------------
// The pipeline alone (no server): the batch processor's own thread must get the tonic exporter's
// batches out on both Tokio runtime flavours, at shutdown and while running.
// ---------------------------------------------------------------------------------------------

/// Starts a pipeline to `collector`, ends one server span under a sampled remote parent (taken
/// from gRPC metadata) with one child, and returns the pipeline still running.
fn emit_probe(collector: &Collector, trace_id: &str, parent: &str) -> Tracing {
    use opentelemetry::trace::{Span as _, TraceContextExt as _, Tracer as _};
    let tracing = Tracing::start(&TraceSettings {
        endpoint: collector.endpoint(),
        service_name: "pipeline-test".into(),
        sampling_rate: 1.0,
    })
    .expect("pipeline starts");
    let tracer = tracing.tracer();
    let mut md = tonic::metadata::MetadataMap::new();
    md.insert(
        "traceparent",
        traceparent(trace_id, parent, true).parse().unwrap(),
    );
    let span = tracer
        .span_builder("probe")
        .with_kind(opentelemetry::trace::SpanKind::Server)
        .with_attributes([opentelemetry::KeyValue::new("probe.attr", "yes")])
        .start_with_context(&tracer, &parent_from_metadata(&md));
    let cx = opentelemetry::Context::new().with_span(span);
    tracer.start_with_context("probe.child", &cx).end();
    cx.span().end();
    tracing
}

async fn probe_arrives(collector: &Collector, trace_id: &str, parent: &str) {
    let spans = collector
        .wait_for(|s| {
            named(s, "probe", trace_id).len() == 1 && named(s, "probe.child", trace_id).len() == 1
        })
        .await;
    let probe = named(&spans, "probe", trace_id)[0];
    let child = named(&spans, "probe.child", trace_id)[0];
    assert_eq!(otlp::hex(&probe.parent_span_id), parent);
    assert_eq!(otlp::hex(&child.parent_span_id), otlp::hex(&probe.span_id));
    assert_eq!(probe.kind, SpanKind::Server as i32);
    assert_eq!(otlp::str_attr(probe, "probe.attr"), "yes");
    assert_eq!(service_name(collector, probe), "pipeline-test");
}

#[tokio::test(flavor = "current_thread")]
async fn pipeline_flushes_at_shutdown_on_a_current_thread_runtime() {
    let collector = Collector::start().await;
    let tracing = emit_probe(
        &collector,
        "d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1",
        "d1d1d1d1d1d1d1d1",
    );
    tracing.shutdown().await;
    // Shutdown returns after the last batch was answered: no waiting needed, but wait_for
    // reports what did arrive if it did not.
    probe_arrives(
        &collector,
        "d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1d1",
        "d1d1d1d1d1d1d1d1",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_flushes_at_shutdown_on_a_multi_thread_runtime() {
    let collector = Collector::start().await;
    let tracing = emit_probe(
        &collector,
        "d2d2d2d2d2d2d2d2d2d2d2d2d2d2d2d2",
        "d2d2d2d2d2d2d2d2",
    );
    tracing.shutdown().await;
    probe_arrives(
        &collector,
        "d2d2d2d2d2d2d2d2d2d2d2d2d2d2d2d2",
        "d2d2d2d2d2d2d2d2",
    )
    .await;
}

#[tokio::test(flavor = "current_thread")]
async fn pipeline_exports_while_running() {
    let collector = Collector::start().await;
    let tracing = emit_probe(
        &collector,
        "d3d3d3d3d3d3d3d3d3d3d3d3d3d3d3d3",
        "d3d3d3d3d3d3d3d3",
    );
    // No shutdown: the processor's scheduled export (every 5 s by default) delivers it, with
    // this runtime free to drive the exporter's connection meanwhile.
    probe_arrives(
        &collector,
        "d3d3d3d3d3d3d3d3d3d3d3d3d3d3d3d3",
        "d3d3d3d3d3d3d3d3",
    )
    .await;
    tracing.shutdown().await;
}
