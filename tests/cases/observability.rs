//! Metrics, rate-limit headers and the offenders view, over real sockets: `/metrics` is scraped
//! and parsed with a Prometheus text-format parser after a scripted sequence whose numbers are
//! known exactly; headers are checked per algorithm with hand-computed values.

use crate::support::*;
use futures_util::stream::{self, StreamExt};
use prometheus_parse::{Scrape, Value};
use sluice::clock::ManualClock;
use sluice::proto::rate_limit_response::Code;
use sluice::proto::RateLimitResponse;
use sluice::service::headers::HeaderOptions;
use sluice::service::ServiceOptions;
use sluice::store::local_cache::LocalDenyCache;
use sluice::store::memory::MemoryStore;
use std::sync::Arc;
use std::time::Duration;

const METRICS_CONFIG: &str = r#"
domain: m
descriptors:
  - key: tenant
    value: acme
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: consumer
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: shadowed
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: detailed
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: route
    descriptors:
      - key: user
        value_to_metric: true
        rate_limit: {unit: minute, requests_per_unit: 10}
"#;

async fn scrape(s: &TestServer) -> Scrape {
    let (status, head, body) = http_with_head(s.http_addr, "GET", "/metrics", "").await;
    assert_eq!(status, 200, "{body}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).expect("Prometheus text format")
}

/// The value of the one sample of `metric` whose labels include all of `labels`.
fn value(scrape: &Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    let found: Vec<f64> = scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match &s.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => *v,
            other => panic!("{metric} is not a number: {other:?}"),
        })
        .collect();
    assert_eq!(found.len(), 1, "{metric} {labels:?}: {found:?}");
    found[0]
}

fn counter(scrape: &Scrape, stat: &str, descriptor: &str) -> f64 {
    value(
        scrape,
        &format!("sluice_rate_limit_{stat}"),
        &[("domain", "m"), ("descriptor", descriptor)],
    )
}

/// Sends `requests` with `parallel` calls in flight on one HTTP/2 connection.
async fn send_all(
    s: &TestServer,
    requests: Vec<sluice::proto::RateLimitRequest>,
    parallel: usize,
) -> Vec<RateLimitResponse> {
    let client = s.client().await;
    stream::iter(requests)
        .map(|r| {
            let mut c = client.clone();
            async move {
                c.should_rate_limit(r)
                    .await
                    .expect("ShouldRateLimit succeeds")
                    .into_inner()
            }
        })
        .buffered(parallel)
        .collect()
        .await
}

#[tokio::test]
async fn metrics_count_a_scripted_sequence_exactly() {
    // A local deny cache in front of the memory store, so over_limit_with_local_cache moves.
    let clock = ManualClock::new(T0);
    let store = Arc::new(LocalDenyCache::new(
        Arc::new(MemoryStore::new(Arc::new(clock.clone()))),
        1 << 20,
        Arc::new(clock.clone()),
        sluice::store::DenialFinality::Always,
    ));
    let s = TestServer::start_on(
        METRICS_CONFIG,
        ServiceOptions::default(),
        Some(store),
        clock,
    )
    .await;
    let c = s.client().await;
    let call = |r| {
        let mut c = c.clone();
        async move { c.should_rate_limit(r).await.expect("call").into_inner() }
    };

    // tenant=acme, 5/min: 7 single hits -> 5 within (the 5th past floor(5 * 0.8) = 4: near),
    // then the store denies the 6th (and the cache learns it), the cache denies the 7th.
    let mut codes = Vec::new();
    for _ in 0..7 {
        codes.push(code(&call(one("m", &[("tenant", "acme")])).await));
    }
    assert_eq!(codes.iter().filter(|c| **c == Code::Ok).count(), 5);
    // One request of 3 hits after the window rolled: 3 within, 3 total, not near (3 <= 4).
    s.clock.advance(Duration::from_secs(60));
    let mut r = one("m", &[("tenant", "acme")]);
    r.hits_addend = 3;
    assert_eq!(code(&call(r).await), Code::Ok);

    // shadowed, 2/min in shadow mode: 3 hits, all answered OK; the 3rd is a shadow denial.
    for _ in 0..3 {
        assert_eq!(code(&call(one("m", &[("shadowed", "x")])).await), Code::Ok);
    }

    // detailed_metric: values appear in the key. value_to_metric: only on that level.
    for v in ["x", "x", "y"] {
        call(one("m", &[("detailed", v)])).await;
    }
    for u in ["alice", "bob", "bob"] {
        call(one("m", &[("route", "/a"), ("user", u)])).await;
    }

    // An invalid request and a request matching nothing: no descriptor counters.
    let e = c
        .clone()
        .should_rate_limit(request("m", vec![]))
        .await
        .expect_err("invalid");
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    call(one("m", &[("unknown", "v")])).await;

    // 10 000 distinct consumers on a bare-key rule (1/hour each), 200 of them twice.
    let mut consumers: Vec<_> = (0..10_000)
        .map(|i| one("m", &[("consumer", &format!("c{i}"))]))
        .collect();
    consumers.extend((0..200).map(|i| one("m", &[("consumer", &format!("c{i}"))])));
    let answers = send_all(&s, consumers, 32).await;
    let over = answers
        .iter()
        .filter(|r| code(r) == Code::OverLimit)
        .count();
    assert_eq!(over, 200);

    let m = scrape(&s).await;
    assert_eq!(counter(&m, "total_hits", "tenant_acme"), 10.0);
    assert_eq!(counter(&m, "within_limit", "tenant_acme"), 8.0);
    assert_eq!(counter(&m, "near_limit", "tenant_acme"), 1.0);
    assert_eq!(counter(&m, "over_limit", "tenant_acme"), 2.0);
    assert_eq!(
        counter(&m, "over_limit_with_local_cache", "tenant_acme"),
        1.0
    );

    assert_eq!(counter(&m, "total_hits", "shadowed"), 3.0);
    assert_eq!(counter(&m, "within_limit", "shadowed"), 2.0);
    assert_eq!(counter(&m, "over_limit", "shadowed"), 1.0);
    assert_eq!(counter(&m, "shadow_mode", "shadowed"), 1.0);

    assert_eq!(counter(&m, "total_hits", "detailed_x"), 2.0);
    assert_eq!(counter(&m, "total_hits", "detailed_y"), 1.0);
    assert_eq!(counter(&m, "total_hits", "route.user_alice"), 1.0);
    assert_eq!(counter(&m, "total_hits", "route.user_bob"), 2.0);

    // 1/hour each: every first request is within the limit and at it (near: 1 > floor(0.8)).
    assert_eq!(counter(&m, "total_hits", "consumer"), 10_200.0);
    assert_eq!(counter(&m, "within_limit", "consumer"), 10_000.0);
    assert_eq!(counter(&m, "near_limit", "consumer"), 10_000.0);
    assert_eq!(counter(&m, "over_limit", "consumer"), 200.0);
    // ... and not one series per consumer value.
    let per_value = m
        .samples
        .iter()
        .filter(|s| s.labels.values().any(|v| v.contains("c1")))
        .count();
    assert_eq!(per_value, 0, "no series carries a consumer value");
    let descriptor_series = m
        .samples
        .iter()
        .filter(|s| s.metric.starts_with("sluice_rate_limit_"))
        .count();
    assert!(
        descriptor_series <= 6 * 7,
        "series are bounded by the config: {descriptor_series}"
    );

    // Request latency histogram by outcome: the counts are the scripted numbers.
    // OK: 5 + 1 + 3 + 3 + 3 + 1 (unknown) + 10 000; OVER_LIMIT: 2 + 200; invalid: 1.
    let count = |outcome| {
        value(
            &m,
            "sluice_request_duration_seconds_count",
            &[("outcome", outcome)],
        )
    };
    assert_eq!(count("ok"), 10_016.0);
    assert_eq!(count("over_limit"), 202.0);
    assert_eq!(count("invalid_argument"), 1.0);
    // Store calls: every request with a counted limit (not the invalid or the unknown one).
    assert_eq!(
        value(
            &m,
            "sluice_store_call_duration_seconds_count",
            &[("result", "ok")]
        ),
        10_217.0
    );
    assert_eq!(
        value(&m, "sluice_store_errors_total", &[("kind", "transient")]),
        0.0
    );
    assert_eq!(value(&m, "sluice_circuit_breaker_state", &[]), -1.0);
    assert_eq!(value(&m, "sluice_store_up", &[]), 1.0);
    assert_eq!(
        value(
            &m,
            "sluice_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        1.0
    );

    // Config loads: the initial one; then a reload and a failed reload.
    assert_eq!(
        value(&m, "sluice_config_loads_total", &[("result", "success")]),
        1.0
    );
    assert_eq!(
        value(&m, "sluice_config_rate_limits", &[("domain", "m")]),
        5.0
    );
    let limiter = s.running.as_ref().expect("running").limiter();
    let reloaded = rules("domain: other\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n");
    let loaded_at = reloaded
        .loaded_at
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs_f64();
    limiter.replace_rules(reloaded);
    limiter.config_load_failed("test.yaml:1: broken");
    let m = scrape(&s).await;
    assert_eq!(
        value(&m, "sluice_config_loads_total", &[("result", "success")]),
        2.0
    );
    assert_eq!(
        value(&m, "sluice_config_loads_total", &[("result", "failure")]),
        1.0
    );
    assert_eq!(
        value(&m, "sluice_config_loaded_timestamp_seconds", &[]),
        loaded_at
    );
    assert_eq!(
        value(&m, "sluice_config_rate_limits", &[("domain", "other")]),
        1.0
    );
    assert!(
        !m.samples
            .iter()
            .any(|s| s.metric == "sluice_config_rate_limits"
                && s.labels.get("domain") == Some("m")),
        "a domain gone from the config leaves the gauge"
    );
    s.stop().await;
}

/// The value of header `name` in a response.
fn header<'a>(r: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    r.response_headers_to_add
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| h.value.as_str())
}

fn with_headers(ietf: bool) -> ServiceOptions {
    ServiceOptions {
        headers: Some(HeaderOptions {
            ietf_draft: ietf,
            ..HeaderOptions::default()
        }),
        ..ServiceOptions::default()
    }
}

/// One limit of 3 per minute per algorithm: requests 10 s apart from 30 s into a minute until
/// one is denied (the 4th, or the 5th for the token bucket, which refills a token in 20 s);
/// returns the first response and the denial.
async fn headers_for(algorithm: &str) -> (RateLimitResponse, RateLimitResponse) {
    let config = format!(
        "domain: h\ncounting: all_or_nothing\ndescriptors:\n  - key: k\n    rate_limit: {{name: per-k, unit: minute, requests_per_unit: 3, algorithm: {algorithm}}}\n"
    );
    let s = TestServer::start_with(&config, with_headers(true)).await;
    s.clock.set(T0 + Duration::from_secs(30));
    let first = s.call(one("h", &[("k", "v")])).await;
    let mut last = first.clone();
    for i in 1..10 {
        if code(&last) == Code::OverLimit {
            break;
        }
        if i < 3 {
            s.clock.advance(Duration::from_secs(10));
        }
        last = s.call(one("h", &[("k", "v")])).await;
    }
    assert_eq!(code(&last), Code::OverLimit, "{algorithm}");
    s.stop().await;
    (first, last)
}

#[tokio::test]
async fn headers_per_algorithm_with_retry_after() {
    // (algorithm, Remaining after the 1st, Reset after the 1st, Reset at the denial,
    //  Retry-After at the denial), computed by hand for requests at :30, :40, :50, :50 (, :50).
    let cases = [
        // Fixed window: the minute ends at :60.
        ("fixed_window", "2", "30", "10", "10"),
        // Sliding window: the current minute ends at :60 (Reset); the 3 hits of this minute
        // then slide out: 3 * (60 - x) / 60 + 1 <= 3 from x = 20 s, so at :80, 30 s away.
        ("sliding_window", "2", "30", "10", "30"),
        // Sliding log: the newest hit (:50) leaves at :110 (Reset); the oldest (:30) at :90.
        ("sliding_log", "2", "60", "60", "40"),
        // Token bucket (GCRA: a token per 20 s, capacity 3): after :30, :40, :50, :50 the
        // bucket is full again at :110 (Reset) and holds a token again at :70.
        ("token_bucket", "2", "20", "60", "20"),
    ];
    for (algorithm, remaining, reset, denied_reset, retry_after) in cases {
        let (first, denied) = headers_for(algorithm).await;
        let got = (
            header(&first, "RateLimit-Limit"),
            header(&first, "RateLimit-Remaining"),
            header(&first, "RateLimit-Reset"),
            header(&first, "Retry-After"),
        );
        assert_eq!(
            got,
            (Some("3"), Some(remaining), Some(reset), None),
            "{algorithm}: first response"
        );
        let got = (
            header(&denied, "RateLimit-Limit"),
            header(&denied, "RateLimit-Remaining"),
            header(&denied, "RateLimit-Reset"),
            header(&denied, "Retry-After"),
        );
        assert_eq!(
            got,
            (Some("3"), Some("0"), Some(denied_reset), Some(retry_after)),
            "{algorithm}: denial"
        );
        // The IETF draft pair, in its `"name";q=..;w=..` form.
        assert_eq!(
            header(&first, "RateLimit-Policy"),
            Some(r#""per-k";q=3;w=60"#),
            "{algorithm}"
        );
        assert_eq!(
            header(&first, "RateLimit"),
            Some(format!(r#""per-k";r={remaining};t={reset}"#).as_str()),
            "{algorithm}"
        );
        assert_eq!(
            header(&denied, "RateLimit"),
            Some(format!(r#""per-k";r=0;t={denied_reset}"#).as_str()),
            "{algorithm}"
        );
    }
}

#[tokio::test]
async fn headers_are_off_by_default_and_names_are_configurable() {
    let config = "domain: h\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: big\n    rate_limit: {unit: hour, requests_per_unit: 100}\n";
    let s = TestServer::start(config).await;
    let r = s.call(one("h", &[("k", "v")])).await;
    assert!(r.response_headers_to_add.is_empty(), "{r:?}");
    s.stop().await;

    let options = ServiceOptions {
        headers: Some(HeaderOptions {
            limit: "X-RateLimit-Limit".into(),
            remaining: "X-RateLimit-Remaining".into(),
            reset: "X-RateLimit-Reset".into(),
            ietf_draft: false,
        }),
        ..ServiceOptions::default()
    };
    let s = TestServer::start_with(config, options).await;
    // Two descriptors: the most restrictive (fewest remaining) speaks.
    let r = s
        .call(request(
            "h",
            vec![desc(&[("big", "v")]), desc(&[("k", "v")])],
        ))
        .await;
    assert_eq!(header(&r, "X-RateLimit-Limit"), Some("1"));
    assert_eq!(header(&r, "X-RateLimit-Remaining"), Some("0"));
    assert_eq!(header(&r, "X-RateLimit-Reset"), Some("1"));
    assert_eq!(header(&r, "RateLimit-Policy"), None, "draft pair is opt-in");
    assert_eq!(header(&r, "RateLimit-Limit"), None);
    // A denial by the small limit: Retry-After until the second ends.
    let r = s
        .call(request(
            "h",
            vec![desc(&[("big", "v")]), desc(&[("k", "v")])],
        ))
        .await;
    assert_eq!(code(&r), Code::OverLimit);
    assert_eq!(header(&r, "Retry-After"), Some("1"));
    // /json carries them as HTTP headers.
    let body = r#"{"domain":"h","descriptors":[{"entries":[{"key":"k","value":"v"}]}]}"#;
    let (status, head, _) = http_with_head(s.http_addr, "POST", "/json", body).await;
    assert_eq!(status, 429);
    let head = head.to_ascii_lowercase();
    assert!(head.contains("x-ratelimit-limit: 1"), "{head}");
    assert!(head.contains("retry-after: 1"), "{head}");
    s.stop().await;
}

#[tokio::test]
async fn offenders_name_the_heavy_hitter_of_an_attack() {
    // 50 000 consumers send 2 requests each against 1/hour (the 2nd is denied), interleaved with
    // one heavy hitter sending 5 000: 105 000 requests, 54 999 denials.
    let config = "domain: api\ndescriptors:\n  - key: consumer\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";
    let s = TestServer::start(config).await;
    let mut attack = Vec::with_capacity(105_000);
    for round in 0..2 {
        for i in 0..50_000 {
            attack.push(one("api", &[("consumer", &format!("user-{i}"))]));
            if (round * 50_000 + i) % 20 == 0 {
                attack.push(one("api", &[("consumer", "mallory")]));
            }
        }
    }
    assert_eq!(attack.len(), 105_000);
    let answers = send_all(&s, attack, 64).await;
    let denied = answers
        .iter()
        .filter(|r| code(r) == Code::OverLimit)
        .count();
    assert_eq!(denied, 50_000 + 4_999);

    let (status, body) = http(
        s.http_addr,
        "GET",
        "/debug/offenders?domain=api&limit=3",
        "",
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(v["domain"], "api");
    let top = &v["offenders"][0];
    assert_eq!(top["descriptor"], "consumer=mallory", "{body}");
    let count = top["denied"].as_u64().expect("denied count");
    let error = top["max_error"].as_u64().expect("error bound");
    assert!(
        count >= 4_999 && count - error <= 4_999,
        "the true count lies within the reported bound: {body}"
    );
    assert!(v["offenders"].as_array().is_some_and(|a| a.len() <= 3));

    // Bounded memory: the tracker's own accounting stays under its documented bound.
    let offenders = &s
        .running
        .as_ref()
        .expect("running")
        .limiter()
        .telemetry()
        .offenders;
    let bound = offenders.settings().memory_bound_bytes();
    assert!(
        offenders.heap_bytes() <= bound,
        "{} > {bound}",
        offenders.heap_bytes()
    );

    // Domains with denials, and an unknown domain answers an empty list.
    let (_, body) = http(s.http_addr, "GET", "/debug/offenders", "").await;
    assert!(body.contains("\"api\""), "{body}");
    let (status, body) = http(s.http_addr, "GET", "/debug/offenders?domain=nope", "").await;
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(v["offenders"].as_array().map(Vec::len), Some(0));
    let (status, _) = http(s.http_addr, "GET", "/debug/offenders?limit=x", "").await;
    assert_eq!(status, 400);
    s.stop().await;
}
