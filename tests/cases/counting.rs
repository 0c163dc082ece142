//! A domain's `counting`, through the gRPC API on every store: envoyproxy counting records usage
//! Envoy reports after a response (token budgets), also past the limit; `all_or_nothing` charges
//! a rejected request nothing, except limits that record usage (`record_usage: true`).

use super::store::make_store;
use crate::support::*;
use sluice::proto::rate_limit_response::Code;
use sluice::service::ServiceOptions;
use sluice::store::local_cache::LocalDenyCache;
use sluice::store::CounterStore;
use sluice::store::DenialFinality;
use std::sync::Arc;

/// A token budget of 1000 per hour, in an envoyproxy domain, and the same budget as a
/// `record_usage` limit under a resource limit in an all_or_nothing domain.
const BUDGETS: &str = r#"
domain: tokens
descriptors:
  - key: model
    rate_limit: {unit: hour, requests_per_unit: 1000}
"#;

const BUDGET_IN_HIERARCHY: &str = r#"
domain: tokens_aon
counting: all_or_nothing
descriptors:
  - key: resource
    value: llm
    rate_limit: {unit: hour, requests_per_unit: 1000000, applies_to_descendants: true}
    descriptors:
      - key: model
        rate_limit: {unit: hour, requests_per_unit: 1000, record_usage: true}
"#;

/// AI Gateway's shape on ONE descriptor: a request-phase check (`hits_addend: 0`) that decides,
/// then the report at stream end with the tokens the response used (its answer is ignored).
/// Returns the HTTP status Envoy would give each of `n` requests.
async fn token_sequence(
    s: &TestServer,
    domain: &str,
    entries: &[(&str, &str)],
    tokens: u64,
    n: usize,
) -> Vec<u16> {
    let mut statuses = Vec::new();
    for _ in 0..n {
        let mut check = desc(entries);
        check.hits_addend = Some(0);
        let r = s.call(request(domain, vec![check])).await;
        let denied = code(&r) == Code::OverLimit;
        statuses.push(if denied { 429 } else { 200 });
        if !denied {
            let mut report = desc(entries);
            report.hits_addend = Some(tokens);
            s.call(request(domain, vec![report])).await;
        }
    }
    statuses
}

async fn token_budgets(kind: &str) {
    for (yaml, domain, entries) in [
        (BUDGETS, "tokens", &[("model", "m")][..]),
        (
            BUDGET_IN_HIERARCHY,
            "tokens_aon",
            &[("resource", "llm"), ("model", "m")][..],
        ),
    ] {
        for (tokens, expected) in [
            (400, vec![200, 200, 200, 429, 429, 429, 429, 429]),
            (250, vec![200, 200, 200, 200, 200, 429, 429, 429]),
        ] {
            let (store, clock, _backend) = make_store(kind).await;
            let s = TestServer::start_on(yaml, ServiceOptions::default(), Some(store), clock).await;
            // Each sequence on its own model, so the two do not share a counter.
            let model = format!("m{tokens}");
            let entries: Vec<(&str, &str)> = entries
                .iter()
                .map(|&(k, v)| {
                    if k == "model" {
                        (k, model.as_str())
                    } else {
                        (k, v)
                    }
                })
                .collect();
            assert_eq!(
                token_sequence(&s, domain, &entries, tokens, 8).await,
                expected,
                "{kind}: {domain}, responses of {tokens} tokens"
            );
            s.stop().await;
        }
    }
}

test_with_all_stores!(token_budgets_record_every_report_on, kind => token_budgets);

const TWO: &str = r#"
domain: two
descriptors:
  - key: a
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: b
    rate_limit: {unit: hour, requests_per_unit: 1}
"#;

/// `a`'s remaining after one `[a, b]` request with `b` already over its limit.
async fn a_left_after_b_denies(kind: &str, yaml: &str, options: ServiceOptions) -> u32 {
    let (store, clock, _backend) = make_store(kind).await;
    let s = TestServer::start_on(yaml, options, Some(store), clock).await;
    let b = one("two", &[("b", "y")]);
    assert_eq!(code(&s.call(b.clone()).await), Code::Ok);
    assert_eq!(code(&s.call(b).await), Code::OverLimit, "{kind}: b is full");
    let both = request("two", vec![desc(&[("a", "x")]), desc(&[("b", "y")])]);
    assert_eq!(code(&s.call(both).await), Code::OverLimit);
    let mut peek = desc(&[("a", "x")]);
    peek.hits_addend = Some(0);
    let r = s.call(request("two", vec![peek])).await;
    s.stop().await;
    r.statuses[0].limit_remaining
}

async fn a_denied_descriptor_and_the_other_one(kind: &str) {
    let envoyproxy = a_left_after_b_denies(kind, TWO, ServiceOptions::default()).await;
    assert_eq!(
        envoyproxy, 9,
        "{kind}: envoyproxy charges the other descriptor"
    );
    let stop = ServiceOptions {
        stop_increment_when_over: true,
        ..ServiceOptions::default()
    };
    assert_eq!(
        a_left_after_b_denies(kind, TWO, stop).await,
        10,
        "{kind}: STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT charges only the key over its limit"
    );
    let aon = TWO.replace("domain: two\n", "domain: two\ncounting: all_or_nothing\n");
    assert_eq!(
        a_left_after_b_denies(kind, &aon, ServiceOptions::default()).await,
        10,
        "{kind}: all_or_nothing charges nothing"
    );
    // The global COUNTING is what a domain without `counting:` gets.
    let global = ServiceOptions {
        counting: sluice::config::Counting::AllOrNothing,
        ..ServiceOptions::default()
    };
    assert_eq!(a_left_after_b_denies(kind, TWO, global).await, 10, "{kind}");
}

test_with_all_stores!(a_denied_descriptor_charges_the_other_by_counting_on, kind => a_denied_descriptor_and_the_other_one);

/// The local deny cache follows the same rule: a key it holds is skipped, the request's other
/// keys are still charged under envoyproxy counting, and nothing is with STOP_CACHE_KEY_...
async fn deny_cache_case(kind: &str, stop: bool) -> (u32, u64) {
    let (inner, clock, _backend) = make_store(kind).await;
    let finality = if kind.ends_with("cluster") {
        DenialFinality::DomainTaggedOnly
    } else {
        DenialFinality::Always
    };
    let cache = Arc::new(LocalDenyCache::new(
        inner,
        1 << 20,
        Arc::new(clock.clone()),
        finality,
    ));
    let store: Arc<dyn CounterStore> = cache.clone();
    let options = ServiceOptions {
        stop_increment_when_over: stop,
        ..ServiceOptions::default()
    };
    let s = TestServer::start_on(TWO, options, Some(store), clock).await;
    let b = one("two", &[("b", "y")]);
    s.call(b.clone()).await;
    // Over: b is now in the deny cache.
    assert_eq!(code(&s.call(b).await), Code::OverLimit);
    let both = request("two", vec![desc(&[("a", "x")]), desc(&[("b", "y")])]);
    let r = s.call(both).await;
    assert_eq!(code(&r), Code::OverLimit);
    assert_eq!(status_code(&r.statuses[1]), Code::OverLimit);
    let mut peek = desc(&[("a", "x")]);
    peek.hits_addend = Some(0);
    let left = s.call(request("two", vec![peek])).await.statuses[0].limit_remaining;
    s.stop().await;
    (left, cache.local_denials())
}

async fn deny_cache_follows_the_counting(kind: &str) {
    let (left, _) = deny_cache_case(kind, false).await;
    assert_eq!(left, 9, "{kind}: a charged, b skipped (cached)");
    let (left, local) = deny_cache_case(kind, true).await;
    assert_eq!(left, 10, "{kind}: with stop nothing is charged");
    if !kind.ends_with("cluster") {
        // (A Cluster denial of a descriptor-scoped key is not final, so never cached.)
        assert_eq!(local, 1, "{kind}: answered locally, without the store");
    }
}

test_with_all_stores!(the_deny_cache_follows_the_counting_on, kind => deny_cache_follows_the_counting);

/// `quota_mode` limits under envoyproxy counting are charged like any other; a huge
/// `hits_addend` saturates instead of wrapping and is recorded, never refused.
async fn quota_and_huge_hits(kind: &str) {
    let (store, clock, _backend) = make_store(kind).await;
    let yaml = r#"
domain: q
descriptors:
  - key: budget
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1000}
  - key: huge
    rate_limit: {unit: hour, requests_per_unit: 5}
"#;
    let s = TestServer::start_on(yaml, ServiceOptions::default(), Some(store), clock).await;
    let mut report = desc(&[("budget", "x")]);
    report.hits_addend = Some(1200);
    s.call(request("q", vec![report])).await;
    let mut check = desc(&[("budget", "x")]);
    check.hits_addend = Some(0);
    let r = s.call(request("q", vec![check])).await;
    assert_eq!(
        code(&r),
        Code::OverLimit,
        "{kind}: 1200 recorded on a quota limit"
    );
    for _ in 0..3 {
        let mut big = desc(&[("huge", "h")]);
        big.hits_addend = Some(u64::MAX - 1);
        let r = s.call(request("q", vec![big])).await;
        assert_eq!(
            code(&r),
            Code::OverLimit,
            "{kind}: recorded, over the limit"
        );
        assert_eq!(r.statuses[0].limit_remaining, 0);
    }
    let mut check = desc(&[("huge", "h")]);
    check.hits_addend = Some(0);
    let r = s.call(request("q", vec![check])).await;
    assert_eq!(
        code(&r),
        Code::OverLimit,
        "{kind}: the saturated count stays over"
    );
    s.stop().await;
}

test_with_all_stores!(quota_limits_and_huge_hits_are_recorded_on, kind => quota_and_huge_hits);

/// Recording past the limit cannot grow a sliding_log without bound: once the log holds as many
/// entries as the limit, a recorded charge joins the newest entry. 200 recorded requests (and
/// huge hits) on a limit of 5 leave at most 5 entries in the Redis sorted set.
async fn sliding_log_stays_bounded(kind: &str) {
    let (store, clock, backend) = make_store(kind).await;
    let yaml = r#"
domain: logs
descriptors:
  - key: k
    rate_limit: {requests_per_unit: 5, period: 1h, algorithm: sliding_log}
"#;
    let s = TestServer::start_on(yaml, ServiceOptions::default(), Some(store), clock.clone()).await;
    for i in 0..200u64 {
        let mut d = desc(&[("k", "flood")]);
        d.hits_addend = Some(if i % 50 == 0 { u64::MAX } else { 1 });
        s.call(request("logs", vec![d])).await;
        clock.advance(std::time::Duration::from_millis(3));
    }
    let mut peek = desc(&[("k", "flood")]);
    peek.hits_addend = Some(0);
    let r = s.call(request("logs", vec![peek])).await;
    assert_eq!(code(&r), Code::OverLimit, "{kind}");
    let cards: Vec<u64> = match &backend {
        super::store::Backend::Memory => vec![],
        super::store::Backend::Redis(r) => r
            .keys_with_ttl()
            .into_iter()
            .map(|(k, _)| r.cli(&["ZCARD", &k]).trim().parse().unwrap_or(0))
            .collect(),
        super::store::Backend::Cluster(c) => c
            .keys_with_ttl()
            .into_iter()
            .map(|(k, _)| c.cli_cluster(&["ZCARD", &k]).trim().parse().unwrap_or(0))
            .collect(),
    };
    if kind != "memory" {
        assert_eq!(cards.len(), 1, "{kind}: one sorted set");
        assert!(
            cards[0] <= 5,
            "{kind}: {} entries for a limit of 5",
            cards[0]
        );
    }
    s.stop().await;
}

test_with_all_stores!(a_recorded_sliding_log_stays_within_its_limit_on, kind => sliding_log_stays_bounded);
