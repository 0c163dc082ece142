//! Fuzz-style property tests (proptest, stable Rust): the YAML loader and the request path with
//! arbitrary input never panic, and every refusal is a clear error. The loader gets both raw
//! text and YAML built from sluice's own keys with arbitrary values (so the search reaches the
//! rule checks, not only the YAML parser); the request path gets arbitrary requests, decided on
//! the memory store against a config that exercises every feature.

use crate::support::*;
use proptest::prelude::*;
use sluice::clock::ManualClock;
use sluice::config::load_sources;
use sluice::proto::rate_limit_descriptor::{Entry, RateLimitOverride};
use sluice::proto::{RateLimitDescriptor, RateLimitRequest};
use sluice::service::{RateLimiter, RequestError, ServiceOptions};
use sluice::store::StoreStack;
use sluice::telemetry::Telemetry;
use std::sync::Arc;

const KEYS: &[&str] = &[
    "domain",
    "descriptors",
    "key",
    "value",
    "rate_limit",
    "rate_limits",
    "unit",
    "requests_per_unit",
    "unlimited",
    "name",
    "replaces",
    "shadow_mode",
    "quota_mode",
    "period",
    "algorithm",
    "burst",
    "applies_to_descendants",
    "record_usage",
    "counting",
    "hash_tag",
    "share_threshold",
    "metadata",
    "detailed_metric",
];
const VALUES: &[&str] = &[
    "second",
    "minute",
    "hour",
    "DAY",
    "fortnight",
    "0",
    "1",
    "5",
    "-1",
    "4294967296",
    "true",
    "false",
    "yes",
    "10s",
    "500ms",
    "0s",
    "1w",
    "2d",
    "token_bucket",
    "sliding_log",
    "sliding_window",
    "fixed_window",
    "envoyproxy",
    "all_or_nothing",
    "domain",
    "descriptor",
    "\"\"",
    "a*b",
    "*",
    "[]",
    "{}",
    "~",
    "x: y",
];

/// A YAML-ish document built from sluice's keys and odd values, nested a few levels.
fn yaml_like() -> impl Strategy<Value = String> {
    let line = (0usize..4, 0..KEYS.len(), 0..VALUES.len(), any::<bool>()).prop_map(
        |(depth, k, v, list)| {
            let indent = "  ".repeat(depth);
            let dash = if list { "- " } else { "" };
            format!("{indent}{dash}{}: {}", KEYS[k], VALUES[v])
        },
    );
    prop::collection::vec(line, 0..24).prop_map(|lines| {
        let mut s = String::from("domain: d\ndescriptors:\n");
        for l in lines {
            s.push_str(&l);
            s.push('\n');
        }
        s
    })
}

fn check_load(text: &str) {
    match load_sources(&[("f.yaml".to_string(), text.to_string())]) {
        Ok(_) => {}
        Err(errors) => {
            assert!(!errors.0.is_empty(), "an Err lists at least one error");
            for e in &errors.0 {
                let line = e.to_string();
                assert!(line.starts_with("f.yaml"), "names the file: {line}");
                assert!(!e.message.is_empty(), "says what is wrong: {line}");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn the_loader_never_panics_on_arbitrary_text(text in "\\PC{0,200}") {
        check_load(&text);
    }

    #[test]
    fn the_loader_never_panics_on_sluice_shaped_yaml(text in yaml_like()) {
        check_load(&text);
    }
}

const RULES: &str = r#"
domain: d
descriptors:
  - key: a
    rate_limits:
      - {requests_per_unit: 3, unit: second}
      - {requests_per_unit: 5, period: 10s, algorithm: sliding_log}
  - key: b
    value: "x*"
    share_threshold: true
    rate_limit: {requests_per_unit: 2, period: 1s, algorithm: token_bucket}
  - key: r
    value: r
    rate_limit: {requests_per_unit: 4, unit: minute, algorithm: sliding_window, applies_to_descendants: true}
    descriptors:
      - key: c
        quota_mode: true
        rate_limit: {requests_per_unit: 1, unit: hour}
"#;

fn descriptor() -> impl Strategy<Value = RateLimitDescriptor> {
    let entry = (
        prop::sample::select(vec!["a", "b", "r", "c", "", "zz"]),
        prop_oneof!["x[a-z]{0,3}", "r", "", "\\PC{0,12}"],
    )
        .prop_map(|(k, v)| Entry {
            key: k.to_string(),
            value: v,
        });
    (
        prop::collection::vec(entry, 0..4),
        prop::option::of(any::<u64>()),
        any::<bool>(),
        prop::option::of((any::<u32>(), -2i32..9)),
    )
        .prop_map(|(entries, hits, negative, limit)| RateLimitDescriptor {
            entries,
            hits_addend: hits,
            is_negative_hits: negative,
            limit: limit.map(|(requests_per_unit, unit)| RateLimitOverride {
                requests_per_unit,
                unit,
            }),
        })
}

fn request_strategy() -> impl Strategy<Value = RateLimitRequest> {
    (
        prop_oneof![Just("d".to_string()), Just(String::new()), "\\PC{0,8}"],
        prop::collection::vec(descriptor(), 0..5),
        any::<u32>(),
    )
        .prop_map(|(domain, descriptors, hits_addend)| RateLimitRequest {
            domain,
            descriptors,
            hits_addend,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_requests_are_decided_or_refused_clearly(reqs in prop::collection::vec(request_strategy(), 1..6)) {
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let clock = ManualClock::new(T0);
        let store = StoreStack::memory(Arc::new(clock.clone()), 1_000);
        let telemetry = Telemetry::new(Arc::new(clock)).expect("telemetry");
        let limiter = RateLimiter::new(rules(RULES), store, ServiceOptions::default(), telemetry);
        for req in reqs {
            let n = req.descriptors.len();
            match rt.block_on(limiter.should_rate_limit(req)) {
                Ok(r) => prop_assert_eq!(r.statuses.len(), n, "one status per descriptor"),
                Err(RequestError::Invalid(message)) => prop_assert!(!message.is_empty()),
                Err(other) => prop_assert!(false, "only INVALID_ARGUMENT may refuse: {other:?}"),
            }
        }
    }
}
