//! Envoy's per-descriptor `limit` override (issue 38, review A6): it replaces the node's own
//! limits and never the resource limits above the node, on every store; an operator can turn
//! it off per domain (`allow_limit_override: false`) or for every domain
//! (`ALLOW_LIMIT_OVERRIDE=false`), and then the configured limit applies.

use super::store::make_store;
use crate::support::*;
use sluice::proto::envoy::r#type::v3::RateLimitUnit;
use sluice::proto::rate_limit_descriptor::RateLimitOverride;
use sluice::proto::rate_limit_response::Code;
use sluice::proto::RateLimitRequest;
use sluice::service::ServiceOptions;

const LLM: &str = r#"
domain: llm
descriptors:
  - key: resource
    value: gpt4
    rate_limit: {unit: minute, requests_per_unit: 3, applies_to_descendants: true}
    descriptors:
      - key: consumer
        rate_limit: {unit: minute, requests_per_unit: 2}
"#;

/// `[resource=gpt4, consumer=<who>]`, overridden to 1 000 a minute.
fn overridden(who: &str) -> RateLimitRequest {
    let mut d = desc(&[("resource", "gpt4"), ("consumer", who)]);
    d.limit = Some(RateLimitOverride {
        requests_per_unit: 1000,
        unit: RateLimitUnit::Minute as i32,
    });
    request("llm", vec![d])
}

/// The codes of `n` calls of `req`.
async fn codes(s: &TestServer, req: &RateLimitRequest, n: usize) -> Vec<Code> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(code(&s.call(req.clone()).await));
    }
    out
}

async fn overrides_keep_the_resource_limits(kind: &str) {
    let (store, clock, _backend) = make_store(kind).await;
    let s = TestServer::start_on(LLM, ServiceOptions::default(), Some(store), clock).await;
    let (ok, over) = (Code::Ok, Code::OverLimit);
    // alice's override lifts her own 2/min, not gpt4's 3/min over all consumers.
    assert_eq!(
        codes(&s, &overridden("alice"), 5).await,
        [ok, ok, ok, over, over],
        "{kind}: the resource's budget holds under an override"
    );
    let bob = one("llm", &[("resource", "gpt4"), ("consumer", "bob")]);
    assert_eq!(
        codes(&s, &bob, 1).await,
        [over],
        "{kind}: alice's overridden requests were charged to gpt4"
    );
    let r = s.call(overridden("carol")).await;
    assert_eq!(code(&r), over, "{kind}: gpt4 is spent for carol too");
    assert_eq!(
        limit_of(&r.statuses[0]).map(|(n, _)| n),
        Some(3),
        "{kind}: the limit that denied is the one answered"
    );
    s.stop().await;
}

test_with_all_stores!(an_override_below_a_resource_is_denied_when_the_resource_is_spent_on, kind => overrides_keep_the_resource_limits);

async fn overrides_off(kind: &str) {
    // Per domain.
    let (store, clock, _backend) = make_store(kind).await;
    let off = LLM.replace(
        "domain: llm\n",
        "domain: llm\nallow_limit_override: false\n",
    );
    let s = TestServer::start_on(&off, ServiceOptions::default(), Some(store), clock).await;
    let (ok, over) = (Code::Ok, Code::OverLimit);
    let r = s.call(overridden("alice")).await;
    assert_eq!(
        limit_of(&r.statuses[0]).map(|(n, _)| n),
        Some(2),
        "{kind}: the configured limit answers, not the override"
    );
    assert_eq!(
        codes(&s, &overridden("alice"), 2).await,
        [ok, over],
        "{kind}: alice's configured 2/min applies"
    );
    s.stop().await;

    // For every domain, unless the domain says otherwise.
    let global_off = ServiceOptions {
        allow_limit_override: false,
        ..ServiceOptions::default()
    };
    let (store, clock, _backend) = make_store(kind).await;
    let s = TestServer::start_on(LLM, global_off.clone(), Some(store), clock).await;
    assert_eq!(codes(&s, &overridden("dave"), 3).await, [ok, ok, over]);
    s.stop().await;
    let (store, clock, _backend) = make_store(kind).await;
    let on = LLM.replace("domain: llm\n", "domain: llm\nallow_limit_override: true\n");
    let s = TestServer::start_on(&on, global_off, Some(store), clock).await;
    assert_eq!(
        codes(&s, &overridden("erin"), 4).await,
        [ok, ok, ok, over],
        "{kind}: the domain allows it: erin's own 2/min is lifted, gpt4's 3/min holds"
    );
    s.stop().await;
}

test_with_all_stores!(with_overrides_off_the_configured_limit_applies_on, kind => overrides_off);
