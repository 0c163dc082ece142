//! Property test (issue 50, item 1): a counter's identity is the limit's. For random configs (a
//! chain of nodes, each with random limits, `leased:`, `calendar`, `own_hash_tags`), every
//! request shape that reaches a limit gives it the same counter (the same `CounterKey`, the same
//! Redis key), and adding or removing `leased:`, adding a sibling limit, or putting a calendar on
//! another limit changes no other limit's counter.

use super::plan::plan;
use super::ServiceOptions;
use crate::config::load_sources;
use crate::proto::{rate_limit_descriptor, RateLimitDescriptor, RateLimitRequest};
use crate::store::redis::keys::counter_key;
use proptest::prelude::*;
use std::collections::HashMap;

/// One node of the chain: its limits (`(name, yaml)`), and its flags.
#[derive(Debug, Clone)]
struct NodeSpec {
    limits: Vec<(String, &'static str)>,
    leased: bool,
    own_tags: bool,
}

/// Limits a node may carry: fixed windows (leasable, a 1500 ms one among them), a token bucket
/// (leasable), a sliding window (not), a calendar day.
const LIMITS: &[&str] = &[
    "{unit: minute, requests_per_unit: 10}",
    "{period: 1500ms, requests_per_unit: 20}",
    "{unit: hour, requests_per_unit: 30, algorithm: token_bucket}",
    "{unit: minute, requests_per_unit: 40, algorithm: sliding_window}",
    "{unit: day, requests_per_unit: 50, calendar: {}}",
];

fn leasable(limit: &str) -> bool {
    !limit.contains("sliding_window")
}

fn yaml(nodes: &[NodeSpec]) -> String {
    let mut out = String::from("domain: d\ndescriptors:\n");
    for (depth, n) in nodes.iter().enumerate() {
        let pad = "    ".repeat(depth);
        out.push_str(&format!("{pad}  - key: k{depth}\n{pad}    value: v\n"));
        let below = depth + 1 < nodes.len();
        if n.leased && !n.limits.is_empty() && n.limits.iter().all(|(_, l)| leasable(l)) {
            out.push_str(&format!("{pad}    leased: {{}}\n"));
        }
        if n.own_tags {
            out.push_str(&format!("{pad}    own_hash_tags: true\n"));
        }
        if !n.limits.is_empty() {
            out.push_str(&format!("{pad}    rate_limits:\n"));
            for (name, l) in &n.limits {
                let l = l.strip_suffix('}').unwrap_or(l);
                let descendants = if below {
                    ", applies_to_descendants: true"
                } else {
                    ""
                };
                out.push_str(&format!("{pad}      - {l}, name: {name}{descendants}}}\n"));
            }
        }
        if below {
            out.push_str(&format!("{pad}    descriptors:\n"));
        }
    }
    out
}

/// Every limit's counter, by name, for every request depth: `name -> [(depth, key)]`.
fn counters(nodes: &[NodeSpec]) -> Result<HashMap<String, Vec<(usize, String)>>, String> {
    let text = yaml(nodes);
    let rules =
        load_sources(&[("d.yaml".into(), text.clone())]).map_err(|e| format!("{e}\n{text}"))?;
    let mut seen: HashMap<String, Vec<(usize, String)>> = HashMap::new();
    for depth in 1..=nodes.len() {
        let entries = (0..depth)
            .map(|i| rate_limit_descriptor::Entry {
                key: format!("k{i}"),
                value: "v".into(),
            })
            .collect();
        let request = RateLimitRequest {
            domain: "d".into(),
            descriptors: vec![RateLimitDescriptor {
                entries,
                ..Default::default()
            }],
            ..Default::default()
        };
        let p = plan(&rules, &request, &ServiceOptions::default()).map_err(|e| e.to_string())?;
        for l in &p.limits {
            let key = format!("{:?} {}", l.check.key, counter_key("p", &l.check.key));
            seen.entry(l.name.clone()).or_default().push((depth, key));
        }
    }
    Ok(seen)
}

fn node() -> impl Strategy<Value = NodeSpec> {
    (
        proptest::collection::vec(0..LIMITS.len(), 0..3),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(idx, leased, own_tags)| NodeSpec {
            limits: idx
                .into_iter()
                .map(|i| (String::new(), LIMITS[i]))
                .collect(),
            leased,
            own_tags,
        })
}

/// Names every limit `n<depth>_<i>` (unique, as the config requires per node).
fn named(mut nodes: Vec<NodeSpec>) -> Vec<NodeSpec> {
    for (d, n) in nodes.iter_mut().enumerate() {
        for (i, (name, _)) in n.limits.iter_mut().enumerate() {
            *name = format!("n{d}_{i}");
        }
    }
    nodes
}

/// The change made to a config: `leased:` toggled on a node, a sibling limit added on a node, or
/// a calendar day in place of another limit.
#[derive(Debug, Clone)]
enum Change {
    ToggleLeased(usize),
    Sibling(usize),
    Calendar(usize, usize),
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        (0..4usize).prop_map(Change::ToggleLeased),
        (0..4usize).prop_map(Change::Sibling),
        (0..4usize, 0..3usize).prop_map(|(n, l)| Change::Calendar(n, l)),
    ]
}

/// `nodes` changed; returns the name of the one limit whose counter may change with it.
fn apply(nodes: &mut [NodeSpec], c: &Change) -> Option<String> {
    let len = nodes.len();
    match *c {
        Change::ToggleLeased(n) => {
            nodes[n % len].leased ^= true;
            None
        }
        Change::Sibling(n) => {
            let node = &mut nodes[n % len];
            let name = format!("n{}_new", n % len);
            node.limits.push((name, LIMITS[0]));
            None
        }
        Change::Calendar(n, l) => {
            let node = &mut nodes[n % len];
            let count = node.limits.len();
            let (name, limit) = node.limits.get_mut(l % count.max(1))?;
            *limit = LIMITS[4];
            Some(name.clone())
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn a_limit_has_one_counter_for_every_request_shape_and_every_change_elsewhere(
        nodes in proptest::collection::vec(node(), 1..5),
        c in change(),
    ) {
        let nodes = named(nodes);
        let before = counters(&nodes).map_err(TestCaseError::fail)?;
        for (name, keys) in &before {
            prop_assert!(
                keys.iter().all(|(_, k)| *k == keys[0].1),
                "{name}: one counter per request depth, got {keys:#?}\n{}", yaml(&nodes)
            );
        }
        let mut changed = nodes.clone();
        let own = apply(&mut changed, &c);
        let after = counters(&changed).map_err(TestCaseError::fail)?;
        for (name, keys) in &before {
            if own.as_deref() == Some(name.as_str()) {
                continue;
            }
            let Some(now) = after.get(name) else { continue };
            prop_assert_eq!(
                &keys[0].1, &now[0].1,
                "{} changed its counter after {:?}\nbefore:\n{}\nafter:\n{}",
                name, c, yaml(&nodes), yaml(&changed)
            );
        }
    }
}
