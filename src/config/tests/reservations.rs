//! `reservations` blocks: what loads, and every rule with its file, line and path.

use super::*;

const HEAD: &str = "domain: ai\ndescriptors:\n  - key: user\n";
const LIMIT: &str = "    rate_limit: {unit: hour, requests_per_unit: 1000}\n";

fn with(block: &str) -> String {
    format!("{HEAD}{LIMIT}    reservations: {block}\n")
}

#[test]
fn a_reservations_block_sets_the_terms_on_the_limits_and_the_lease_keys() {
    let rs = load(&with(
        "{lease: 5m, id_key: request_id, done_key: request_done}",
    ))
    .expect("loads");
    let node = &domain(&rs, "ai").root.bare["user"];
    let rule = only_limit(node);
    assert_eq!(
        rule.reservations,
        Some(Reservations {
            lease: Period::from_millis(300_000).expect("5 min"),
            max: 256,
            min_estimate: 1,
        })
    );
    assert_eq!(
        node.lease_keys,
        Some(LeaseKeys {
            id_key: "request_id".into(),
            done_key: "request_done".into(),
        })
    );
    assert!(
        rs.dump().contains(
            "ai.user: unit=HOUR requests_per_unit=1000 reservations lease=300s max=256 min_estimate=1 \
             id_key=request_id done_key=request_done"
        ),
        "/rlconfig: {}",
        rs.dump()
    );
    // `max` bounds the reservations one counter holds.
    let rs = load(&with("{lease: 30s, id_key: a, done_key: b, max: 50}")).expect("loads");
    let rule = only_limit(&domain(&rs, "ai").root.bare["user"]);
    assert_eq!(rule.reservations.map(|r| r.max), Some(50));
    // `min_estimate` floors the caller's estimate.
    let rs = load(&with(
        "{lease: 30s, id_key: a, done_key: b, min_estimate: 100}",
    ))
    .expect("loads");
    let rule = only_limit(&domain(&rs, "ai").root.bare["user"]);
    assert_eq!(rule.reservations.map(|r| r.min_estimate), Some(100));
    // Beside an `in_flight` block with the same entry names: both apply.
    let text = format!(
        "{HEAD}{LIMIT}    in_flight: {{max: 3, lease: 5s, id_key: a, done_key: b}}\n    \
         reservations: {{lease: 5m, id_key: a, done_key: b}}\n"
    );
    let rs = load(&text).expect("loads");
    assert_eq!(domain(&rs, "ai").root.bare["user"].rate_limits.len(), 2);
}

#[test]
fn each_reservations_rule_names_its_line() {
    let p = "descriptors[0].reservations";
    one_error(
        &with("{lease: 0s, id_key: a, done_key: b}"),
        5,
        &format!("{p}.lease"),
        "a lease of 0",
    );
    one_error(
        &with("{lease: 5m, id_key: a, done_key: a}"),
        5,
        &format!("{p}.done_key"),
        "could not be told apart",
    );
    one_error(&with("{lease: 5m, id_key: a}"), 5, p, "needs `done_key`");
    one_error(
        &with("{lease: 5m, id_key: a, done_key: b, min_estimate: 0}"),
        5,
        &format!("{p}.min_estimate"),
        "from 1 to 4294967295",
    );
    one_error(
        &with("{lease: 5m, id_key: a, done_key: b, max: 0}"),
        5,
        &format!("{p}.max"),
        "from 1 to 10000",
    );
    one_error(
        &with("{lease: 5m, id_key: a, done_key: b, ttl: 1s}"),
        5,
        &format!("{p}.ttl"),
        "accepted in `reservations`: lease, id_key, done_key, max",
    );
    one_error(&with("5m"), 5, p, "must be a mapping");
    // Nothing to reserve against.
    one_error(
        &format!("{HEAD}    reservations: {{lease: 5m, id_key: a, done_key: b}}\n"),
        4,
        p,
        "it has none",
    );
    one_error(
        &format!(
            "{HEAD}    rate_limit: {{unlimited: true}}\n    reservations: {{lease: 5m, id_key: a, \
             done_key: b}}\n"
        ),
        5,
        p,
        "`unlimited`",
    );
    // One descriptor names its requests one way.
    one_error(
        &format!(
            "{HEAD}{LIMIT}    in_flight: {{max: 3, lease: 5s, id_key: a, done_key: b}}\n    \
             reservations: {{lease: 5m, id_key: c, done_key: d}}\n"
        ),
        5,
        "descriptors[0].in_flight",
        "same `id_key` and `done_key`",
    );
}
