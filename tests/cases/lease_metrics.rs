//! The lease metrics on every store, read from `/metrics` of two replicas (on Redis, two stores
//! and servers on the same Redis; on memory, one store behind two servers): slots in use and
//! reservations outstanding (gauges whose sum over the replicas is the fleet's), leases that
//! ended unreleased, and releases that found nothing. The store says what each call did, so a
//! retry is not a new slot and a free of nothing frees nothing.

use super::in_flight::{done, take};
use super::reservations::{reserve, settle, two_replicas};
use crate::support::*;
use sluice::proto::rate_limit_response::Code;
use std::time::Duration;

const CONFIG: &str = r#"
domain: ai
descriptors:
  - key: tenant
    in_flight: {max: 3, lease: 5s, id_key: request_id, done_key: request_done}
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000}
    reservations: {lease: 5m, id_key: request_id, done_key: request_done}
"#;

/// A series' value in a `/metrics` text (0 when absent: an untouched counter has no series).
fn value(metrics: &str, series: &str) -> i64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as i64)
}

async fn metrics(s: &TestServer) -> String {
    http(s.http_addr, "GET", "/metrics", "").await.1
}

/// The fleet's figure: the series summed over both replicas.
async fn fleet(a: &TestServer, b: &TestServer, series: &str) -> i64 {
    value(&metrics(a).await, series) + value(&metrics(b).await, series)
}

const SLOTS: &str = r#"sluice_in_flight_slots{domain="ai"}"#;
const RESERVED: &str = r#"sluice_reservations_outstanding{domain="ai"}"#;
const EXPIRED_SLOTS: &str = r#"sluice_leases_expired_total{domain="ai",kind="in_flight"}"#;
const EXPIRED_RES: &str = r#"sluice_leases_expired_total{domain="ai",kind="reservations"}"#;
const UNMATCHED_FREES: &str =
    r#"sluice_lease_releases_unmatched_total{domain="ai",kind="in_flight"}"#;
const UNMATCHED_SETTLES: &str =
    r#"sluice_lease_releases_unmatched_total{domain="ai",kind="reservations"}"#;

async fn the_lease_metrics_follow_the_store(kind: &str) {
    let (a, b, clock, _backend) = two_replicas(kind, CONFIG).await;

    // Three slots taken on a; denials (a second take of a, and d) add none.
    for id in ["a", "b", "c"] {
        assert_eq!(code(&a.call(take("t", id)).await), Code::Ok, "{kind}: {id}");
    }
    for id in ["a", "d"] {
        assert_eq!(
            code(&a.call(take("t", id)).await),
            Code::OverLimit,
            "{kind}: {id}"
        );
    }
    assert_eq!(fleet(&a, &b, SLOTS).await, 3, "{kind}");
    // On b: a's first done consumes its denied take (neither a release nor unmatched); the
    // second frees a's slot: b's share is -1, the fleet's 2. Frees of nothing count as
    // unmatched.
    for id in ["a", "zz", "a", "a"] {
        assert_eq!(code(&b.call(done("t", id)).await), Code::Ok);
    }
    assert_eq!(fleet(&a, &b, SLOTS).await, 2, "{kind}");
    assert_eq!(value(&metrics(&b).await, SLOTS), -1, "{kind}: b's share");
    assert_eq!(fleet(&a, &b, UNMATCHED_FREES).await, 2, "{kind}");

    // Two reservations on a; one settled on b; a settle of a request never reserved.
    for id in ["r1", "r2"] {
        assert_eq!(code(&a.call(reserve("u", id, 400)).await), Code::Ok);
    }
    // A second reservation with r1's id reserves again (200 fits, 400 would not).
    assert_eq!(
        code(&a.call(reserve("u", "r1", 400)).await),
        Code::OverLimit,
        "{kind}: a held id reserves again, and 1 200 does not fit 1 000"
    );
    assert_eq!(code(&a.call(reserve("u", "r1", 200)).await), Code::Ok);
    assert_eq!(fleet(&a, &b, RESERVED).await, 3, "{kind}");
    // r1's settle releases r1's smaller reservation (200; the id cannot say which request ended).
    assert_eq!(code(&b.call(settle("u", "r1", 150)).await), Code::Ok);
    assert_eq!(code(&b.call(settle("u", "r9", 10)).await), Code::Ok);
    assert_eq!(fleet(&a, &b, RESERVED).await, 2, "{kind}");
    assert_eq!(fleet(&a, &b, UNMATCHED_SETTLES).await, 1, "{kind}");
    assert_eq!(fleet(&a, &b, EXPIRED_SLOTS).await, 0, "{kind}");

    // Past the slots' lease: b and c were never freed. They leave the gauge with their lease;
    // the next call on the tenant drops them from the store and counts them expired.
    clock.advance(Duration::from_secs(6));
    assert_eq!(fleet(&a, &b, SLOTS).await, 0, "{kind}");
    assert_eq!(code(&b.call(take("t", "e")).await), Code::Ok);
    assert_eq!(fleet(&a, &b, EXPIRED_SLOTS).await, 2, "{kind}");
    assert_eq!(fleet(&a, &b, SLOTS).await, 1, "{kind}");

    // Past the reservations' lease: r2 and r1's second were never settled; r2's settle now
    // finds nothing.
    clock.advance(Duration::from_secs(300));
    assert_eq!(fleet(&a, &b, RESERVED).await, 0, "{kind}");
    assert_eq!(code(&a.call(reserve("u", "r3", 40)).await), Code::Ok);
    assert_eq!(fleet(&a, &b, EXPIRED_RES).await, 2, "{kind}");
    assert_eq!(code(&b.call(settle("u", "r2", 400)).await), Code::Ok);
    assert_eq!(fleet(&a, &b, UNMATCHED_SETTLES).await, 2, "{kind}");
    assert_eq!(fleet(&a, &b, RESERVED).await, 1, "{kind}: r3");
    a.stop().await;
    b.stop().await;
}

test_with_all_stores!(the_lease_metrics_on, kind => the_lease_metrics_follow_the_store);
