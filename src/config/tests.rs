//! Tests of the config loader: every validation rule, error positions, and file/directory loading.

use super::*;
use std::fs;
use std::path::Path;

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

#[test]
fn valid_config_builds_levels_paths_and_locations() {
    let rs = load(
        "domain: d
descriptors:
  - key: k1
    value: v1
    rate_limit:
      unit: minute
      requests_per_unit: 10
    descriptors:
      - key: k2
        rate_limit:
          unit: HOUR
          requests_per_unit: 3
  - key: k1
    rate_limit:
      unit: second
      requests_per_unit: 1
  - key: k3
    value: ab*
",
    )
    .unwrap();
    assert_eq!(rs.sources, vec![std::path::PathBuf::from(FILE)]);
    let d = domain(&rs, "d");
    assert_eq!(d.domain, "d");
    assert_eq!(&*d.file, FILE);
    let n = &d.root.exact["k1"]["v1"];
    assert_eq!(n.path, "d.k1_v1");
    assert_eq!(n.value, ValueMatch::Exact("v1".into()));
    assert_eq!(n.location.line, 3);
    assert_eq!(&*n.location.file, FILE);
    let rl = only_limit(n);
    assert_eq!(rl.quota, limited(10, Unit::Minute));
    assert_eq!(rl.name, None);
    assert!(!rl.shadow_mode && !rl.quota_mode);
    let child = &n.children.bare["k2"];
    assert_eq!(child.path, "d.k1_v1.k2");
    assert_eq!(child.value, ValueMatch::Any);
    assert_eq!(child.location.line, 9);
    assert_eq!(only_limit(child).quota, limited(3, Unit::Hour));
    let bare = &d.root.bare["k1"];
    assert_eq!(bare.path, "d.k1");
    assert!(bare.children.is_empty());
    let wild = &d.root.wildcards[0];
    assert_eq!(wild.value, ValueMatch::Wildcard("ab*".into()));
    assert_eq!(wild.path, "d.k3_ab*");
    assert!(wild.rate_limits.is_empty());
    assert_eq!(rs.rule_counts(), vec![("d".to_owned(), 3)]);
}

#[test]
fn example_basic_yaml_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples/basic.yaml");
    let rs = load_path(&path, &LoadOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(rs.sources, vec![path.clone()]);
    let d = domain(&rs, "example");
    // A bare key and an exact value of the same key live side by side.
    assert!(d.root.bare.contains_key("remote_address"));
    assert_eq!(
        only_limit(&d.root.exact["remote_address"]["203.0.113.7"]).quota,
        limited(0, Unit::Second)
    );
    let acme = &d.root.exact["tenant"]["acme"];
    assert!(acme.children.bare.contains_key("path"));
    assert!(acme.children.exact["path"].contains_key("/login"));
    let wild = &acme.children.wildcards[0];
    assert_eq!(wild.value, ValueMatch::Wildcard("/api/v1/*".into()));
    assert!(wild.share_threshold);
    assert_eq!(
        only_limit(&d.root.exact["user_agent"]["kube-probe"]).quota,
        Quota::Unlimited
    );
    assert!(only_limit(&d.root.bare["api_key"]).shadow_mode);
    let premium = only_limit(&d.root.exact["plan"]["premium"]);
    assert_eq!(premium.name.as_deref(), Some("search_premium"));
    assert_eq!(premium.replaces, vec!["search_standard".to_owned()]);
    // No extension key: every limit is one envoyproxy limit, fixed window, on a unit.
    for rl in all_limits(&d.root) {
        assert!(!rl.applies_to_descendants);
        if let Quota::Limited(l) = rl.quota {
            assert_eq!(l.algorithm, Algorithm::FixedWindow);
            assert_eq!(l.burst, 0);
            assert!(l.period.unit().is_some());
        }
    }
    assert_eq!(rs.rule_counts(), vec![("example".to_owned(), 9)]);
}

#[test]
fn three_mistakes_in_one_file_are_all_reported_with_lines() {
    let errs = errors(
        "domain: shop
descriptors:
  - key: a
    rate_limit:
      unit: fortnight
      requests_per_unit: 5
  - value: orphan
    rate_limit:
      unit: second
      requests_per_unit: 1
  - key: b
    rate_limit:
      unit: minute
      requests_per_unit: 10
      shadow_mode: true
",
    );
    assert_eq!(errs.len(), 3, "{errs:#?}");
    assert_eq!(errs[0].line, Some(5));
    assert_eq!(errs[0].path, "descriptors[0].rate_limit.unit");
    assert!(errs[0]
        .message
        .contains("invalid rate limit unit 'fortnight'"));
    assert_eq!(errs[1].line, Some(7));
    assert_eq!(errs[1].path, "descriptors[1]");
    assert!(errs[1].message.contains("descriptor has empty key"));
    assert_eq!(errs[2].line, Some(15));
    assert_eq!(errs[2].path, "descriptors[2].rate_limit.shadow_mode");
    assert!(errs[2].message.contains("unknown key 'shadow_mode'"));
    assert!(errs[2].message.contains("belongs to the descriptor"));
    for e in &errs {
        assert_eq!(e.file, FILE);
    }
}

#[test]
fn yaml_syntax_error_is_one_error_with_its_line() {
    let errs = errors("domain: d\ndescriptors:\n  - key: a\n    value: [unclosed\n  - key: b\n");
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert!(
        errs[0].message.starts_with("YAML syntax error"),
        "{}",
        errs[0]
    );
    assert!(matches!(errs[0].line, Some(4..=5)), "{}", errs[0]);
    let e = one_error("domain: d\n  bad: indent\n", 2, "", "YAML syntax error");
    assert!(e.to_string().starts_with("test.yaml:2: YAML syntax error"));
}

#[test]
fn unknown_keys_are_rejected_at_every_level() {
    one_error(
        "domain: d\nextra: 1\n",
        2,
        "extra",
        "unknown key 'extra' at the top level; accepted at the top level: domain, descriptors",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    colour: red\n",
        4,
        "descriptors[0].colour",
        "unknown key 'colour' in a descriptor",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      limit: 3\n",
        6,
        "descriptors[0].rate_limit.limit",
        "unknown key 'limit' in `rate_limit`",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unlimited: true\n      \
         name: x\n      replaces:\n        - name: y\n          key: z\n",
        9,
        "descriptors[0].rate_limit.replaces[0].key",
        "unknown key 'key' in a `replaces` entry",
    );
    // Keys must be strings.
    one_error(
        "domain: d\n[a]: 1\n",
        2,
        "",
        "mapping keys must be plain strings",
    );
}

#[test]
fn misplaced_keys_name_where_they_belong() {
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    unit: second\n",
        4,
        "descriptors[0].unit",
        "`unit` belongs inside `rate_limit`",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    domain: other\n",
        4,
        "descriptors[0].domain",
        "only valid at the top level",
    );
    one_error(
        "domain: d\nkey: a\n",
        2,
        "key",
        "belongs in an entry of `descriptors`",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      \
         quota_mode: true\n",
        6,
        "descriptors[0].rate_limit.quota_mode",
        "belongs to the descriptor, next to `rate_limit`",
    );
}

#[test]
fn empty_or_missing_domain_is_rejected() {
    one_error(
        "domain: ''\ndescriptors: []\n",
        1,
        "domain",
        "config file cannot have empty domain",
    );
    one_error(
        "domain:\ndescriptors: []\n",
        1,
        "domain",
        "config file cannot have empty domain",
    );
    one_error(
        "descriptors:\n  - key: a\n",
        1,
        "domain",
        "config file cannot have empty domain (`domain` is missing)",
    );
    // A domain with no descriptors is valid, as in envoyproxy/ratelimit.
    let rs = load("domain: d\n").unwrap();
    assert!(domain(&rs, "d").root.is_empty());
}

#[test]
fn duplicate_domain_across_files() {
    let err = load_sources(&[
        ("a.yaml".into(), "domain: d\n".into()),
        ("b.yaml".into(), "# comment\ndomain: d\n".into()),
        ("c.yaml".into(), "domain: other\n".into()),
    ])
    .unwrap_err();
    assert_eq!(err.0.len(), 1, "{err}");
    let e = &err.0[0];
    assert_eq!(e.file, "b.yaml");
    assert_eq!(e.line, Some(2));
    assert_eq!(e.path, "domain");
    assert!(
        e.message
            .contains("duplicate domain 'd' in config file: already defined at a.yaml:1"),
        "{e}"
    );
    assert!(!e.message.contains("RUNTIME_IGNOREDOTFILES"));

    // Under a dot directory the error hints at RUNTIME_IGNOREDOTFILES.
    let err = load_sources(&[
        ("cfg/..data/a.yaml".into(), "domain: d\n".into()),
        ("cfg/a.yaml".into(), "domain: d\n".into()),
    ])
    .unwrap_err();
    assert!(
        err.0[0].message.contains("RUNTIME_IGNOREDOTFILES=true"),
        "{err}"
    );
}

#[test]
fn descriptor_with_empty_or_missing_key() {
    one_error(
        "domain: d\ndescriptors:\n  - key: ''\n    value: v\n",
        3,
        "descriptors[0].key",
        "descriptor has empty key",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key:\n",
        3,
        "descriptors[0].key",
        "descriptor has empty key",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - value: v\n",
        5,
        "descriptors[0].descriptors[0]",
        "descriptor has empty key (`key` is missing)",
    );
}

#[test]
fn duplicate_descriptors_at_one_level() {
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    value: v\n  - key: a\n    value: v\n",
        5,
        "descriptors[1]",
        "duplicate descriptor composite key 'd.a_v' (first at line 3)",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n  - key: b\n  - key: a\n",
        5,
        "descriptors[2]",
        "duplicate descriptor composite key 'd.a'",
    );
    // An empty value is the bare key.
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n  - key: a\n    value: ''\n",
        4,
        "descriptors[1]",
        "duplicate descriptor composite key 'd.a'",
    );
    // envoyproxy's composite key `key_value` makes these two collide (and their stats paths too).
    one_error(
        "domain: d\ndescriptors:\n  - key: a_b\n  - key: a\n    value: b\n",
        4,
        "descriptors[1]",
        "duplicate descriptor composite key 'd.a_b'",
    );
    // Nested duplicates carry their full path.
    one_error(
        "domain: d\ndescriptors:\n  - key: p\n    descriptors:\n      - key: c\n      - key: c\n",
        6,
        "descriptors[0].descriptors[1]",
        "duplicate descriptor composite key 'd.p.c'",
    );
    // The same key at different levels, or with different values, is fine.
    let rs = load(
        "domain: d\ndescriptors:\n  - key: a\n    value: x\n    descriptors:\n      - key: a\n        \
         value: x\n  - key: a\n    value: y\n  - key: a\n",
    )
    .unwrap();
    let d = domain(&rs, "d");
    assert_eq!(d.root.exact["a"].len(), 2);
    assert!(d.root.bare.contains_key("a"));
    assert_eq!(
        d.root.exact["a"]["x"].children.exact["a"]["x"].path,
        "d.a_x.a_x"
    );
}

fn unit_config(unit: &str) -> String {
    format!(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: {unit}\n      \
         requests_per_unit: 7\n"
    )
}

#[test]
fn units_are_case_insensitive() {
    for (text, unit) in [
        ("second", Unit::Second),
        ("Minute", Unit::Minute),
        ("HOUR", Unit::Hour),
        ("day", Unit::Day),
        ("wEEk", Unit::Week),
        ("month", Unit::Month),
        ("YEAR", Unit::Year),
    ] {
        let rs = load(&unit_config(text)).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(
            only_limit(&domain(&rs, "d").root.bare["a"]).quota,
            limited(7, unit)
        );
    }
}

#[test]
fn invalid_unit_is_rejected() {
    for bad in ["seconds", "unknown", "ms", "1"] {
        one_error(
            &unit_config(bad),
            5,
            "descriptors[0].rate_limit.unit",
            &format!(
                "invalid rate limit unit '{bad}'; expected one of second, minute, hour, day, \
                 week, month, year"
            ),
        );
    }
    one_error(
        &unit_config("[second]"),
        5,
        "descriptors[0].rate_limit.unit",
        "`unit` must be a string, not a list",
    );
}

#[test]
fn missing_unit_when_not_unlimited() {
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      requests_per_unit: 5\n",
        5,
        "descriptors[0].rate_limit.unit",
        "`unit` is required unless `unlimited: true`",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {}\n",
        4,
        "descriptors[0].rate_limit.unit",
        "`unit` is required",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      requests_per_unit: 5\n      \
         unit: ''\n",
        6,
        "descriptors[0].rate_limit.unit",
        "`unit` is required",
    );
}

#[test]
fn unlimited_with_unit_is_rejected() {
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unlimited: true\n      \
         unit: second\n",
        6,
        "descriptors[0].rate_limit.unit",
        "should not specify rate limit unit when unlimited",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: bogus\n      \
         unlimited: true\n",
        5,
        "descriptors[0].rate_limit.unit",
        "should not specify rate limit unit when unlimited",
    );
}

#[test]
fn unlimited_without_unit_loads() {
    let rs = load(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unlimited: true\n      \
         requests_per_unit: 5\n  - key: b\n    rate_limit:\n      unlimited: false\n      \
         unit: day\n      requests_per_unit: 1\n",
    )
    .unwrap();
    let d = domain(&rs, "d");
    assert_eq!(only_limit(&d.root.bare["a"]).quota, Quota::Unlimited);
    assert_eq!(only_limit(&d.root.bare["b"]).quota, limited(1, Unit::Day));
}

fn rpu_config(rpu: &str) -> String {
    format!(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      \
         requests_per_unit: {rpu}\n"
    )
}

#[test]
fn requests_per_unit_must_be_a_u32() {
    for (text, value) in [
        ("0", 0),
        ("4294967295", u32::MAX),
        ("1_000", 1000),
        ("~", 0),
        ("0x10", 16),
    ] {
        let rs = load(&rpu_config(text)).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(
            only_limit(&domain(&rs, "d").root.bare["a"]).quota,
            limited(value, Unit::Second),
            "{text}"
        );
    }
    for bad in ["-1", "4294967296", "'10'", "1.5", "ten", "true", "[1]"] {
        one_error(
            &rpu_config(bad),
            6,
            "descriptors[0].rate_limit.requests_per_unit",
            "requests_per_unit must be an integer from 0 to 4294967295",
        );
    }
    // Missing requests_per_unit is the reference's zero value: valid, and blocks everything.
    let rs = load("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second}\n").unwrap();
    assert_eq!(
        only_limit(&domain(&rs, "d").root.bare["a"]).quota,
        limited(0, Unit::Second)
    );
}

#[test]
fn flags_must_be_booleans() {
    for flag in [
        "shadow_mode",
        "detailed_metric",
        "value_to_metric",
        "quota_mode",
        "share_threshold",
    ] {
        for bad in ["'true'", "1", "maybe", "{}"] {
            one_error(
                &format!("domain: d\ndescriptors:\n  - key: a\n    value: x*\n    {flag}: {bad}\n"),
                5,
                &format!("descriptors[0].{flag}"),
                &format!("`{flag}` must be a boolean (true or false)"),
            );
        }
    }
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unlimited: 'yes'\n",
        5,
        "descriptors[0].rate_limit.unlimited",
        "`unlimited` must be a boolean",
    );
    // yaml.v2 (YAML 1.1) booleans are accepted, as envoyproxy/ratelimit accepts them.
    let rs = load(
        "domain: d\ndescriptors:\n  - key: a\n    shadow_mode: yes\n    detailed_metric: on\n    \
         value_to_metric: True\n    rate_limit:\n      unlimited: Y\n",
    )
    .unwrap();
    let n = &domain(&rs, "d").root.bare["a"];
    assert!(n.detailed_metric && n.value_to_metric);
    let rl = only_limit(n);
    assert!(rl.shadow_mode);
    assert_eq!(rl.quota, Quota::Unlimited);
}

#[test]
fn descriptor_flags_map_into_the_rule_and_node() {
    let rs = load(
        "domain: d
descriptors:
  - key: a
    shadow_mode: true
    quota_mode: true
    detailed_metric: true
    value_to_metric: true
    rate_limit:
      unit: second
      requests_per_unit: 1
  - key: b
    shadow_mode: false
    rate_limit:
      unit: second
      requests_per_unit: 1
  - key: c
    shadow_mode: true
",
    )
    .unwrap();
    let d = domain(&rs, "d");
    let a = &d.root.bare["a"];
    let rl = only_limit(a);
    assert!(rl.shadow_mode && rl.quota_mode);
    assert!(a.detailed_metric && a.value_to_metric && !a.share_threshold);
    let b = only_limit(&d.root.bare["b"]);
    assert!(!b.shadow_mode && !b.quota_mode);
    // shadow_mode without a rate_limit has nothing to act on, as in the reference.
    assert!(d.root.bare["c"].rate_limits.is_empty());
}

#[test]
fn replaces_entries() {
    let rs = load(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      name: big\n      unit: second\n      \
         requests_per_unit: 100\n      replaces:\n        - name: small\n        - {name: other}\n",
    )
    .unwrap();
    let rl = only_limit(&domain(&rs, "d").root.bare["a"]).clone();
    assert_eq!(rl.name.as_deref(), Some("big"));
    assert_eq!(rl.replaces, vec!["small".to_owned(), "other".to_owned()]);

    let base = "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      name: big\n      \
                unit: second\n      replaces:\n";
    one_error(
        &format!("{base}        - name: ''\n"),
        8,
        "descriptors[0].rate_limit.replaces[0].name",
        "should not have an empty replaces entry",
    );
    one_error(
        &format!("{base}        - {{}}\n"),
        8,
        "descriptors[0].rate_limit.replaces[0].name",
        "should not have an empty replaces entry",
    );
    one_error(
        &format!("{base}        - name: x\n        - name: big\n"),
        9,
        "descriptors[0].rate_limit.replaces",
        "replaces should not contain name of same descriptor",
    );
    one_error(
        &format!("{base}        - small\n"),
        8,
        "descriptors[0].rate_limit.replaces[0]",
        "each `replaces` entry must be a mapping like {name: other_limit}",
    );
    one_error(
        &format!("{base}        name: small\n"),
        8,
        "descriptors[0].rate_limit.replaces",
        "`replaces` must be a list, not a mapping",
    );
}

#[test]
fn share_threshold_requires_a_wildcard_value() {
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    value: exact\n    share_threshold: true\n",
        5,
        "descriptors[0].share_threshold",
        "share_threshold can only be used with wildcard values",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    share_threshold: true\n",
        4,
        "descriptors[0].share_threshold",
        "but found no value",
    );
    // false is always fine
    load("domain: d\ndescriptors:\n  - key: a\n    share_threshold: false\n").unwrap();
}

#[test]
fn values_are_matched_as_their_yaml_text() {
    let rs = load(
        "domain: d
descriptors:
  - key: authenticated
    value: true
  - key: port
    value: 010
  - key: k
    value:
  - key: q
    value: ''
  - key: 42
    value: \"1.5\"
",
    )
    .unwrap();
    let d = domain(&rs, "d");
    assert!(d.root.exact["authenticated"].contains_key("true"));
    assert!(d.root.exact["port"].contains_key("010"));
    assert!(d.root.bare.contains_key("k"));
    assert!(d.root.bare.contains_key("q"));
    assert_eq!(d.root.exact["42"]["1.5"].path, "d.42_1.5");
    // Unquoted floats are rejected by envoyproxy/ratelimit's key validation.
    one_error(
        "domain: d\ndescriptors:\n  - key: version\n    value: 1.5\n",
        4,
        "descriptors[0].value",
        "quote it to use it as text",
    );
    // A malformed value is one error, not also a duplicate of the bare key.
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n  - key: a\n    value: 2.0\n",
        5,
        "descriptors[1].value",
        "reads as a floating-point number",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    value: {x: 1}\n",
        4,
        "descriptors[0].value",
        "`value` must be a string, not a mapping",
    );
}

#[test]
fn wildcards_keep_file_order() {
    let rs = load(
        "domain: d\ndescriptors:\n  - key: p\n    value: /a/*\n  - key: p\n    value: '*'\n  \
         - key: p\n    value: /a*/b*\n  - key: p\n    value: /a/b\n",
    )
    .unwrap();
    let d = domain(&rs, "d");
    let order: Vec<_> = d
        .root
        .wildcards
        .iter()
        .map(|n| match &n.value {
            ValueMatch::Wildcard(w) => w.as_str(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(order, vec!["/a/*", "*", "/a*/b*"]);
    assert!(d.root.exact["p"].contains_key("/a/b"));
}

#[test]
fn bare_key_wildcard_is_rejected() {
    one_error(
        "domain: d\ndescriptors:\n  - key: 'header*'\n",
        3,
        "descriptors[0].key",
        "sluice does not support; put the wildcard in `value`",
    );
}

#[test]
fn rate_limit_null_means_no_limit() {
    let rs = load("domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n").unwrap();
    assert!(domain(&rs, "d").root.bare["a"].rate_limits.is_empty());
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: 5\n",
        4,
        "descriptors[0].rate_limit",
        "`rate_limit` must be a mapping, not a scalar",
    );
}

#[test]
fn structure_errors() {
    one_error(
        "- domain: d\n",
        1,
        "",
        "the top level must be a mapping with `domain` and `descriptors`, not a list",
    );
    one_error(
        "domain: d\ndescriptors:\n  key: a\n",
        3,
        "descriptors",
        "`descriptors` must be a list, not a mapping",
    );
    one_error(
        "domain: d\ndescriptors:\n  - a\n",
        3,
        "descriptors[0]",
        "each entry of `descriptors` must be a mapping",
    );
    one_error(
        "domain: [d]\n",
        1,
        "domain",
        "`domain` must be a string, not a list",
    );
    // Null descriptors is an empty list.
    load("domain: d\ndescriptors:\n").unwrap();
}

#[test]
fn metadata_is_accepted_and_not_checked() {
    let rs = load(
        "domain: d\ndescriptors:\n  - key: a\n    metadata:\n      backend: pool-a\n      \
         anything: {nested: [1, 2.5]}\n    rate_limit:\n      unit: second\n      \
         requests_per_unit: 1\n",
    )
    .unwrap();
    assert!(!domain(&rs, "d").root.bare["a"].rate_limits.is_empty());
}

#[test]
fn empty_file_is_an_error() {
    for text in ["", "\n\n", "# only a comment\n", "---\n", "~\n"] {
        let errs = errors(text);
        assert_eq!(errs.len(), 1, "{text:?}: {errs:#?}");
        assert_eq!(errs[0].message, "empty config file", "{text:?}");
        assert_eq!(errs[0].line, None);
        assert_eq!(errs[0].to_string(), "test.yaml: empty config file");
    }
}

#[test]
fn more_than_one_document_is_an_error() {
    one_error(
        "domain: a\n---\ndomain: b\n",
        3,
        "",
        "more than one YAML document in one config file",
    );
    // A trailing document marker with nothing after it is harmless.
    load("---\ndomain: a\n---\n").unwrap();
}

#[test]
fn duplicate_mapping_keys_are_an_error() {
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      \
         unit: minute\n",
        6,
        "descriptors[0].rate_limit.unit",
        "duplicate key 'unit' in one mapping (first at line 5)",
    );
    one_error(
        "domain: d\ndescriptors: []\ndescriptors: []\n",
        3,
        "descriptors",
        "duplicate key 'descriptors'",
    );
}

#[test]
fn anchors_aliases_and_merge_keys_resolve() {
    let rs = load(
        "domain: d
descriptors:
  - key: a
    rate_limit: &per_minute
      unit: minute
      requests_per_unit: 60
  - key: b
    rate_limit: *per_minute
  - key: c
    rate_limit:
      <<: *per_minute
      requests_per_unit: 5
",
    )
    .unwrap();
    let d = domain(&rs, "d");
    let quota = |k: &str| only_limit(&d.root.bare[k]).quota;
    assert_eq!(quota("a"), limited(60, Unit::Minute));
    assert_eq!(quota("b"), limited(60, Unit::Minute));
    assert_eq!(quota("c"), limited(5, Unit::Minute));
}

#[test]
fn errors_in_several_files_are_all_reported() {
    let err = load_sources(&[
        ("a.yaml".into(), "domain: a\nbogus: 1\n".into()),
        ("b.yaml".into(), "domain: b\ndescriptors: [x: 1]\n".into()),
        ("c.yaml".into(), "domain: c\n".into()),
    ])
    .unwrap_err();
    let where_: Vec<_> = err.0.iter().map(|e| (e.file.as_str(), e.line)).collect();
    assert_eq!(
        where_,
        vec![
            ("a.yaml", Some(2)),
            ("b.yaml", Some(2)),
            ("b.yaml", Some(2))
        ]
    );
    let text = err.to_string();
    assert_eq!(text.lines().count(), 3, "{text}");
    assert!(
        text.starts_with("a.yaml:2: bogus: config error, unknown key 'bogus'"),
        "{text}"
    );
}

// ---- sluice extensions (README "sluice extensions") ----

/// A config with one `rate_limit` on bare key `a`; `lines` go inside it, from line 5 on.
fn limit_config(lines: &[&str]) -> String {
    let mut s = "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n".to_owned();
    for l in lines {
        s.push_str("      ");
        s.push_str(l);
        s.push('\n');
    }
    s
}

/// The counted limit of [`limit_config`].
fn limit_of(lines: &[&str]) -> Limit {
    let text = limit_config(lines);
    let rs = load(&text).unwrap_or_else(|e| panic!("{text}\n{e}"));
    match only_limit(&domain(&rs, "d").root.bare["a"]).quota {
        Quota::Limited(l) => l,
        Quota::Unlimited => panic!("unlimited"),
    }
}

/// Every limit of every node of a level, recursively.
fn all_limits(level: &Level) -> Vec<&RateLimitRule> {
    level
        .nodes()
        .flat_map(|n| n.rate_limits.iter().chain(all_limits(&n.children)))
        .collect()
}

#[test]
fn envoyproxy_config_keeps_its_exact_model() {
    let rs = load(&unit_config("minute")).unwrap();
    let n = &domain(&rs, "d").root.bare["a"];
    assert_eq!(
        n.rate_limits,
        vec![RateLimitRule {
            name: None,
            quota: Quota::Limited(Limit {
                requests_per_unit: 7,
                period: Period::from_unit(Unit::Minute),
                algorithm: Algorithm::FixedWindow,
                burst: 0,
            }),
            replaces: vec![],
            shadow_mode: false,
            quota_mode: false,
            applies_to_descendants: false,
        }]
    );
    let Quota::Limited(l) = n.rate_limits[0].quota else {
        unreachable!()
    };
    assert_eq!(l.period.unit(), Some(Unit::Minute));
    assert_eq!(l.period.millis(), 60_000);
}

#[test]
fn period_forms() {
    for (text, millis, unit) in [
        ("500ms", 500, None),
        ("10s", 10_000, None),
        ("5m", 300_000, None),
        ("1h", 3_600_000, Some(Unit::Hour)),
        ("2d", 172_800_000, None),
        ("1w", 604_800_000, Some(Unit::Week)),
        ("1000ms", 1_000, Some(Unit::Second)),
        ("'90s'", 90_000, None),
    ] {
        let l = limit_of(&["requests_per_unit: 5", &format!("period: {text}")]);
        assert_eq!(l.period.millis(), millis, "{text}");
        assert_eq!(l.period.unit(), unit, "{text}");
        assert_eq!(l.requests_per_unit, 5);
        assert_eq!(l.algorithm, Algorithm::FixedWindow);
        assert_eq!(l.burst, 0);
    }
    // A period equal to a unit is that unit: `period: 60s` means exactly `unit: minute`.
    let by_period = limit_of(&["requests_per_unit: 5", "period: 60s"]);
    assert_eq!(by_period.period.unit(), Some(Unit::Minute));
    assert_eq!(
        by_period,
        limit_of(&["requests_per_unit: 5", "unit: minute"])
    );
    assert_eq!(by_period, Limit::fixed(5, Unit::Minute));
}

#[test]
fn bad_periods_are_rejected() {
    for (bad, needle) in [
        ("0s", "period '0s' must be longer than zero"),
        ("0ms", "must be longer than zero"),
        (
            "10",
            "period '10' needs a unit suffix (ms, s, m, h, d or w)",
        ),
        ("10x", "period '10x' has an unknown suffix 'x'"),
        ("10 s", "unknown suffix ' s'"),
        ("-1s", "period '-1s' must start with a whole number"),
        ("1.5s", "period '1.5s' must be a whole number and a suffix"),
        ("1.5", "must be a whole number and a suffix"),
        ("''", "needs a unit suffix"),
        ("[10s]", "`period` must be a duration such as 500ms, 10s"),
        ("", "`period` is empty; expected a duration such as 500ms"),
    ] {
        one_error(
            &limit_config(&["requests_per_unit: 5", &format!("period: {bad}")]),
            6,
            "descriptors[0].rate_limit.period",
            needle,
        );
    }
}

#[test]
fn unit_and_period_are_exclusive() {
    one_error(
        &limit_config(&["unit: second", "requests_per_unit: 5", "period: 10s"]),
        7,
        "descriptors[0].rate_limit.period",
        "`period` and `unit` cannot both be given (`unit` is at line 5); keep one of them",
    );
    // Reported on `period` wherever it is.
    one_error(
        &limit_config(&["period: 10s", "unit: second"]),
        5,
        "descriptors[0].rate_limit.period",
        "(`unit` is at line 6)",
    );
    // Neither: the envoyproxy error, naming `period` as the alternative.
    let e = one_error(
        &limit_config(&["requests_per_unit: 5", "algorithm: sliding_log"]),
        5,
        "descriptors[0].rate_limit.unit",
        "`unit` is required unless `unlimited: true`",
    );
    assert!(
        e.message
            .contains("or give a `period` instead (a duration such as 500ms"),
        "{e}"
    );
}

#[test]
fn algorithms_parse_and_default_to_fixed_window() {
    for alg in Algorithm::ALL {
        let l = limit_of(&[
            "requests_per_unit: 5",
            "unit: second",
            &format!("algorithm: {}", alg.name()),
        ]);
        assert_eq!(l.algorithm, alg);
    }
    assert_eq!(
        limit_of(&["requests_per_unit: 5", "unit: second"]).algorithm,
        Algorithm::FixedWindow
    );
}

#[test]
fn bad_algorithm_lists_the_choices() {
    let choices = "expected one of fixed_window, sliding_window, sliding_log, token_bucket";
    for (bad, extra) in [
        ("leaky_bucket", ""),
        ("sliding-log", ""),
        ("'fixed window'", ""),
        ("Token_Bucket", " (names are lower-case)"),
        ("FIXED_WINDOW", " (names are lower-case)"),
        ("1", ""),
    ] {
        let text = limit_config(&["unit: second", &format!("algorithm: {bad}")]);
        let e = one_error(
            &text,
            6,
            "descriptors[0].rate_limit.algorithm",
            &format!("{choices}{extra}"),
        );
        assert!(e.message.starts_with("invalid algorithm '"), "{e}");
    }
    one_error(
        &limit_config(&["unit: second", "algorithm:"]),
        6,
        "descriptors[0].rate_limit.algorithm",
        "`algorithm` is empty; expected one of fixed_window",
    );
    one_error(
        &limit_config(&["unit: second", "algorithm: {a: 1}"]),
        6,
        "descriptors[0].rate_limit.algorithm",
        "`algorithm` must be one of fixed_window, sliding_window, sliding_log, token_bucket, \
         not a mapping",
    );
}

#[test]
fn burst_only_with_token_bucket() {
    one_error(
        &limit_config(&["unit: second", "burst: 3"]),
        6,
        "descriptors[0].rate_limit.burst",
        "`burst` only applies to `algorithm: token_bucket`; this limit uses fixed_window (the \
         default)",
    );
    for alg in ["fixed_window", "sliding_window", "sliding_log"] {
        one_error(
            &limit_config(&["unit: second", &format!("algorithm: {alg}"), "burst: 3"]),
            7,
            "descriptors[0].rate_limit.burst",
            &format!("`burst` only applies to `algorithm: token_bucket`; this limit uses {alg}"),
        );
    }
    for bad in ["-1", "4294967296", "1.5", "lots", "'3'", "[3]", ""] {
        one_error(
            &limit_config(&[
                "unit: second",
                "algorithm: token_bucket",
                &format!("burst: {bad}"),
            ]),
            7,
            "descriptors[0].rate_limit.burst",
            "`burst` must be an integer from 0 to 4294967295",
        );
    }
    // A bad algorithm is one error, not also a misplaced burst.
    one_error(
        &limit_config(&["unit: second", "algorithm: gcra", "burst: 3"]),
        6,
        "descriptors[0].rate_limit.algorithm",
        "invalid algorithm 'gcra'",
    );
}

#[test]
fn burst_defaults_to_requests_per_unit_minus_one() {
    let tb = |lines: &[&str]| {
        let mut all = vec!["unit: second", "algorithm: token_bucket"];
        all.extend_from_slice(lines);
        limit_of(&all)
    };
    assert_eq!(tb(&["requests_per_unit: 10"]).burst, 9);
    assert_eq!(tb(&["requests_per_unit: 1"]).burst, 0);
    // Saturates at 0: a limit of 0 (blocks everything) or none at all.
    assert_eq!(tb(&["requests_per_unit: 0"]).burst, 0);
    assert_eq!(tb(&[]).burst, 0);
    assert_eq!(tb(&["requests_per_unit: 10", "burst: 0"]).burst, 0);
    assert_eq!(tb(&["requests_per_unit: 10", "burst: 25"]).burst, 25);
    assert_eq!(tb(&["requests_per_unit: 4294967295"]).burst, u32::MAX - 1);
    // The other algorithms carry no burst.
    for alg in ["fixed_window", "sliding_window", "sliding_log"] {
        let l = limit_of(&[
            "unit: second",
            "requests_per_unit: 10",
            &format!("algorithm: {alg}"),
        ]);
        assert_eq!(l.burst, 0, "{alg}");
    }
}

#[test]
fn applies_to_descendants_needs_children() {
    let rs = load(
        "domain: d
descriptors:
  - key: resource
    value: calc
    rate_limit:
      requests_per_unit: 5
      period: 10s
      applies_to_descendants: true
    descriptors:
      - key: consumer
        rate_limits:
          - {requests_per_unit: 3, period: 10s, applies_to_descendants: false}
          - {requests_per_unit: 9, period: 10s, name: other}
",
    )
    .unwrap();
    let calc = &domain(&rs, "d").root.exact["resource"]["calc"];
    assert!(only_limit(calc).applies_to_descendants);
    let consumer = &calc.children.bare["consumer"];
    assert!(consumer
        .rate_limits
        .iter()
        .all(|rl| !rl.applies_to_descendants));

    let leaf = one_error(
        &limit_config(&["unit: second", "applies_to_descendants: true"]),
        6,
        "descriptors[0].rate_limit.applies_to_descendants",
        "`applies_to_descendants: true` on a descriptor without child `descriptors`: no request \
         can ever match below this node",
    );
    assert!(leaf
        .message
        .contains("add child descriptors or remove the flag"));
    // An empty children list is still a leaf.
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    descriptors: []\n    rate_limits:\n      \
         - {unit: second}\n      - {unit: day, applies_to_descendants: true}\n",
        7,
        "descriptors[0].rate_limits[1].applies_to_descendants",
        "without child `descriptors`",
    );
    // `false` on a leaf says nothing and is fine.
    load(&limit_config(&[
        "unit: second",
        "applies_to_descendants: false",
    ]))
    .unwrap();
    one_error(
        &limit_config(&["unit: second", "applies_to_descendants: 'yes'"]),
        6,
        "descriptors[0].rate_limit.applies_to_descendants",
        "`applies_to_descendants` must be a boolean",
    );
    // It is a property of a limit, not of the descriptor.
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    applies_to_descendants: true\n",
        4,
        "descriptors[0].applies_to_descendants",
        "`applies_to_descendants` belongs inside `rate_limit` (or an entry of `rate_limits`)",
    );
}

#[test]
fn unlimited_rejects_period_algorithm_and_burst() {
    for (line, key) in [
        ("period: 10s", "period"),
        ("period: bogus", "period"),
        ("algorithm: sliding_log", "algorithm"),
        ("algorithm: fixed_window", "algorithm"),
        ("burst: 3", "burst"),
    ] {
        one_error(
            &limit_config(&["unlimited: true", line]),
            6,
            &format!("descriptors[0].rate_limit.{key}"),
            &format!("should not specify rate limit {key} when unlimited"),
        );
    }
    // All at once: one error each.
    let errs = errors(&limit_config(&[
        "unlimited: true",
        "unit: second",
        "period: 10s",
        "algorithm: token_bucket",
        "burst: 1",
    ]));
    let at: Vec<_> = errs.iter().map(|e| (e.line, e.path.as_str())).collect();
    assert_eq!(
        at,
        vec![
            (Some(6), "descriptors[0].rate_limit.unit"),
            (Some(7), "descriptors[0].rate_limit.period"),
            (Some(8), "descriptors[0].rate_limit.algorithm"),
            (Some(9), "descriptors[0].rate_limit.burst"),
        ],
        "{errs:#?}"
    );
}

#[test]
fn rate_limits_list_loads_every_entry() {
    let rs = load(
        "domain: d
descriptors:
  - key: consumer
    shadow_mode: true
    quota_mode: true
    rate_limits:
      - requests_per_unit: 10
        unit: second
        name: per_second
      - requests_per_unit: 20
        period: 1m
        algorithm: token_bucket
        burst: 5
        name: per_minute
        replaces:
          - name: elsewhere
      - unlimited: true
        name: free
",
    )
    .unwrap();
    let n = &domain(&rs, "d").root.bare["consumer"];
    assert_eq!(n.rate_limits.len(), 3);
    let [a, b, c] = &n.rate_limits[..] else {
        unreachable!()
    };
    assert_eq!(a.name.as_deref(), Some("per_second"));
    assert_eq!(a.quota, limited(10, Unit::Second));
    assert_eq!(b.name.as_deref(), Some("per_minute"));
    assert_eq!(
        b.quota,
        Quota::Limited(Limit {
            requests_per_unit: 20,
            period: Period::from_unit(Unit::Minute),
            algorithm: Algorithm::TokenBucket,
            burst: 5,
        })
    );
    assert_eq!(b.replaces, vec!["elsewhere".to_owned()]);
    assert_eq!(c.quota, Quota::Unlimited);
    // Descriptor-level flags apply to every limit of the node.
    assert!(n
        .rate_limits
        .iter()
        .all(|rl| rl.shadow_mode && rl.quota_mode));
    assert_eq!(rs.rule_counts(), vec![("d".to_owned(), 3)]);

    // Entry errors carry the entry's index.
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limits:\n      - {unit: second}\n      \
         - {unit: fortnight}\n",
        6,
        "descriptors[0].rate_limits[1].unit",
        "invalid rate limit unit 'fortnight'",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limits:\n      - name: x\n        \
         unit: second\n        replaces: [{name: x}]\n",
        7,
        "descriptors[0].rate_limits[0].replaces",
        "replaces should not contain name of same descriptor ('x')",
    );
}

#[test]
fn rate_limit_and_rate_limits_are_exclusive() {
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n    \
         rate_limits:\n      - {unit: minute}\n",
        6,
        "descriptors[0].rate_limits",
        "`rate_limit` and `rate_limits` cannot both be given on one descriptor (`rate_limit` is \
         at line 4); put every limit in `rate_limits`",
    );
    // Reported on whichever comes second.
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limits:\n      - {unit: minute}\n    \
         rate_limit:\n      unit: second\n",
        6,
        "descriptors[0].rate_limit",
        "(`rate_limits` is at line 4)",
    );
}

#[test]
fn rate_limits_must_be_a_non_empty_list_of_mappings() {
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limits: []\n",
        4,
        "descriptors[0].rate_limits",
        "`rate_limits` is empty; list at least one limit, or remove the key",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limits:\n",
        4,
        "descriptors[0].rate_limits",
        "`rate_limits` has no entries",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limits:\n      unit: second\n",
        5,
        "descriptors[0].rate_limits",
        "`rate_limits` must be a list of limits (a mapping per limit), not a mapping",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limits:\n      - {unit: second}\n      - 5\n",
        6,
        "descriptors[0].rate_limits[1]",
        "each `rate_limits` entry must be a mapping like {requests_per_unit: 10, unit: second}, \
         not a scalar",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limits:\n      - ~\n",
        5,
        "descriptors[0].rate_limits[0]",
        "each `rate_limits` entry must be a mapping",
    );
}

#[test]
fn duplicate_limit_names_on_one_descriptor() {
    one_error(
        "domain: d
descriptors:
  - key: a
    rate_limits:
      - name: fast
        unit: second
      - name: slow
        unit: day
      - name: fast
        unit: minute
",
        9,
        "descriptors[0].rate_limits[2].name",
        "duplicate limit name 'fast' on one descriptor (first at line 5)",
    );
    // The same name on different descriptors is fine (that is what `replaces` refers to), and
    // unnamed limits never collide.
    load(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {name: x, unit: second}\n  \
         - key: b\n    rate_limits:\n      - {name: x, unit: second}\n      - {unit: minute}\n      \
         - {unit: hour}\n      - {name: '', unit: day}\n",
    )
    .unwrap();
}

#[test]
fn limit_scopes_list_their_keys_and_point_to_the_right_place() {
    let all = "unit, requests_per_unit, unlimited, name, replaces, period, algorithm, burst, \
               applies_to_descendants";
    one_error(
        &limit_config(&["unit: second", "limit: 3"]),
        6,
        "descriptors[0].rate_limit.limit",
        &format!("unknown key 'limit' in `rate_limit`; accepted in `rate_limit`: {all}"),
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limits:\n      - {unit: second, window: 3}\n",
        5,
        "descriptors[0].rate_limits[0].window",
        &format!(
            "unknown key 'window' in a `rate_limits` entry; accepted in a `rate_limits` entry: {all}"
        ),
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limits:\n      - unit: second\n        \
         shadow_mode: true\n",
        6,
        "descriptors[0].rate_limits[0].shadow_mode",
        "`shadow_mode` belongs to the descriptor, next to `rate_limits`, not inside one of its \
         entries",
    );
    one_error(
        &limit_config(&["unit: second", "rate_limits: []"]),
        6,
        "descriptors[0].rate_limit.rate_limits",
        "a limit cannot contain another",
    );
    for key in ["period", "algorithm", "burst"] {
        one_error(
            &format!("domain: d\ndescriptors:\n  - key: a\n    {key}: 1\n"),
            4,
            &format!("descriptors[0].{key}"),
            &format!("`{key}` belongs inside `rate_limit` (or an entry of `rate_limits`)"),
        );
    }
    one_error(
        "domain: d\nrate_limits: []\n",
        2,
        "rate_limits",
        "`rate_limits` belongs in an entry of `descriptors`",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    colour: red\n",
        4,
        "descriptors[0].colour",
        "accepted in a descriptor: key, value, rate_limit, rate_limits, descriptors",
    );
}

#[test]
fn several_extension_mistakes_are_all_reported_with_lines() {
    let errs = errors(
        "domain: calc
descriptors:
  - key: resource
    value: calc
    rate_limit:
      requests_per_unit: 5
      period: 10 seconds
      algorithm: sliding_logs
      applies_to_descendants: true
    rate_limits:
      - {requests_per_unit: 1, unit: second}
    descriptors:
      - key: consumer
        rate_limits:
          - requests_per_unit: 3
            period: 10s
            unit: second
            name: c
          - requests_per_unit: 1000
            unit: day
            burst: 10
            name: c
          - unlimited: true
            algorithm: sliding_log
            applies_to_descendants: true
      - key: plan
        rate_limits: []
",
    );
    let got: Vec<_> = errs
        .iter()
        .map(|e| (e.line.unwrap(), e.path.as_str()))
        .collect();
    assert_eq!(
        got,
        vec![
            (7, "descriptors[0].rate_limit.period"),
            (8, "descriptors[0].rate_limit.algorithm"),
            (10, "descriptors[0].rate_limits"),
            (16, "descriptors[0].descriptors[0].rate_limits[0].period"),
            (21, "descriptors[0].descriptors[0].rate_limits[1].burst"),
            (22, "descriptors[0].descriptors[0].rate_limits[1].name"),
            (24, "descriptors[0].descriptors[0].rate_limits[2].algorithm"),
            (
                25,
                "descriptors[0].descriptors[0].rate_limits[2].applies_to_descendants"
            ),
            (27, "descriptors[0].descriptors[1].rate_limits"),
        ],
        "{errs:#?}"
    );
    let needles = [
        "period '10 seconds' has an unknown suffix",
        "invalid algorithm 'sliding_logs'",
        "`rate_limit` and `rate_limits` cannot both be given",
        "`period` and `unit` cannot both be given (`unit` is at line 17)",
        "`burst` only applies to `algorithm: token_bucket`",
        "duplicate limit name 'c' on one descriptor (first at line 18)",
        "should not specify rate limit algorithm when unlimited",
        "without child `descriptors`",
        "`rate_limits` is empty",
    ];
    for (e, needle) in errs.iter().zip(needles) {
        assert!(
            e.message.contains(needle),
            "{e} does not contain {needle:?}"
        );
        assert_eq!(e.file, FILE);
        assert!(e
            .to_string()
            .starts_with(&format!("test.yaml:{}: ", e.line.unwrap())));
    }
}

#[test]
fn dump_shows_extension_limits() {
    let rs = load(
        "domain: calc
descriptors:
  - key: resource
    value: calc
    rate_limit:
      requests_per_unit: 5
      period: 10s
      algorithm: sliding_log
      applies_to_descendants: true
    descriptors:
      - key: consumer
        shadow_mode: true
        rate_limits:
          - {requests_per_unit: 3, period: 500ms, algorithm: token_bucket, name: burst}
          - {requests_per_unit: 1000, period: 1d}
          - {requests_per_unit: 60, period: 60s, algorithm: sliding_window}
",
    )
    .unwrap();
    // Sorted as `/rlconfig` serves it: a node's children sort before the node itself.
    let dump = rs.dump();
    assert_eq!(
        dump.lines().collect::<Vec<_>>(),
        vec![
            "calc.resource_calc.consumer: unit=500ms requests_per_unit=3 algorithm=token_bucket \
             burst=2, shadow_mode: true, name: burst",
            "calc.resource_calc.consumer: unit=DAY requests_per_unit=1000, shadow_mode: true",
            "calc.resource_calc.consumer: unit=MINUTE requests_per_unit=60 \
             algorithm=sliding_window, shadow_mode: true",
            "calc.resource_calc: unit=10s requests_per_unit=5 algorithm=sliding_log, \
             shadow_mode: false, applies_to_descendants: true",
        ]
    );
    assert!(dump.ends_with('\n'));
    // An envoyproxy config dumps as before.
    let rs = load(&unit_config("hour")).unwrap();
    assert_eq!(
        rs.dump(),
        "d.a: unit=HOUR requests_per_unit=7, shadow_mode: false\n"
    );
}

#[test]
fn example_hierarchy_yaml_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples/hierarchy.yaml");
    let rs = load_path(&path, &LoadOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    let d = domain(&rs, "calc");
    let period_10s = Period::parse("10s").unwrap();

    let calc = &d.root.exact["resource"]["calc"];
    let rl = only_limit(calc);
    assert!(rl.applies_to_descendants);
    assert_eq!(
        rl.quota,
        Quota::Limited(Limit {
            requests_per_unit: 5,
            period: period_10s,
            algorithm: Algorithm::SlidingLog,
            burst: 0,
        })
    );
    let consumer = &calc.children.bare["consumer"];
    assert_eq!(consumer.path, "calc.resource_calc.consumer");
    let quotas: Vec<_> = consumer.rate_limits.iter().map(|rl| rl.quota).collect();
    assert_eq!(
        quotas,
        vec![
            Quota::Limited(Limit {
                requests_per_unit: 3,
                period: period_10s,
                algorithm: Algorithm::SlidingLog,
                burst: 0,
            }),
            limited(1000, Unit::Day),
        ]
    );
    assert!(consumer
        .rate_limits
        .iter()
        .all(|rl| !rl.applies_to_descendants));

    let upload = only_limit(&d.root.exact["resource"]["upload"]);
    assert_eq!(
        upload.quota,
        Quota::Limited(Limit {
            requests_per_unit: 10,
            period: Period::from_unit(Unit::Second),
            algorithm: Algorithm::TokenBucket,
            burst: 20,
        })
    );
    let search = only_limit(&d.root.exact["resource"]["search"]);
    assert_eq!(
        search.quota,
        Quota::Limited(Limit {
            requests_per_unit: 600,
            period: Period::from_unit(Unit::Minute),
            algorithm: Algorithm::SlidingWindow,
            burst: 0,
        })
    );
    assert_eq!(rs.rule_counts(), vec![("calc".to_owned(), 5)]);
}

// ---- load_path ----

fn write(path: &Path, text: &str) {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).unwrap();
    }
    fs::write(path, text).unwrap();
}

#[test]
fn load_path_single_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("one.yaml");
    write(&file, "domain: one\n");
    let rs = load_path(&file, &LoadOptions::default()).unwrap();
    assert_eq!(rs.sources, vec![file.clone()]);
    assert_eq!(&*domain(&rs, "one").file, file.display().to_string());
}

#[test]
fn load_path_directory_is_recursive_and_sorted() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("b.yaml"), "domain: b\n");
    write(&dir.path().join("a.yaml"), "domain: a\n");
    write(&dir.path().join("sub/c.yaml"), "domain: c\n");
    let rs = load_path(dir.path(), &LoadOptions::default()).unwrap();
    let expected: Vec<_> = ["a.yaml", "b.yaml", "sub/c.yaml"]
        .iter()
        .map(|p| dir.path().join(p))
        .collect();
    assert_eq!(rs.sources, expected);
    assert_eq!(rs.domains.len(), 3);
    assert_eq!(
        &*domain(&rs, "c").file,
        dir.path().join("sub/c.yaml").display().to_string()
    );
}

#[test]
fn load_path_directory_errors_name_their_file() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("good.yaml"), "domain: good\n");
    write(
        &dir.path().join("bad.yaml"),
        "domain: bad\ndescriptors:\n  - value: x\n",
    );
    let err = load_path(dir.path(), &LoadOptions::default()).unwrap_err();
    assert_eq!(err.0.len(), 1, "{err}");
    assert_eq!(
        err.0[0].file,
        dir.path().join("bad.yaml").display().to_string()
    );
    assert_eq!(err.0[0].line, Some(3));
}

#[test]
fn load_path_dotfiles_are_skipped_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("a.yaml"), "domain: a\n");
    write(&dir.path().join(".hidden.yaml"), "domain: a\n");
    write(&dir.path().join(".git/config"), "not: [yaml\n");
    let err = load_path(dir.path(), &LoadOptions::default()).unwrap_err();
    assert!(
        err.0
            .iter()
            .any(|e| e.message.contains("RUNTIME_IGNOREDOTFILES=true")),
        "{err}"
    );
    assert!(
        err.0
            .iter()
            .any(|e| e.message.contains("YAML syntax error")),
        "{err}"
    );
    let rs = load_path(
        dir.path(),
        &LoadOptions {
            ignore_dotfiles: true,
            merge_domains: false,
        },
    )
    .unwrap();
    assert_eq!(rs.sources, vec![dir.path().join("a.yaml")]);
}

/// The layout kubelet gives a mounted ConfigMap: the files live in a timestamped dot directory,
/// `..data` links to it, and each visible file links through `..data`.
#[cfg(unix)]
#[test]
fn load_path_kubernetes_configmap_layout() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    write(
        &root.join("..2024_01_01_00_00_00.123/ratelimit.yaml"),
        "domain: rl\n",
    );
    write(
        &root.join("..2024_01_01_00_00_00.123/other.yaml"),
        "domain: other\n",
    );
    symlink("..2024_01_01_00_00_00.123", root.join("..data")).unwrap();
    symlink("..data/ratelimit.yaml", root.join("ratelimit.yaml")).unwrap();
    symlink("..data/other.yaml", root.join("other.yaml")).unwrap();

    // Without ignoring dotfiles every file is seen three times: duplicate domains, with a hint.
    let err = load_path(root, &LoadOptions::default()).unwrap_err();
    assert_eq!(err.0.len(), 4, "{err}");
    for e in &err.0 {
        assert!(e.message.starts_with("duplicate domain"), "{e}");
        assert!(e.message.contains("RUNTIME_IGNOREDOTFILES=true"), "{e}");
    }

    let rs = load_path(
        root,
        &LoadOptions {
            ignore_dotfiles: true,
            merge_domains: false,
        },
    )
    .unwrap();
    assert_eq!(
        rs.sources,
        vec![root.join("other.yaml"), root.join("ratelimit.yaml")]
    );
    assert_eq!(rs.domains.len(), 2);
}

#[cfg(unix)]
#[test]
fn load_path_symlink_loop_is_an_error() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("sub/a.yaml"), "domain: a\n");
    symlink("..", dir.path().join("sub/up")).unwrap();
    let err = load_path(dir.path(), &LoadOptions::default()).unwrap_err();
    assert!(
        err.0.iter().any(|e| e.message.contains("symlink loop")),
        "{err}"
    );
}

#[test]
fn load_path_missing_path_or_empty_directory() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    let err = load_path(&missing, &LoadOptions::default()).unwrap_err();
    assert_eq!(err.0.len(), 1);
    assert_eq!(err.0[0].file, missing.display().to_string());
    assert!(
        err.0[0].message.starts_with("cannot read config path"),
        "{err}"
    );

    let err = load_path(dir.path(), &LoadOptions::default()).unwrap_err();
    assert_eq!(err.0.len(), 1);
    assert_eq!(err.0[0].file, dir.path().display().to_string());
    assert!(err.0[0].message.contains("no config files found"), "{err}");

    // Only dotfiles, skipped: still empty, and the message says why.
    write(&dir.path().join(".only.yaml"), "domain: a\n");
    let err = load_path(
        dir.path(),
        &LoadOptions {
            ignore_dotfiles: true,
            merge_domains: false,
        },
    )
    .unwrap_err();
    assert!(err.0[0].message.contains("RUNTIME_IGNOREDOTFILES"), "{err}");
}

#[test]
fn load_path_empty_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("empty.yaml");
    write(&file, "");
    let err = load_path(&file, &LoadOptions::default()).unwrap_err();
    assert_eq!(err.0.len(), 1);
    assert_eq!(err.0[0].message, "empty config file");
}

#[test]
fn loaded_at_is_now() {
    let before = std::time::SystemTime::now();
    let rs = load("domain: d\n").unwrap();
    assert!(rs.loaded_at >= before);
}

#[test]
fn sliding_log_limits_are_capped() {
    let errs = errors(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {requests_per_unit: 100001, period: 1s, algorithm: sliding_log}\n",
    );
    assert!(
        errs.iter().any(|e| e.message.contains("capped at 100000")),
        "{errs:?}"
    );
    assert!(load(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {requests_per_unit: 100000, period: 1s, algorithm: sliding_log}\n"
    )
    .is_ok());
}

#[test]
fn hash_tag_scope_is_descriptor_by_default_or_the_domain() {
    let rs = load("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n")
        .expect("loads");
    assert!(!domain(&rs, "d").domain_tag);
    let rs = load("domain: d\nhash_tag: domain\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n")
        .expect("loads");
    assert!(domain(&rs, "d").domain_tag);
    one_error(
        "domain: d\nhash_tag: slot\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        2,
        "hash_tag",
        "hash_tag must be `descriptor`",
    );
}

#[test]
fn token_bucket_that_cannot_be_exact_is_refused() {
    // A day / 4 000 000 007 leaves a remainder of ~2.6e9; with the default burst the products
    // pass 2^53.
    one_error(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: day, requests_per_unit: 4000000007, algorithm: token_bucket}\n",
        4,
        "descriptors[0].rate_limit",
        "cannot be decided exactly",
    );
    // A rate that divides the period is exact at any burst.
    load("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1000000, algorithm: token_bucket, burst: 4000000000}\n")
        .expect("exact");
}
