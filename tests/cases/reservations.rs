//! `reservations` on every store: the request-time call (the descriptor ends in `id_key`)
//! reserves its hits (the estimate) and is admitted only if used + reserved + estimate fits;
//! the stream-done call (`done_key`) settles at the actual, never denied; a reservation whose
//! settle never comes stays charged at its estimate. On Redis the settle goes through a second
//! replica (its own store and server on the same Redis). The Envoy test (`envoy_reservations.rs`)
//! drives the same through a real Envoy.

use super::store::{make_store, redis_store, Backend};
use crate::support::*;
use sluice::proto::rate_limit_response::Code;
use sluice::proto::RateLimitRequest;
use sluice::service::ServiceOptions;
use sluice::store::redis::RedisKind;
use std::time::Duration;

const CONFIG: &str = r#"
domain: ai
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000}
    reservations: {lease: 5m, id_key: request_id, done_key: request_done}
"#;

fn with_hits(mut r: RateLimitRequest, hits: u64) -> RateLimitRequest {
    r.descriptors[0].hits_addend = Some(hits);
    r
}

/// The request-time call of request `id` of `user`, reserving `estimate`.
pub(super) fn reserve(user: &str, id: &str, estimate: u64) -> RateLimitRequest {
    with_hits(one("ai", &[("user", user), ("request_id", id)]), estimate)
}

/// The stream-done call of request `id`, settling at `actual`.
pub(super) fn settle(user: &str, id: &str, actual: u64) -> RateLimitRequest {
    with_hits(one("ai", &[("user", user), ("request_done", id)]), actual)
}

/// Two replicas on `config`: on Redis two stores and servers on the same Redis, on memory one
/// store behind two servers. The backend is kept alive with them.
pub(super) async fn two_replicas(
    kind: &str,
    config: &str,
) -> (TestServer, TestServer, sluice::clock::ManualClock, Backend) {
    let (store, clock, backend) = make_store(kind).await;
    let other = match &backend {
        Backend::Memory => store.clone(),
        Backend::Redis(r) => redis_store(vec![r.url()], RedisKind::Single, &clock),
        Backend::Cluster(c) => redis_store(c.seeds(), RedisKind::Cluster, &clock),
    };
    let opts = ServiceOptions::default;
    let a = TestServer::start_on(config, opts(), Some(store), clock.clone()).await;
    let b = TestServer::start_on(config, opts(), Some(other), clock.clone()).await;
    (a, b, clock, backend)
}

/// A caller's estimate of 0 (or under the limit's `min_estimate`) reserves the floor: it never
/// turns a budget into a check (issue 37).
async fn an_estimate_under_the_floor_reserves_the_floor(kind: &str) {
    let config = r#"
domain: ai
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 10}
    reservations: {lease: 5m, id_key: request_id, done_key: request_done, min_estimate: 2}
"#;
    let (a, b, _clock, _backend) = two_replicas(kind, config).await;
    let calls = (0..10).map(|i| {
        let a = &a;
        async move { (i, code(&a.call(reserve("u", &format!("z{i}"), 0)).await)) }
    });
    let codes = futures_util::future::join_all(calls).await;
    let admitted: Vec<i32> = codes
        .iter()
        .filter(|(_, c)| *c == Code::Ok)
        .map(|(i, _)| *i)
        .collect();
    assert_eq!(
        admitted.len(),
        5,
        "{kind}: 10 estimates of 0 against 10, floored at 2: {codes:?}"
    );
    // A settle at the actual gives the floor back as any settle would.
    let first = format!("z{}", admitted[0]);
    assert_eq!(code(&b.call(settle("u", &first, 0)).await), Code::Ok);
    let r = a.call(reserve("u", "z10", 1)).await;
    assert_eq!(code(&r), Code::Ok, "{kind}: 2 given back, 2 reserved again");
    assert_eq!(r.statuses[0].limit_remaining, 0, "{kind}");
    a.stop().await;
    b.stop().await;
}

test_with_all_stores!(estimate_floor_on, kind => an_estimate_under_the_floor_reserves_the_floor);

async fn reservations_are_made_settled_and_kept(kind: &str) {
    // The replica that settles (b): on Redis another store and server on the same Redis.
    let (a, b, clock, _backend) = two_replicas(kind, CONFIG).await;

    // Budget 1000, estimate 400, 10 at once: exactly 2 fit.
    let calls = (0..10).map(|i| {
        let a = &a;
        async move { (i, code(&a.call(reserve("u", &format!("r{i}"), 400)).await)) }
    });
    let codes = futures_util::future::join_all(calls).await;
    let admitted: Vec<i32> = codes
        .iter()
        .filter(|(_, c)| *c == Code::Ok)
        .map(|(i, _)| *i)
        .collect();
    assert_eq!(admitted.len(), 2, "{kind}: {codes:?}");
    // They settle at 250 each, on the other replica (a settle is never denied).
    for i in &admitted {
        let r = b.call(settle("u", &format!("r{i}"), 250)).await;
        assert_eq!(code(&r), Code::Ok, "{kind}: settle of r{i}");
    }
    // 500 used: 500 + 400 fits, then 750 + 400 does not, twice.
    let mut seq = Vec::new();
    for id in ["s1", "s2", "s3"] {
        let c = code(&a.call(reserve("u", id, 400)).await);
        if c == Code::Ok {
            assert_eq!(code(&b.call(settle("u", id, 250)).await), Code::Ok);
        }
        seq.push(c);
    }
    assert_eq!(
        seq,
        [Code::Ok, Code::OverLimit, Code::OverLimit],
        "{kind}: sequential requests after the settles"
    );
    // 750 + 200 fits.
    let r = a.call(reserve("u", "s4", 200)).await;
    assert_eq!(code(&r), Code::Ok, "{kind}: an estimate of 200");
    assert_eq!(r.statuses[0].limit_remaining, 50, "{kind}: 950 used");
    // A settle above the estimate charges the difference: 750 + 300 = 1050, over the limit,
    // and the settle itself is still OK.
    assert_eq!(
        code(&b.call(settle("u", "s4", 300)).await),
        Code::Ok,
        "{kind}"
    );
    let r = a.call(reserve("u", "s5", 1)).await;
    assert_eq!(code(&r), Code::OverLimit, "{kind}: 1050 used");
    assert_eq!(r.statuses[0].limit_remaining, 0, "{kind}");
    // The same settle again finds no reservation: it records its hits (the caller sent it).
    // Another user: a settle without a reservation records 600; 400 more fit, 1 more not.
    assert_eq!(code(&b.call(settle("v", "zz", 600)).await), Code::Ok);
    assert_eq!(
        code(&a.call(reserve("v", "x1", 400)).await),
        Code::Ok,
        "{kind}"
    );
    assert_eq!(
        code(&a.call(reserve("v", "x2", 1)).await),
        Code::OverLimit,
        "{kind}: a done without a reservation recorded its hits"
    );
    // The id is the caller's and buys nothing: a second reservation with a held id is a
    // reservation of its own, charged and counted.
    assert_eq!(code(&a.call(reserve("w", "y", 600)).await), Code::Ok);
    assert_eq!(
        code(&a.call(reserve("w", "y", 600)).await),
        Code::OverLimit,
        "{kind}: 600 + 600 does not fit, whatever the id"
    );
    assert_eq!(
        code(&a.call(reserve("w", "y", 400)).await),
        Code::Ok,
        "{kind}: 600 + 400 under the same id"
    );
    // A reservation whose settle never comes stays charged at its estimate when its lease ends
    // (1000 used by w); a settle after the lease records its hits on top.
    clock.advance(Duration::from_secs(301));
    assert_eq!(
        code(&a.call(reserve("w", "y3", 1)).await),
        Code::OverLimit,
        "{kind}: unsettled reservations stay charged"
    );
    let r = b.call(settle("w", "y", 0)).await;
    assert_eq!(code(&r), Code::Ok, "{kind}: a late settle");
    assert_eq!(
        r.statuses[0].limit_remaining, 0,
        "{kind}: nothing given back"
    );
    a.stop().await;
    b.stop().await;
}

test_with_all_stores!(reservations_on, kind => reservations_are_made_settled_and_kept);

/// A settle below the estimate gives back only into the window that took it: a request reserved
/// just before an hour ends and settled after gives nothing to the new hour.
async fn a_give_back_stays_in_its_window(kind: &str) {
    let (store, clock, _backend) = make_store(kind).await;
    let s = TestServer::start_on(
        CONFIG,
        ServiceOptions::default(),
        Some(store),
        clock.clone(),
    )
    .await;
    clock.advance(Duration::from_secs(3599));
    assert_eq!(code(&s.call(reserve("u", "a", 900)).await), Code::Ok);
    clock.advance(Duration::from_secs(2));
    // In the new hour: 1000 left whatever the settle says.
    let r = s.call(settle("u", "a", 100)).await;
    assert_eq!(r.statuses[0].limit_remaining, 1000, "{kind}");
    assert_eq!(
        code(&s.call(reserve("u", "b", 1000)).await),
        Code::Ok,
        "{kind}"
    );
    s.stop().await;
}

test_with_all_stores!(give_back_window_on, kind => a_give_back_stays_in_its_window);

/// A server on `kind` with reservations on a sliding_log of 1 000 an hour.
async fn log_server(kind: &str) -> (TestServer, sluice::clock::ManualClock, Backend) {
    let config = r#"
domain: ai
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000, algorithm: sliding_log}
    reservations: {lease: 1h, id_key: request_id, done_key: request_done}
"#;
    let (store, clock, backend) = make_store(kind).await;
    let s = TestServer::start_on(
        config,
        ServiceOptions::default(),
        Some(store),
        clock.clone(),
    )
    .await;
    (s, clock, backend)
}

/// On a sliding_log, a settle gives back on the reservation's own log entry (review B9): hits
/// charged by other requests after the reservation keep counting for their whole period.
/// Reserved 900 at 0 s, another request's 100 at 1 800 s, settled at 100 at 1 900 s: at
/// 3 660 s the reservation's entry has left the period, the other request's 100 has not, so 900
/// are left (the give-back shrank the newest entries before: all 1 000 were).
async fn a_sliding_log_give_back_shrinks_its_own_entry(kind: &str) {
    let (s, clock, _backend) = log_server(kind).await;
    assert_eq!(
        code(&s.call(reserve("u", "a", 900)).await),
        Code::Ok,
        "{kind}"
    );
    clock.advance(Duration::from_secs(1800));
    let other = with_hits(one("ai", &[("user", "u")]), 100);
    assert_eq!(code(&s.call(other).await), Code::Ok, "{kind}");
    clock.advance(Duration::from_secs(100));
    let r = s.call(settle("u", "a", 100)).await;
    assert_eq!(
        r.statuses[0].limit_remaining, 800,
        "{kind}: 100 + 100 counted"
    );
    clock.advance(Duration::from_secs(1760));
    let peek = s.call(with_hits(one("ai", &[("user", "u")]), 0)).await;
    assert_eq!(
        peek.statuses[0].limit_remaining, 900,
        "{kind}: the other request's 100 still counts, the reservation's entry has left"
    );
    let r = s.call(with_hits(one("ai", &[("user", "u")]), 1000)).await;
    assert_eq!(
        code(&r),
        Code::OverLimit,
        "{kind}: 100 + 1000 in one period"
    );
    s.stop().await;
}

test_with_all_stores!(log_give_back_on, kind => a_sliding_log_give_back_shrinks_its_own_entry);

/// 100 000 distinct request ids against one counter with `max: 3`: a reservation past the cap
/// is denied and holds nothing, so memory keeps 3 entries and Redis 3 (a sorted set and a hash
/// beside the counter's window key); the budget itself takes only the admitted estimates.
async fn distinct_ids_keep_the_reservations_at_the_cap(kind: &str) {
    use sluice::config::{Algorithm, Limit, Period, Reservations};
    use sluice::store::{LeaseCall, LimitCheck};
    let (store, _clock, backend) = make_store(kind).await;
    let limit = Limit {
        requests_per_unit: 1_000_000,
        period: Period::from_millis(3_600_000).expect("1 h"),
        algorithm: Algorithm::FixedWindow,
        burst: 0,
    };
    let terms = Reservations {
        lease: Period::from_millis(300_000).expect("5 min"),
        max: 3,
        min_estimate: 1,
    };
    let check = |id: String, release: bool| {
        let mut c = LimitCheck::for_tests("ai", "flood", limit, 1);
        c.record = release;
        c.lease = Some(LeaseCall {
            id: std::sync::Arc::from(id),
            release,
            reservations: Some(terms),
        });
        c
    };
    let mut admitted = Vec::new();
    for chunk in (0..100_000u32).collect::<Vec<_>>().chunks(500) {
        let decisions = futures_util::future::join_all(chunk.iter().map(|&i| {
            let store = store.clone();
            let c = check(format!("request-{i}"), false);
            async move { (i, store.decide(&[c]).await.expect("decided")) }
        }))
        .await;
        admitted.extend(
            decisions
                .iter()
                .filter(|(_, d)| d.admitted)
                .map(|(i, _)| *i),
        );
    }
    assert_eq!(admitted.len(), 3, "{kind}: the cap, every other id denied");
    match &backend {
        Backend::Redis(r) => {
            let keys = r.cli(&["--scan", "--pattern", "*flood*"]);
            let found: Vec<&str> = keys.lines().map(str::trim).collect();
            assert_eq!(found.len(), 3, "{kind}: window, :e and :r ({found:?})");
            let e = found.iter().find(|k| k.ends_with(":e")).expect(":e");
            let h = found.iter().find(|k| k.ends_with(":r")).expect(":r");
            assert_eq!(r.cli(&["ZCARD", e]).trim(), "3", "{kind}");
            assert_eq!(r.cli(&["HLEN", h]).trim(), "3", "{kind}");
        }
        Backend::Cluster(c) => {
            let sizes: u64 = (0..3)
                .map(|n| c.cli(n, &["DBSIZE"]).trim().parse::<u64>().unwrap_or(0))
                .sum();
            assert_eq!(sizes, 3, "{kind}: three keys in all");
        }
        Backend::Memory => {}
    }
    // The counter took the 3 admitted estimates only.
    let plain = LimitCheck::for_tests("ai", "flood", limit, 0);
    let d = store.decide(&[plain]).await.expect("checked");
    assert_eq!(d.outcomes[0].remaining, 1_000_000 - 3, "{kind}");
    // A settle frees an entry: exactly one more reservation fits.
    let settled = store
        .decide(&[check(format!("request-{}", admitted[0]), true)])
        .await
        .expect("settled");
    assert!(settled.admitted, "{kind}");
    let next = store
        .decide(&[check("n1".into(), false)])
        .await
        .expect("n1");
    assert!(next.admitted, "{kind}: room for one");
    let full = store
        .decide(&[check("n2".into(), false)])
        .await
        .expect("n2");
    assert!(!full.admitted, "{kind}: full again");
}

test_with_all_stores!(a_flood_of_reservations_on, kind => distinct_ids_keep_the_reservations_at_the_cap);

/// A request id longer than the cap is refused on a reservation as on a slot: each id is kept
/// with its counter while its reservation is held.
#[tokio::test]
async fn a_long_reservation_id_is_invalid_argument() {
    let s = TestServer::start(CONFIG).await;
    let long = "x".repeat(10 * 1024);
    for r in [reserve("u", &long, 1), settle("u", &long, 1)] {
        let err = s
            .client()
            .await
            .should_rate_limit(r)
            .await
            .expect_err("a 10 KB id is refused");
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    }
    assert_eq!(
        code(&s.call(reserve("u", &"x".repeat(128), 1)).await),
        Code::Ok
    );
    s.stop().await;
}

/// With the local deny cache on, a denial that a release can end is never kept: a plain request
/// on a counter with reservations (no id entry) or an `in_flight` check (no id) is denied while
/// the budget or the slots are taken, and admitted as soon as a settle gives back or a done
/// frees, never answered from the cache meanwhile.
async fn a_release_ends_a_denial_the_deny_cache_never_kept(kind: &str) {
    const LEASED: &str = r#"
domain: ai
descriptors:
  - key: tenant
    in_flight: {max: 1, lease: 5s, id_key: request_id, done_key: request_done}
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 10}
    reservations: {lease: 5m, id_key: request_id, done_key: request_done}
"#;
    let (inner, clock, _backend) = make_store(kind).await;
    // Memory and standalone Redis: every denial is final, so only the rule keeps these out.
    let cache = std::sync::Arc::new(sluice::store::local_cache::LocalDenyCache::new(
        inner,
        1 << 20,
        std::sync::Arc::new(clock.clone()),
        sluice::store::DenialFinality::Always,
    ));
    let store: std::sync::Arc<dyn sluice::store::CounterStore> = cache.clone();
    let s = TestServer::start_on(LEASED, ServiceOptions::default(), Some(store), clock).await;
    let plain = || one("ai", &[("user", "u")]);
    let check = || one("ai", &[("tenant", "t")]);

    assert_eq!(code(&s.call(reserve("u", "r1", 10)).await), Code::Ok);
    assert_eq!(code(&s.call(plain()).await), Code::OverLimit, "{kind}");
    assert_eq!(code(&s.call(plain()).await), Code::OverLimit, "{kind}");
    assert_eq!(code(&s.call(settle("u", "r1", 4)).await), Code::Ok);
    assert_eq!(
        code(&s.call(plain()).await),
        Code::Ok,
        "{kind}: 6 given back"
    );

    let take = super::in_flight::take;
    assert_eq!(code(&s.call(take("t", "a")).await), Code::Ok);
    assert_eq!(code(&s.call(check()).await), Code::OverLimit, "{kind}");
    assert_eq!(code(&s.call(check()).await), Code::OverLimit, "{kind}");
    assert_eq!(
        code(&s.call(super::in_flight::done("t", "a")).await),
        Code::Ok
    );
    assert_eq!(
        code(&s.call(check()).await),
        Code::Ok,
        "{kind}: a's slot freed"
    );
    assert_eq!(
        cache.local_denials(),
        0,
        "{kind}: nothing answered from the cache"
    );
    assert!(cache.is_empty(), "{kind}: nothing kept");
    s.stop().await;
}

test_with_all_stores!(the_deny_cache_and_releases_on, kind => a_release_ends_a_denial_the_deny_cache_never_kept);

/// The give-back's search is bounded (256 entries newer than the reservation's at most, as
/// `LOG_GIVE_BACK_ENTRIES`, since decide.lua rewrites each one's running total): within it the
/// reservation's entry is found and shrunk; past it nothing is given back (it under-admits),
/// the same on every store.
async fn a_sliding_log_give_back_searches_a_bounded_span(kind: &str) {
    let (s, clock, _backend) = log_server(kind).await;
    for (user, newer, left) in [("near", 255, 1000 - 255), ("far", 256, 1000 - 256 - 500)] {
        assert_eq!(code(&s.call(reserve(user, "a", 500)).await), Code::Ok);
        for _ in 0..newer {
            clock.advance(Duration::from_millis(1));
            let r = s.call(one("ai", &[("user", user)])).await;
            assert_eq!(code(&r), Code::Ok, "{kind}");
        }
        let r = s.call(settle(user, "a", 0)).await;
        assert_eq!(
            u64::from(r.statuses[0].limit_remaining),
            left,
            "{kind}: {newer} entries after the reservation's"
        );
    }
    s.stop().await;
}

test_with_all_stores!(log_give_back_bound_on, kind => a_sliding_log_give_back_searches_a_bounded_span);
