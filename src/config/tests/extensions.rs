//! The sluice extensions (docs/semantics.md, "sluice extensions"): periods, algorithms, bursts, resource
//! limits, several limits per descriptor, hash tags.

use super::*;

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
            record_usage: false,
            reservations: None,
            leased: None,
            own_tag: false,
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

#[test]
fn counting_is_read_per_domain_and_a_bad_value_names_its_line() {
    let rs = load("domain: d\ncounting: all_or_nothing\ndescriptors: []\n").unwrap();
    assert_eq!(domain(&rs, "d").counting, Some(Counting::AllOrNothing));
    let rs = load("domain: d\ncounting: EnvoyProxy\ndescriptors: []\n").unwrap();
    assert_eq!(domain(&rs, "d").counting, Some(Counting::Envoyproxy));
    let rs = load("domain: d\ndescriptors: []\n").unwrap();
    assert_eq!(
        domain(&rs, "d").counting,
        None,
        "absent: the global COUNTING"
    );
    one_error(
        "domain: d\ncounting: sometimes\ndescriptors: []\n",
        2,
        "counting",
        "counting must be `envoyproxy`",
    );
}

#[test]
fn record_usage_is_read_on_a_limit() {
    let text = limit_config(&[
        "unit: hour",
        "requests_per_unit: 1000",
        "record_usage: true",
    ]);
    let rs = load(&text).unwrap();
    assert!(only_limit(&domain(&rs, "d").root.bare["a"]).record_usage);
    one_error(
        &limit_config(&["unit: hour", "requests_per_unit: 1", "record_usage: often"]),
        7,
        "descriptors[0].rate_limit.record_usage",
        "must be a boolean",
    );
}

#[test]
fn resource_limits_under_envoyproxy_counting_are_warned_about_and_rlconfig_shows_counting() {
    let tree = "descriptors:\n  - key: r\n    value: x\n    rate_limit: {unit: hour, requests_per_unit: 5, applies_to_descendants: true}\n    descriptors:\n      - key: c\n        rate_limit: {unit: hour, requests_per_unit: 1}\n";
    let plain = load(&format!("domain: d\n{tree}")).unwrap();
    let warnings = plain.counting_warnings(Counting::Envoyproxy);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains(":3: d.r_x: applies_to_descendants under envoyproxy counting"),
        "{}",
        warnings[0]
    );
    assert!(
        plain.counting_warnings(Counting::AllOrNothing).is_empty(),
        "global all_or_nothing"
    );
    let aon = load(&format!("domain: d\ncounting: all_or_nothing\n{tree}")).unwrap();
    assert!(
        aon.counting_warnings(Counting::Envoyproxy).is_empty(),
        "the domain asks for it"
    );
    assert!(plain
        .dump_with(Counting::Envoyproxy)
        .starts_with("d: counting=envoyproxy (COUNTING)\n"));
    assert!(aon
        .dump_with(Counting::Envoyproxy)
        .starts_with("d: counting=all_or_nothing\n"));
}

#[test]
fn allow_limit_override_is_read_per_domain_and_a_bad_value_names_its_line() {
    let rs = load("domain: d\nallow_limit_override: false\ndescriptors: []\n").expect("loads");
    assert_eq!(domain(&rs, "d").allow_limit_override, Some(false));
    let rs = load("domain: d\ndescriptors: []\n").expect("loads");
    assert_eq!(
        domain(&rs, "d").allow_limit_override,
        None,
        "absent: ALLOW_LIMIT_OVERRIDE decides"
    );
    one_error(
        "domain: d\nallow_limit_override: sometimes\ndescriptors: []\n",
        2,
        "allow_limit_override",
        "must be a boolean",
    );
}

#[test]
fn a_domain_over_1_kib_is_refused_with_its_line() {
    let long = "d".repeat(crate::config::MAX_DOMAIN_BYTES + 1);
    one_error(
        &format!("domain: {long}\ndescriptors: []\n"),
        1,
        "domain",
        "at most 1024 are accepted",
    );
    let longest = "d".repeat(crate::config::MAX_DOMAIN_BYTES);
    load(&format!("domain: {longest}\ndescriptors: []\n")).expect("1 KiB is fine");
}

#[test]
fn a_leased_resource_whose_consumers_share_its_tag_is_warned_of_with_its_line() {
    let leased = |own: &str| {
        format!(
            "domain: d\ndescriptors:\n  - key: r\n    value: x\n    leased: {{}}\n{own}    \
             rate_limit: {{unit: minute, requests_per_unit: 100, applies_to_descendants: true}}\n    \
             descriptors:\n      - key: c\n        rate_limit: {{unit: day, requests_per_unit: 5}}\n"
        )
    };
    let shared = load(&leased("")).unwrap().layout_warnings();
    assert_eq!(shared.len(), 1, "{shared:?}");
    assert!(
        shared[0].contains(":3: d.r_x: a leased resource") && shared[0].contains("own_hash_tags"),
        "{}",
        shared[0]
    );
    let own = load(&leased("    own_hash_tags: true\n"))
        .unwrap()
        .layout_warnings();
    assert!(own.is_empty(), "{own:?}");
    let plain = load(&leased("").replace("    leased: {}\n", ""))
        .unwrap()
        .layout_warnings();
    assert!(plain.is_empty(), "no lease, no warning: {plain:?}");
}
