//! Tests of the config loader, by topic: envoyproxy's schema and its validation rules
//! (`envoy.rs`), the sluice extensions (`extensions.rs`), and file and directory loading
//! (`files.rs`). The helpers every topic uses are here.

use super::*;
use std::fs;
use std::path::Path;

mod envoy;
mod extensions;
mod files;
mod in_flight;
mod reservations;

const FILE: &str = "test.yaml";

fn load(text: &str) -> Result<RuleSet, ConfigErrors> {
    load_sources(&[(FILE.to_owned(), text.to_owned())])
}

fn errors(text: &str) -> Vec<ConfigError> {
    match load(text) {
        Ok(_) => panic!("expected errors for:\n{text}"),
        Err(e) => e.0,
    }
}

/// Exactly one error, at `line` and `path`, whose message contains `needle`.
fn one_error(text: &str, line: usize, path: &str, needle: &str) -> ConfigError {
    let errs = errors(text);
    assert_eq!(errs.len(), 1, "expected one error, got {errs:#?}");
    let e = errs.into_iter().next().unwrap();
    assert_eq!(e.file, FILE);
    assert_eq!(e.line, Some(line), "{e}");
    assert_eq!(e.path, path, "{e}");
    assert!(
        e.message.contains(needle),
        "{e} does not contain {needle:?}"
    );
    e
}

fn domain<'a>(rs: &'a RuleSet, name: &str) -> &'a DomainRules {
    rs.domains.get(name).expect("domain loaded")
}

/// An envoyproxy limit: fixed window, `rpu` per `unit`.
fn limited(rpu: u32, unit: Unit) -> Quota {
    Quota::Limited(Limit::fixed(rpu, unit))
}

/// The one limit of a node, asserting it has exactly one.
fn only_limit(node: &DescriptorNode) -> &RateLimitRule {
    assert_eq!(
        node.rate_limits.len(),
        1,
        "{}: expected one limit, got {:#?}",
        node.path,
        node.rate_limits
    );
    &node.rate_limits[0]
}

fn unit_config(unit: &str) -> String {
    format!(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: {unit}\n      \
         requests_per_unit: 7\n"
    )
}

/// Every limit of every node of a level, recursively.
fn all_limits(level: &Level) -> Vec<&RateLimitRule> {
    level
        .nodes()
        .flat_map(|n| n.rate_limits.iter().chain(all_limits(&n.children)))
        .collect()
}
