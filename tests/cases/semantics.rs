//! Decision semantics of envoyproxy/ratelimit (docs/semantics.md) over gRPC, including the reference
//! cases of its config tests: nested descriptors with bare-key defaults, wildcards, replaces,
//! unlimited, share_threshold, shadow modes, limit 0, hits_addend and overrides.

use crate::support::*;
use sluice::proto::rate_limit_descriptor::RateLimitOverride;
use sluice::proto::rate_limit_response::Code;
use sluice::service::ServiceOptions;
use std::time::Duration;

const NESTED: &str = r#"
domain: nested
descriptors:
  - key: key1
    value: value1
    descriptors:
      - key: subkey1
        rate_limit: {unit: second, requests_per_unit: 2}
      - key: subkey1
        value: special
        rate_limit: {unit: minute, requests_per_unit: 1}
  - key: key2
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: key2
    value: value2
    rate_limit: {unit: day, requests_per_unit: 1}
  - key: key3
    value: value3
    rate_limit: {unit: week, requests_per_unit: 4}
    descriptors:
      - key: subkey3
        value: x
        rate_limit: {unit: month, requests_per_unit: 5}
"#;

#[tokio::test]
async fn nested_descriptors_with_bare_key_defaults() {
    let s = TestServer::start(NESTED).await;

    // Bare key below an exact parent: any value, one counter per value.
    let a = one("nested", &[("key1", "value1"), ("subkey1", "a")]);
    let b = one("nested", &[("key1", "value1"), ("subkey1", "b")]);
    assert_eq!(admitted(&s, &a, 5).await, 2);
    assert_eq!(
        admitted(&s, &b, 5).await,
        2,
        "each value has its own counter"
    );

    // The exact value beats the bare key at the same level.
    let special = one("nested", &[("key1", "value1"), ("subkey1", "special")]);
    let r = s.call(special.clone()).await;
    assert_eq!(limit_of(&r.statuses[0]), Some((1, "MINUTE".into())));
    assert_eq!(admitted(&s, &special, 3).await, 0, "1/min already used");

    // Top-level bare key default vs exact value.
    let r = s.call(one("nested", &[("key2", "other")])).await;
    assert_eq!(limit_of(&r.statuses[0]), Some((3, "HOUR".into())));
    let r = s.call(one("nested", &[("key2", "value2")])).await;
    assert_eq!(limit_of(&r.statuses[0]), Some((1, "DAY".into())));

    // WEEK and MONTH units are reported as such.
    let r = s.call(one("nested", &[("key3", "value3")])).await;
    assert_eq!(limit_of(&r.statuses[0]), Some((4, "WEEK".into())));
    let r = s
        .call(one("nested", &[("key3", "value3"), ("subkey3", "x")]))
        .await;
    assert_eq!(limit_of(&r.statuses[0]), Some((5, "MONTH".into())));
    s.stop().await;
}

#[tokio::test]
async fn only_the_last_entry_supplies_a_limit_and_nothing_backtracks() {
    let s = TestServer::start(NESTED).await;
    // key1=value1 has children but no limit of its own.
    let r = s.call(one("nested", &[("key1", "value1")])).await;
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(r.statuses[0].current_limit, None);

    // Deeper than the config: key2 has a limit but no children -> nothing applies.
    let r = s
        .call(one("nested", &[("key2", "value2"), ("deeper", "x")]))
        .await;
    assert_eq!(r.statuses[0].current_limit, None);

    // key3=value3 matched, but subkey3=y matches nothing below it; no fallback to key3's limit.
    let r = s
        .call(one("nested", &[("key3", "value3"), ("subkey3", "y")]))
        .await;
    assert_eq!(r.statuses[0].current_limit, None);

    // Unknown key at the top level.
    let r = s.call(one("nested", &[("nope", "x")])).await;
    assert_eq!(r.statuses[0].current_limit, None);

    // An exact match at level one that has no matching child is not retried with the bare key:
    // key2=value2 (exact) has no children, so [key2=value2, subkey] matches nothing even though
    // a bare key2 exists.
    let r = s
        .call(one("nested", &[("key2", "value2"), ("subkey", "z")]))
        .await;
    assert_eq!(r.statuses[0].current_limit, None);
    s.stop().await;
}

const WILDCARDS: &str = r#"
domain: wild
descriptors:
  - key: path
    value: /exact/one
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: path
    value: /exact/*
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: path
    value: /api/*/users
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: path
    value: /v*/items/*
    rate_limit: {unit: minute, requests_per_unit: 4}
  - key: path
    value: "*"
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: path
    value: /never/*
    rate_limit: {unit: minute, requests_per_unit: 6}
  - key: path
    rate_limit: {unit: minute, requests_per_unit: 7}
  - key: shared
    value: tenant-*
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: separate
    value: tenant-*
    rate_limit: {unit: minute, requests_per_unit: 3}
"#;

#[tokio::test]
async fn wildcards_at_end_middle_and_multiple_in_file_order() {
    let s = TestServer::start(WILDCARDS).await;
    let limit = |r: &sluice::proto::RateLimitResponse| limit_of(&r.statuses[0]).map(|l| l.0);
    for (path, want) in [
        ("/exact/one", 1),    // exact beats wildcards
        ("/exact/two", 2),    // trailing wildcard
        ("/exact/", 2),       // `*` matches the empty run
        ("/api/v1/users", 3), // wildcard in the middle
        ("/api/v1/v2/users", 3),
        ("/v2/items/9", 4),    // two wildcards
        ("/api/v1/groups", 5), // catch-all wildcard
        ("/never/x", 5),       // first wildcard in file order wins over a later one
    ] {
        let r = s.call(one("wild", &[("path", path)])).await;
        assert_eq!(limit(&r), Some(want), "path {path}");
    }
    s.stop().await;
}

#[tokio::test]
async fn share_threshold_makes_wildcard_values_share_one_counter() {
    let s = TestServer::start(WILDCARDS).await;
    let mut ok = 0;
    for tenant in ["tenant-a", "tenant-b", "tenant-c", "tenant-d", "tenant-e"] {
        ok += admitted(&s, &one("wild", &[("shared", tenant)]), 1).await;
    }
    assert_eq!(ok, 3, "five values share the 3/min counter");

    let mut ok = 0;
    for tenant in ["tenant-a", "tenant-b", "tenant-c", "tenant-d", "tenant-e"] {
        ok += admitted(&s, &one("wild", &[("separate", tenant)]), 1).await;
    }
    assert_eq!(ok, 5, "without share_threshold each value counts alone");
    s.stop().await;
}

const REPLACES: &str = r#"
domain: rep
descriptors:
  - key: tier
    value: free
    rate_limit:
      name: free
      unit: minute
      requests_per_unit: 1
  - key: user
    value: vip
    rate_limit:
      name: vip
      unit: minute
      requests_per_unit: 5
      replaces:
        - name: free
  - key: unl
    rate_limit:
      unlimited: true
  - key: zero
    rate_limit: {unit: second, requests_per_unit: 0}
"#;

#[tokio::test]
async fn replaces_drops_the_named_limit() {
    let s = TestServer::start(REPLACES).await;
    let both = request(
        "rep",
        vec![desc(&[("tier", "free")]), desc(&[("user", "vip")])],
    );
    // The free 1/min limit is replaced by vip's 5/min when both match one request.
    assert_eq!(admitted(&s, &both, 7).await, 5);
    let r = s.call(both.clone()).await;
    assert_eq!(r.statuses[0].current_limit, None, "replaced: no limit");
    assert_eq!(status_code(&r.statuses[0]), Code::Ok);
    assert_eq!(limit_of(&r.statuses[1]).map(|l| l.0), Some(5));
    assert_eq!(
        r.statuses[1]
            .current_limit
            .as_ref()
            .map(|l| l.name.as_str()),
        Some("vip")
    );

    // Alone, the free limit applies and was never charged by the replaced calls.
    let free = one("rep", &[("tier", "free")]);
    assert_eq!(admitted(&s, &free, 3).await, 1);
    s.stop().await;
}

#[tokio::test]
async fn unlimited_is_never_counted() {
    let s = TestServer::start(REPLACES).await;
    let req = one("rep", &[("unl", "anything")]);
    for _ in 0..20 {
        let r = s.call(req.clone()).await;
        assert_eq!(code(&r), Code::Ok);
        assert_eq!(r.statuses[0].limit_remaining, u32::MAX);
        assert_eq!(r.statuses[0].current_limit, None);
    }
    s.stop().await;
}

#[tokio::test]
async fn requests_per_unit_zero_blocks_everything() {
    let s = TestServer::start(REPLACES).await;
    let r = s.call(one("rep", &[("zero", "z")])).await;
    assert_eq!(code(&r), Code::OverLimit);
    assert_eq!(r.statuses[0].limit_remaining, 0);
    assert_eq!(limit_of(&r.statuses[0]), Some((0, "SECOND".into())));
    s.clock.advance(Duration::from_secs(3600));
    let r = s.call(one("rep", &[("zero", "z")])).await;
    assert_eq!(code(&r), Code::OverLimit);
    s.stop().await;
}

const SIMPLE: &str = r#"
domain: d
counting: all_or_nothing
descriptors:
  - key: a
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: b
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: hour
    rate_limit: {unit: hour, requests_per_unit: 10}
"#;

#[tokio::test]
async fn statuses_follow_request_order_with_remaining_and_reset() {
    let s = TestServer::start(SIMPLE).await;
    s.clock.advance(Duration::from_secs(15)); // 45 s left in the minute window
    let req = request(
        "d",
        vec![
            desc(&[("a", "x")]),
            desc(&[("nomatch", "1")]),
            desc(&[("hour", "h")]),
        ],
    );
    let r = s.call(req.clone()).await;
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(r.statuses.len(), 3);
    assert_eq!(limit_of(&r.statuses[0]), Some((3, "MINUTE".into())));
    assert_eq!(r.statuses[0].limit_remaining, 2);
    assert_eq!(reset_secs(&r.statuses[0]), Some(45));
    assert_eq!(r.statuses[1].current_limit, None);
    assert_eq!(reset_secs(&r.statuses[1]), None);
    assert_eq!(limit_of(&r.statuses[2]), Some((10, "HOUR".into())));
    assert_eq!(r.statuses[2].limit_remaining, 9);
    assert_eq!(reset_secs(&r.statuses[2]), Some(3600 - 15));
    s.stop().await;
}

#[tokio::test]
async fn fixed_window_resets_at_the_window_boundary() {
    let s = TestServer::start(SIMPLE).await;
    let req = one("d", &[("a", "x")]);
    assert_eq!(admitted(&s, &req, 5).await, 3);
    s.clock.advance(Duration::from_secs(59));
    let r = s.call(req.clone()).await;
    assert_eq!(code(&r), Code::OverLimit);
    assert_eq!(reset_secs(&r.statuses[0]), Some(1));
    s.clock.advance(Duration::from_secs(1));
    assert_eq!(admitted(&s, &req, 5).await, 3, "a fresh window");
    s.stop().await;
}

#[tokio::test]
async fn a_rejected_request_charges_nothing() {
    let s = TestServer::start(SIMPLE).await;
    // b allows 1/min. Exhaust it, then send [a, b]: b denies, so a must not be charged.
    assert_eq!(admitted(&s, &one("d", &[("b", "y")]), 1).await, 1);
    let both = request("d", vec![desc(&[("a", "x")]), desc(&[("b", "y")])]);
    for _ in 0..10 {
        let r = s.call(both.clone()).await;
        assert_eq!(code(&r), Code::OverLimit);
        assert_eq!(status_code(&r.statuses[0]), Code::Ok);
        assert_eq!(status_code(&r.statuses[1]), Code::OverLimit);
        assert_eq!(r.statuses[0].limit_remaining, 3, "a untouched");
    }
    assert_eq!(admitted(&s, &one("d", &[("a", "x")]), 10).await, 3);
    s.stop().await;
}

#[tokio::test]
async fn two_descriptors_on_one_counter_add_up() {
    let s = TestServer::start(SIMPLE).await;
    // Two descriptors hitting the same counter in one request need 2 hits of room.
    let twice = request("d", vec![desc(&[("a", "x")]), desc(&[("a", "x")])]);
    let r = s.call(twice.clone()).await;
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(r.statuses[1].limit_remaining, 1);
    let r = s.call(twice).await;
    assert_eq!(code(&r), Code::OverLimit, "1 left, 2 needed");
    assert_eq!(admitted(&s, &one("d", &[("a", "x")]), 5).await, 1);
    s.stop().await;
}

#[tokio::test]
async fn per_rule_shadow_mode_reports_ok_but_counts() {
    let s = TestServer::start(SIMPLE).await;
    let req = one("d", &[("shadow", "s")]);
    let r = s.call(req.clone()).await;
    assert_eq!(r.statuses[0].limit_remaining, 0);
    for _ in 0..5 {
        let r = s.call(req.clone()).await;
        assert_eq!(code(&r), Code::Ok);
        assert_eq!(status_code(&r.statuses[0]), Code::Ok);
        assert_eq!(r.statuses[0].limit_remaining, 0, "counted as usual");
    }
    // A shadow limit never makes a real limit's request fail, and a real denial still denies.
    assert_eq!(admitted(&s, &one("d", &[("b", "y")]), 1).await, 1);
    let mixed = request("d", vec![desc(&[("shadow", "s")]), desc(&[("b", "y")])]);
    assert_eq!(code(&s.call(mixed).await), Code::OverLimit);
    s.stop().await;
}

#[tokio::test]
async fn global_shadow_mode_always_answers_ok() {
    let s = TestServer::start_with(
        SIMPLE,
        ServiceOptions {
            global_shadow_mode: true,
            ..Default::default()
        },
    )
    .await;
    let req = one("d", &[("b", "y")]);
    let first = s.call(req.clone()).await;
    assert_eq!(code(&first), Code::Ok);
    assert_eq!(first.statuses[0].limit_remaining, 0);
    let r = s.call(req).await;
    assert_eq!(code(&r), Code::Ok, "overall OK in global shadow mode");
    assert_eq!(
        status_code(&r.statuses[0]),
        Code::OverLimit,
        "the descriptor still shows what would have happened"
    );
    s.stop().await;
}

#[tokio::test]
async fn unknown_domain_is_ok_without_limits() {
    let s = TestServer::start(SIMPLE).await;
    let r = s.call(one("no-such-domain", &[("a", "x")])).await;
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(r.statuses.len(), 1);
    assert_eq!(r.statuses[0].current_limit, None);
    s.stop().await;
}

#[tokio::test]
async fn request_hits_addend_charges_that_many() {
    let s = TestServer::start(SIMPLE).await;
    let mut req = one("d", &[("a", "x")]);
    req.hits_addend = 2;
    let r = s.call(req.clone()).await;
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 1);
    let r = s.call(req.clone()).await;
    assert_eq!(code(&r), Code::OverLimit, "2 more do not fit in 1");
    assert_eq!(r.statuses[0].limit_remaining, 1, "and nothing was charged");
    req.hits_addend = 0; // 0 means 1
    assert_eq!(admitted(&s, &req, 3).await, 1);
    s.stop().await;
}

#[tokio::test]
async fn per_descriptor_hits_addend_overrides_and_zero_only_checks() {
    let s = TestServer::start(SIMPLE).await;
    let mut check = desc(&[("a", "x")]);
    check.hits_addend = Some(0);
    let check_req = request("d", vec![check.clone()]);
    for _ in 0..10 {
        let r = s.call(check_req.clone()).await;
        assert_eq!(code(&r), Code::Ok);
        assert_eq!(r.statuses[0].limit_remaining, 3, "a check charges nothing");
    }
    // Per-descriptor value wins over the request's.
    let mut three = desc(&[("a", "x")]);
    three.hits_addend = Some(3);
    let mut req = request("d", vec![three]);
    req.hits_addend = 1;
    let r = s.call(req).await;
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 0);
    // Exhausted: the check now fails, still charging nothing.
    let r = s.call(check_req).await;
    assert_eq!(code(&r), Code::OverLimit);
    s.stop().await;
}

#[tokio::test]
async fn negative_hits_give_quota_back() {
    let s = TestServer::start(SIMPLE).await;
    let req = one("d", &[("a", "x")]);
    assert_eq!(admitted(&s, &req, 3).await, 3);
    let mut refund = desc(&[("a", "x")]);
    refund.hits_addend = Some(2);
    refund.is_negative_hits = true;
    let r = s.call(request("d", vec![refund])).await;
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 2);
    assert_eq!(admitted(&s, &req, 5).await, 2);
    s.stop().await;
}

#[tokio::test]
async fn descriptor_limit_override_replaces_the_configured_limit() {
    let s = TestServer::start(SIMPLE).await;
    let mut d = desc(&[("a", "x")]);
    d.limit = Some(RateLimitOverride {
        requests_per_unit: 5,
        unit: sluice::proto::envoy::r#type::v3::RateLimitUnit::Hour as i32,
    });
    let req = request("d", vec![d.clone()]);
    let r = s.call(req.clone()).await;
    assert_eq!(limit_of(&r.statuses[0]), Some((5, "HOUR".into())));
    assert_eq!(admitted(&s, &req, 10).await, 4);
    // The configured 3/min counter was not touched by the override's counter.
    assert_eq!(admitted(&s, &one("d", &[("a", "x")]), 10).await, 3);
    // A changed override starts a new counter, never a stale one.
    d.limit = Some(RateLimitOverride {
        requests_per_unit: 6,
        unit: sluice::proto::envoy::r#type::v3::RateLimitUnit::Hour as i32,
    });
    assert_eq!(admitted(&s, &request("d", vec![d.clone()]), 10).await, 6);
    // An override on a descriptor the config does not know still applies (known domain).
    let mut other = desc(&[("unconfigured", "v")]);
    other.limit = d.limit;
    assert_eq!(admitted(&s, &request("d", vec![other]), 10).await, 6);
    s.stop().await;
}

#[tokio::test]
async fn invalid_requests_get_invalid_argument() {
    let s = TestServer::start(SIMPLE).await;
    let mut client = s.client().await;
    let cases = vec![
        ("empty domain", request("", vec![desc(&[("a", "x")])])),
        ("no descriptors", request("d", vec![])),
        (
            "a domain over 1 KiB",
            request(&"d".repeat(1025), vec![desc(&[("a", "x")])]),
        ),
        ("descriptor without entries", request("d", vec![desc(&[])])),
        (
            "empty key",
            request("d", vec![desc(&[("a", "x"), ("", "v")])]),
        ),
        ("override without unit", {
            let mut d = desc(&[("a", "x")]);
            d.limit = Some(RateLimitOverride {
                requests_per_unit: 1,
                unit: 0,
            });
            request("d", vec![d])
        }),
    ];
    for (what, req) in cases {
        let err = client.should_rate_limit(req).await.expect_err(what);
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{what}: {err:?}");
        assert!(!err.message().is_empty(), "{what}: the error says why");
    }
    // The server keeps serving after bad input.
    assert_eq!(code(&s.call(one("d", &[("a", "x")])).await), Code::Ok);
    s.stop().await;
}

/// Each caller has its own connection, so with several serving threads the callers are spread
/// over them: the count stays exact because every thread decides on the one shared store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_concurrent_callers_against_a_limit_of_ten_get_exactly_ten() {
    for threads in [1, 4] {
        let s = TestServer::start_threads(
            r#"
domain: conc
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 10}
"#,
            threads,
        )
        .await;
        let req = one("conc", &[("k", "v")]);
        let mut tasks = Vec::new();
        for _ in 0..100 {
            let mut client = s.client().await;
            let req = req.clone();
            tasks.push(tokio::spawn(async move {
                client.should_rate_limit(req).await.map(|r| r.into_inner())
            }));
        }
        let mut ok = 0;
        let mut over = 0;
        for t in tasks {
            let r = t.await.expect("task").expect("call");
            match code(&r) {
                Code::Ok => ok += 1,
                Code::OverLimit => over += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!((ok, over), (10, 90), "{threads} serving thread(s)");
        s.stop().await;
    }
}

#[tokio::test]
async fn duration_until_reset_is_whole_seconds_rounded_up() {
    let s = TestServer::start(SIMPLE).await;
    s.clock.advance(Duration::from_millis(59_001)); // 0.999 s left in the minute
    let r = s.call(one("d", &[("a", "x")])).await;
    let d = r.statuses[0].duration_until_reset.expect("reset");
    assert_eq!((d.seconds, d.nanos), (1, 0));
    s.stop().await;
}
