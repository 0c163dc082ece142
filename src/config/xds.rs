//! Rate-limit configs pushed over xDS (envoyproxy/ratelimit's `RateLimitConfig` resource, one
//! per domain). Each resource is turned into the same node tree a YAML file parses into and goes
//! through the same loader, so a pushed config is accepted or refused exactly as the equivalent
//! file would be, with the same messages, naming the resource instead of a file and line.
//!
//! The mapping follows envoyproxy/ratelimit's `ConfigXdsProtoToYaml`: fields at their proto3
//! default (false, empty, an `UNKNOWN` unit) are left out, as an absent YAML key.

use super::load::load_trees;
use super::yaml::{Node, Value};
use super::{ConfigErrors, RuleSet};
use crate::proto::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use prost_types::value::Kind;

/// Loads every resource of one xDS response into one rule set (all or nothing, like a config
/// directory). A resource without a name is called `xds resource #N` (N from 1) in errors.
/// `merge_domains`: `MERGE_DOMAIN_CONFIG` (see [`super::LoadOptions::merge_domains`]).
pub fn load_xds(
    resources: &[RateLimitConfig],
    merge_domains: bool,
    calendar_months: bool,
) -> Result<RuleSet, ConfigErrors> {
    let trees = resources
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let name = if r.name.is_empty() {
                format!("xds resource #{}", i + 1)
            } else {
                r.name.clone()
            };
            (name, root(r))
        })
        .collect();
    load_trees(trees, merge_domains, calendar_months)
}

fn map(entries: Vec<(&str, Node)>) -> Node {
    Node::synthetic(Value::Map(
        entries
            .into_iter()
            .map(|(k, v)| (Node::string(k), v))
            .collect(),
    ))
}

fn seq(items: Vec<Node>) -> Node {
    Node::synthetic(Value::Seq(items))
}

fn flag(entries: &mut Vec<(&str, Node)>, key: &'static str, on: bool) {
    if on {
        entries.push((key, Node::plain("true")));
    }
}

fn root(config: &RateLimitConfig) -> Node {
    let mut entries = vec![("domain", Node::string(config.domain.clone()))];
    if !config.descriptors.is_empty() {
        entries.push(("descriptors", descriptors(&config.descriptors)));
    }
    map(entries)
}

fn descriptors(list: &[RateLimitDescriptor]) -> Node {
    seq(list.iter().map(descriptor).collect())
}

fn descriptor(d: &RateLimitDescriptor) -> Node {
    let mut entries = vec![("key", Node::string(d.key.clone()))];
    if !d.value.is_empty() {
        entries.push(("value", Node::string(d.value.clone())));
    }
    if let Some(policy) = &d.rate_limit {
        entries.push(("rate_limit", rate_limit(policy)));
    }
    if !d.descriptors.is_empty() {
        entries.push(("descriptors", descriptors(&d.descriptors)));
    }
    flag(&mut entries, "shadow_mode", d.shadow_mode);
    flag(&mut entries, "detailed_metric", d.detailed_metric);
    flag(&mut entries, "quota_mode", d.quota_mode);
    if let Some(metadata) = &d.metadata {
        entries.push(("metadata", structure(metadata)));
    }
    map(entries)
}

fn rate_limit(p: &RateLimitPolicy) -> Node {
    let mut entries = Vec::new();
    // UNKNOWN (0) is proto3's "not set": no unit, which the loader refuses for a limited policy
    // and requires for an unlimited one, as envoyproxy/ratelimit does.
    match RateLimitUnit::try_from(p.unit) {
        Ok(RateLimitUnit::Unknown) => {}
        Ok(unit) => entries.push(("unit", Node::string(unit.as_str_name()))),
        // A number this proto version does not know: passed on so the loader names it.
        Err(_) => entries.push(("unit", Node::string(p.unit.to_string()))),
    }
    if !p.unlimited || p.requests_per_unit != 0 {
        entries.push((
            "requests_per_unit",
            Node::plain(p.requests_per_unit.to_string()),
        ));
    }
    flag(&mut entries, "unlimited", p.unlimited);
    if !p.name.is_empty() {
        entries.push(("name", Node::string(p.name.clone())));
    }
    if !p.replaces.is_empty() {
        let replaces = p
            .replaces
            .iter()
            .map(|r| map(vec![("name", Node::string(r.name.clone()))]))
            .collect();
        entries.push(("replaces", seq(replaces)));
    }
    map(entries)
}

fn structure(s: &prost_types::Struct) -> Node {
    // Sorted: a protobuf map has no order, and the response metadata should not depend on it.
    let mut fields: Vec<_> = s.fields.iter().collect();
    fields.sort_by(|a, b| a.0.cmp(b.0));
    Node::synthetic(Value::Map(
        fields
            .into_iter()
            .map(|(k, v)| (Node::string(k.clone()), value(v)))
            .collect(),
    ))
}

fn value(v: &prost_types::Value) -> Node {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Node::plain("null"),
        Some(Kind::NumberValue(n)) => Node::plain(number(*n)),
        Some(Kind::StringValue(s)) => Node::string(s.clone()),
        Some(Kind::BoolValue(b)) => Node::plain(b.to_string()),
        Some(Kind::StructValue(s)) => structure(s),
        Some(Kind::ListValue(l)) => seq(l.values.iter().map(value).collect()),
    }
}

/// A JSON number as YAML reads it back: whole numbers without a fraction, the rest as Rust
/// prints an `f64` (which round-trips); NaN and infinities as YAML spells them.
fn number(n: f64) -> String {
    if n.is_nan() {
        ".nan".into()
    } else if n.is_infinite() {
        if n > 0.0 { ".inf" } else { "-.inf" }.into()
    } else if n.fract() == 0.0 && n.abs() < 1e15 {
        format!("{n:.0}")
    } else {
        n.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::load_sources;
    use crate::proto::ratelimit::config::ratelimit::v3::RateLimitReplace;

    fn policy(unit: RateLimitUnit, n: u32) -> Option<RateLimitPolicy> {
        Some(RateLimitPolicy {
            unit: unit as i32,
            requests_per_unit: n,
            ..Default::default()
        })
    }

    #[test]
    fn a_pushed_config_means_what_the_same_yaml_file_means() {
        let metadata = prost_types::Struct {
            fields: [(
                "tier".to_string(),
                prost_types::Value {
                    kind: Some(Kind::StringValue("gold".into())),
                },
            )]
            .into(),
        };
        let pushed = RateLimitConfig {
            name: "eg".into(),
            domain: "edge".into(),
            descriptors: vec![
                RateLimitDescriptor {
                    key: "user".into(),
                    // A value YAML would read as a boolean stays a string.
                    value: "yes".into(),
                    rate_limit: Some(RateLimitPolicy {
                        name: "per-user".into(),
                        ..policy(RateLimitUnit::Minute, 5).unwrap_or_default()
                    }),
                    shadow_mode: true,
                    metadata: Some(metadata),
                    ..Default::default()
                },
                RateLimitDescriptor {
                    key: "path".into(),
                    rate_limit: Some(RateLimitPolicy {
                        replaces: vec![RateLimitReplace {
                            name: "per-user".into(),
                        }],
                        ..policy(RateLimitUnit::Week, 0).unwrap_or_default()
                    }),
                    descriptors: vec![RateLimitDescriptor {
                        key: "method".into(),
                        rate_limit: Some(RateLimitPolicy {
                            unlimited: true,
                            ..Default::default()
                        }),
                        ..Default::default()
                    }],
                    ..Default::default()
                },
            ],
        };
        let yaml = r#"
domain: edge
descriptors:
  - key: user
    value: "yes"
    shadow_mode: true
    metadata: {tier: gold}
    rate_limit: {unit: minute, requests_per_unit: 5, name: per-user}
  - key: path
    rate_limit:
      unit: week
      requests_per_unit: 0
      replaces: [{name: per-user}]
    descriptors:
      - key: method
        rate_limit: {unlimited: true}
"#;
        let from_xds = load_xds(&[pushed], false, false).expect("loads");
        let from_file = load_sources(&[("edge.yaml".into(), yaml.into())]).expect("loads");
        assert_eq!(from_xds.dump(), from_file.dump());
        let dump = from_xds.dump();
        assert!(dump.contains("requests_per_unit=0"), "{dump}");
        assert!(dump.contains("unlimited=true"), "{dump}");
    }

    #[test]
    fn errors_name_the_resource_and_have_no_line() {
        let bad = |name: &str| RateLimitConfig {
            name: name.into(),
            domain: "d".into(),
            descriptors: vec![RateLimitDescriptor {
                key: "k".into(),
                rate_limit: policy(RateLimitUnit::Unknown, 3),
                ..Default::default()
            }],
        };
        let e = load_xds(&[bad("team-a")], false, false).expect_err("no unit");
        assert_eq!(e.0.len(), 1);
        assert_eq!(e.0[0].file, "team-a");
        assert_eq!(e.0[0].line, None);
        assert_eq!(e.0[0].path, "descriptors[0].rate_limit.unit");
        let e = load_xds(&[bad(""), bad("")], false, false)
            .expect_err("both bad, and one domain twice");
        let text = e.to_string();
        assert!(text.contains("xds resource #1: descriptors[0]"), "{text}");
        assert!(text.contains("xds resource #2"), "{text}");
        assert!(text.contains("duplicate domain 'd'"), "{text}");
        assert!(load_xds(&[], false, false)
            .expect("empty")
            .domains
            .is_empty());
    }
}
