//! envoyproxy/ratelimit's config schema: what loads, and every mistake reported with its line.

use super::*;

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
