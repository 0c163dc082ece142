//! `in_flight` limits on every store: a slot per request, taken by the request-time call (the
//! descriptor ends in `id_key`), freed by the stream-done call (`done_key`) or when its lease
//! ends. The id is the caller's and buys nothing: the same id twice needs two free slots, a
//! denied take is remembered so its done call frees no one's slot, and a done without a slot is
//! a no-op. The Envoy test (`envoy_in_flight.rs`) drives the same through a real Envoy.

use super::store::make_store;
use crate::support::*;
use sluice::proto::rate_limit_response::Code;
use sluice::service::ServiceOptions;
use std::time::Duration;

const CONFIG: &str = r#"
domain: ai
descriptors:
  - key: tenant
    in_flight: {max: 3, lease: 5s, id_key: request_id, done_key: request_done}
    rate_limit: {unit: hour, requests_per_unit: 1000}
"#;

pub(super) fn take(tenant: &str, id: &str) -> sluice::proto::RateLimitRequest {
    one("ai", &[("tenant", tenant), ("request_id", id)])
}

pub(super) fn done(tenant: &str, id: &str) -> sluice::proto::RateLimitRequest {
    one("ai", &[("tenant", tenant), ("request_done", id)])
}

async fn slots_are_taken_freed_and_end_with_their_lease(kind: &str) {
    let (store, clock, _backend) = make_store(kind).await;
    let s = TestServer::start_on(
        CONFIG,
        ServiceOptions::default(),
        Some(store),
        clock.clone(),
    )
    .await;
    for id in ["a", "b", "c"] {
        assert_eq!(
            code(&s.call(take("t", id)).await),
            Code::Ok,
            "{kind}: {id} takes a slot"
        );
    }
    let r = s.call(take("t", "d")).await;
    assert_eq!(code(&r), Code::OverLimit, "{kind}: a 4th request in flight");
    // The in_flight status speaks: nothing free, a retry when the first lease ends.
    let denied = r
        .statuses
        .iter()
        .find(|st| status_code(st) == Code::OverLimit);
    assert_eq!(denied.map(|st| st.limit_remaining), Some(0), "{kind}");
    // Another tenant has its own slots.
    assert_eq!(
        code(&s.call(take("u", "d")).await),
        Code::Ok,
        "{kind}: tenant u"
    );
    // The same id again needs a free slot of its own: denied, and remembered.
    assert_eq!(
        code(&s.call(take("t", "a")).await),
        Code::OverLimit,
        "{kind}: a second take of a"
    );
    // A done without a slot frees nothing.
    assert_eq!(
        code(&s.call(done("t", "zz")).await),
        Code::Ok,
        "{kind}: done of no slot"
    );
    assert_eq!(
        code(&s.call(take("t", "e")).await),
        Code::OverLimit,
        "{kind}: still full"
    );
    // The first done of a stands for the denied take (Envoy makes a denied request's done call
    // too): a's slot stays held, whichever of a's requests ended.
    assert_eq!(
        code(&s.call(done("t", "a")).await),
        Code::Ok,
        "{kind}: done of a"
    );
    assert_eq!(
        code(&s.call(take("t", "f")).await),
        Code::OverLimit,
        "{kind}: a denied take's done frees no one"
    );
    // The second frees a's slot.
    assert_eq!(
        code(&s.call(done("t", "a")).await),
        Code::Ok,
        "{kind}: done of a again"
    );
    assert_eq!(
        code(&s.call(take("t", "d")).await),
        Code::Ok,
        "{kind}: d takes a's slot"
    );
    assert_eq!(
        code(&s.call(take("t", "e")).await),
        Code::OverLimit,
        "{kind}: full again"
    );
    // A descriptor without the id entry checks without taking.
    let check = one("ai", &[("tenant", "t")]);
    assert_eq!(
        code(&s.call(check.clone()).await),
        Code::OverLimit,
        "{kind}: check, full"
    );
    // Leases end: b, c and d taken at this clock's start free themselves after 5 s.
    clock.advance(Duration::from_secs(5));
    assert_eq!(code(&s.call(check).await), Code::Ok, "{kind}: check, free");
    for id in ["f", "g", "h"] {
        assert_eq!(
            code(&s.call(take("t", id)).await),
            Code::Ok,
            "{kind}: {id} after the lease"
        );
    }
    assert_eq!(
        code(&s.call(take("t", "i")).await),
        Code::OverLimit,
        "{kind}: max again"
    );
    s.stop().await;
}

test_with_all_stores!(in_flight_on, kind => slots_are_taken_freed_and_end_with_their_lease);

/// A request id longer than the cap is refused: each id is kept with its counter while its slot
/// is held.
#[tokio::test]
async fn a_long_request_id_is_invalid_argument() {
    let s = TestServer::start(CONFIG).await;
    let long = "x".repeat(10 * 1024);
    let err = s
        .client()
        .await
        .should_rate_limit(take("t", &long))
        .await
        .expect_err("a 10 KB id is refused");
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    assert_eq!(code(&s.call(take("t", &"x".repeat(128))).await), Code::Ok);
    s.stop().await;
}

/// An `in_flight` limit is not a rate: the response reports its slots with unit UNKNOWN and says
/// what it is, and the slots left.
#[tokio::test]
async fn the_response_reports_slots_not_a_rate() {
    let s = TestServer::start(CONFIG).await;
    let r = s.call(take("t", "a")).await;
    let status = r
        .statuses
        .iter()
        .find(|st| {
            st.current_limit
                .as_ref()
                .is_some_and(|l| l.requests_per_unit == 3)
        })
        .expect("the in_flight status");
    assert_eq!(limit_of(status), Some((3, "UNKNOWN".into())));
    assert_eq!(
        status.current_limit.as_ref().map(|l| l.name.as_str()),
        Some("3 in flight, lease 5s")
    );
    s.stop().await;
}

/// 100 000 distinct request ids against one counter: each take denied past `max` holds
/// nothing, so the counter keeps `max` slots (memory: the store's one counter; Redis: the
/// sorted set's size) and at most 64 denial records beside them (the rest one overflow count),
/// and every later take is decided the same. The denied requests' done calls (as Envoy makes
/// them) consume those denials; then a free of a holder lets exactly one more in.
async fn distinct_ids_keep_the_counter_at_max(kind: &str) {
    use sluice::config::{Algorithm, Limit, Period};
    use sluice::store::{LeaseCall, LimitCheck};
    let (store, _clock, backend) = make_store(kind).await;
    let limit = Limit {
        requests_per_unit: 3,
        period: Period::from_millis(60_000).expect("1 min"),
        algorithm: Algorithm::InFlight,
        burst: 0,
    };
    let check = |i: u32| {
        let mut c = LimitCheck::for_tests("ai", "flood", limit, 1);
        c.lease = Some(LeaseCall {
            id: std::sync::Arc::from(format!("request-{i}")),
            release: false,
            reservations: None,
        });
        c
    };
    let mut admitted = Vec::new();
    for chunk in (0..100_000u32).collect::<Vec<_>>().chunks(500) {
        let decisions = futures_util::future::join_all(chunk.iter().map(|&i| {
            let store = store.clone();
            async move { (i, store.decide(&[check(i)]).await.expect("decided")) }
        }))
        .await;
        admitted.extend(
            decisions
                .iter()
                .filter(|(_, d)| d.admitted)
                .map(|(i, _)| *i),
        );
    }
    assert_eq!(
        admitted.len(),
        3,
        "{kind}: max slots taken, every other id denied"
    );
    match &backend {
        super::store::Backend::Redis(r) => {
            let keys = r.cli(&["--scan", "--pattern", "*flood*"]);
            let mut keys: Vec<&str> = keys.lines().map(str::trim).collect();
            keys.sort_unstable();
            let key = keys.first().expect("the slots' key");
            assert_eq!(r.cli(&["ZCARD", key]).trim(), "3", "{kind}: slots kept");
            let denials = format!("{key}:d");
            assert_eq!(
                r.cli(&["ZCARD", &denials]).trim(),
                "65",
                "{kind}: 64 denial records and the overflow"
            );
            assert_eq!(
                r.cli(&["DBSIZE"]).trim(),
                "3",
                "{kind}: slots, counts, denials"
            );
        }
        super::store::Backend::Cluster(c) => {
            let sizes: u64 = (0..3)
                .map(|n| c.cli(n, &["DBSIZE"]).trim().parse::<u64>().unwrap_or(0))
                .sum();
            assert_eq!(sizes, 3, "{kind}: slots, counts, denials");
        }
        super::store::Backend::Memory => {}
    }
    // The denied requests' done calls: each consumes a denial, none frees a slot.
    let done = |i: u32| {
        let mut c = check(i);
        c.lease = Some(LeaseCall {
            id: std::sync::Arc::from(format!("request-{i}")),
            release: true,
            reservations: None,
        });
        c.record = true;
        c
    };
    let denied: Vec<u32> = (0..100_000u32).filter(|i| !admitted.contains(i)).collect();
    for chunk in denied.chunks(500) {
        futures_util::future::join_all(chunk.iter().map(|&i| {
            let store = store.clone();
            async move { store.decide(&[done(i)]).await.expect("done") }
        }))
        .await;
    }
    assert!(
        !store
            .decide(&[check(100_000)])
            .await
            .expect("full")
            .admitted,
        "{kind}: the holders' slots are all still held"
    );
    // The store still decides: a free of a holder lets exactly one more in.
    assert!(
        store
            .decide(&[done(admitted[0])])
            .await
            .expect("freed")
            .admitted
    );
    assert!(
        store
            .decide(&[check(100_001)])
            .await
            .expect("taken")
            .admitted,
        "{kind}"
    );
    assert!(
        !store
            .decide(&[check(100_002)])
            .await
            .expect("full")
            .admitted,
        "{kind}"
    );
}

test_with_all_stores!(a_flood_of_ids_on, kind => distinct_ids_keep_the_counter_at_max);

/// In-flight denials are visible: `/debug/offenders` names the tenant (without the request id,
/// which differs per request), and `sluice_lease_calls_total` counts takes, frees and checks by
/// outcome.
#[tokio::test]
async fn denials_show_in_offenders_and_the_lease_calls_metric() {
    let s = TestServer::start(CONFIG).await;
    for id in ["a", "b", "c", "d", "e"] {
        s.call(take("t", id)).await;
    }
    s.call(done("t", "a")).await;
    s.call(one("ai", &[("tenant", "t")])).await;
    let (status, body) = http(s.http_addr, "GET", "/debug/offenders?domain=ai", "").await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains(r#"{"descriptor":"tenant=t","denied":2"#),
        "{body}"
    );
    let (_, metrics) = http(s.http_addr, "GET", "/metrics", "").await;
    for (line, n) in [
        (r#"call="take",domain="ai",outcome="ok""#, 3),
        (r#"call="take",domain="ai",outcome="over_limit""#, 2),
        (r#"call="free",domain="ai",outcome="ok""#, 1),
        (r#"call="check",domain="ai",outcome="ok""#, 1),
    ] {
        let want = format!("sluice_lease_calls_total{{{line}}} {n}");
        assert!(metrics.contains(&want), "{want}\n{metrics}");
    }
    s.stop().await;
}
