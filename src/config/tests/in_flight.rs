//! `in_flight` blocks: what loads, and every rule with its file, line and path.

use super::*;

const HEAD: &str = "domain: ai\ndescriptors:\n  - key: tenant\n";

fn with(block: &str) -> String {
    format!("{HEAD}    in_flight: {block}\n")
}

#[test]
fn an_in_flight_block_loads_to_a_limit_and_the_lease_keys() {
    let rs = load(&with(
        "{max: 3, lease: 5s, id_key: request_id, done_key: request_done}",
    ))
    .expect("loads");
    let node = &domain(&rs, "ai").root.bare["tenant"];
    let rule = only_limit(node);
    assert_eq!(
        rule.quota,
        Quota::Limited(Limit {
            requests_per_unit: 3,
            period: Period::from_millis(5000).expect("5 s"),
            algorithm: Algorithm::InFlight,
            burst: 0,
        })
    );
    assert!(
        rs.dump().contains(
            "ai.tenant: in_flight max=3 lease=5s id_key=request_id done_key=request_done, \
             shadow_mode: false"
        ),
        "/rlconfig: {}",
        rs.dump()
    );
    assert_eq!(
        node.lease_keys,
        Some(LeaseKeys {
            id_key: "request_id".into(),
            done_key: "request_done".into(),
        })
    );
}

#[test]
fn each_in_flight_rule_names_its_line() {
    let p = "descriptors[0].in_flight";
    one_error(
        &with("{max: 0, lease: 5s, id_key: a, done_key: b}"),
        4,
        &format!("{p}.max"),
        "from 1 to 10000",
    );
    one_error(
        &with("{max: 3, lease: 0s, id_key: a, done_key: b}"),
        4,
        &format!("{p}.lease"),
        "a lease of 0",
    );
    one_error(
        &with("{max: 3, lease: 5s, id_key: a, done_key: a}"),
        4,
        &format!("{p}.done_key"),
        "could not be told apart",
    );
    one_error(
        &with("{max: 3, lease: 5s, id_key: a}"),
        4,
        p,
        "needs `done_key`",
    );
    one_error(
        &with("{max: 3, lease: 5s, id_key: a, done_key: b, ttl: 1s}"),
        4,
        &format!("{p}.ttl"),
        "accepted in `in_flight`: max, lease, id_key, done_key",
    );
    one_error(&with("3"), 4, p, "must be a mapping");
}

#[test]
fn a_child_named_like_the_id_entry_is_an_error() {
    let text = format!(
        "{HEAD}    in_flight: {{max: 3, lease: 5s, id_key: request_id, done_key: done}}\n    \
         descriptors:\n      - key: request_id\n        rate_limit: {{unit: second, \
         requests_per_unit: 1}}\n"
    );
    one_error(&text, 6, "descriptors[0].descriptors[0]", "rename one");
}
