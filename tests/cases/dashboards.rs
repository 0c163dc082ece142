//! The chart's Grafana dashboard and alert rules (`helm/sluice/files/`) against a live sluice:
//! every PromQL expression parses (with the `promql-parser` crate, Prometheus's grammar), and
//! every metric it names is a series of a real `/metrics` scrape taken after a run of decisions
//! that moves every per-descriptor counter. A renamed metric or a typo fails here, not on an
//! operator's empty panel. (`scripts/check_helm.py` checks that the chart ships these files.)

use crate::support::*;
use promql_parser::parser::{self, Expr};
use promql_parser::util::{walk_expr, ExprVisitor};
use sluice::clock::ManualClock;
use sluice::proto::rate_limit_response::Code;
use sluice::service::ServiceOptions;
use sluice::store::fake::FakeStore;
use sluice::store::fallback::{LocalFallback, LocalSettings};
use sluice::store::local_cache::LocalDenyCache;
use sluice::store::{StoreSignals, StoreStack};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

const CONFIG: &str = r#"
domain: dash
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: shadowed
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: slot
    in_flight: {max: 1, lease: 5s, id_key: rid, done_key: rdone}
  - key: budget
    rate_limit: {unit: minute, requests_per_unit: 100}
    reservations: {lease: 5m, id_key: rid, done_key: rdone}
"#;

fn chart_file(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("helm/sluice/files")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every `expr` string of the dashboard JSON (panel targets, at any depth), plus the metric of
/// each `label_values(<metric>, <label>)` variable query.
fn dashboard_exprs(json: &serde_json::Value, out: &mut Vec<String>) {
    match json {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                    ("definition", serde_json::Value::String(q)) => {
                        let inner = q
                            .strip_prefix("label_values(")
                            .and_then(|r| r.split(',').next())
                            .unwrap_or_else(|| panic!("unexpected variable query {q}"));
                        out.push(inner.trim().to_string());
                    }
                    _ => dashboard_exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| dashboard_exprs(v, out)),
        _ => {}
    }
}

/// Every `expr` of the alert rules file.
fn rule_exprs(yaml: &str) -> Vec<String> {
    let docs = yaml_rust2::YamlLoader::load_from_str(yaml).expect("rules YAML");
    let mut out = Vec::new();
    for group in docs[0]["groups"].as_vec().expect("groups") {
        assert!(group["name"].as_str().is_some(), "a group without a name");
        for rule in group["rules"].as_vec().expect("rules") {
            assert!(rule["alert"].as_str().is_some(), "an alert without a name");
            out.push(rule["expr"].as_str().expect("expr").to_string());
        }
    }
    out
}

/// Grafana's variables, replaced as Grafana would before the query reaches Prometheus.
fn as_grafana_sends(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$__range", "1h")
        .replace("$domain", ".*")
}

struct Names(BTreeSet<String>);

impl ExprVisitor for Names {
    type Error = ();
    fn pre_visit(&mut self, e: &Expr) -> Result<bool, ()> {
        let selector = match e {
            Expr::VectorSelector(vs) => Some(vs),
            Expr::MatrixSelector(ms) => Some(&ms.vs),
            _ => None,
        };
        if let Some(name) = selector.and_then(|vs| vs.name.clone()) {
            self.0.insert(name);
        }
        Ok(true)
    }
}

/// Parses `expr` and returns the metric names it selects.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let ast = parser::parse(&as_grafana_sends(expr))
        .unwrap_or_else(|e| panic!("not valid PromQL: {expr}\n{e}"));
    let mut names = Names(BTreeSet::new());
    walk_expr(&mut names, &ast).expect("walk");
    names.0
}

/// The series names of a text-format scrape (histograms as `_bucket`, `_sum`, `_count`).
fn scraped_names(body: &str) -> BTreeSet<String> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

#[tokio::test]
async fn every_dashboard_and_alert_query_parses_and_names_live_series() {
    let dashboard: serde_json::Value =
        serde_json::from_str(&chart_file("grafana-dashboard.json")).expect("dashboard JSON");
    let mut exprs = Vec::new();
    dashboard_exprs(&dashboard, &mut exprs);
    let dashboard_count = exprs.len();
    exprs.extend(rule_exprs(&chart_file("prometheus-rules.yaml")));
    assert!(
        dashboard_count >= 20 && exprs.len() >= dashboard_count + 8,
        "{dashboard_count} dashboard and {} rule expressions",
        exprs.len() - dashboard_count
    );

    // A run of decisions that moves every counter: within, near, over (the store, then the
    // deny cache), shadow-mode would-denials.
    // FAILURE_MODE=local's layer on top, over a store the test can fail, so its series move.
    let clock = ManualClock::new(T0);
    let fake = Arc::new(FakeStore::new(Arc::new(clock.clone())));
    let cache = Arc::new(LocalDenyCache::new(
        Arc::clone(&fake),
        1 << 20,
        Arc::new(clock.clone()),
        sluice::store::DenialFinality::Always,
    ));
    let signals = StoreSignals::new("test");
    let local = Arc::new(LocalFallback::new(
        cache,
        None,
        LocalSettings::default(),
        Arc::new(clock.clone()),
        &signals,
    ));
    let stack = StoreStack::new(local.clone(), signals).with_decider(local);
    let options = ServiceOptions {
        failure_mode: Some(sluice::service::FailureMode::Local),
        ..ServiceOptions::default()
    };
    let s = TestServer::start_stack(CONFIG, options, stack, clock.clone()).await;
    // A candidate limit on the tenant (CANDIDATE_CONFIG), so its series exist.
    if let Some(r) = s.running.as_ref() {
        r.limiter().replace_candidates(crate::support::rules(
            "domain: dash\ndescriptors:\n  - key: tenant\n    rate_limit: {name: c, unit: minute, requests_per_unit: 3}\n",
        ));
    }
    let tenant = one("dash", &[("tenant", "acme")]);
    let codes: Vec<Code> = {
        let mut v = Vec::new();
        for _ in 0..7 {
            v.push(code(&s.call(tenant.clone()).await));
        }
        v
    };
    assert_eq!(codes.iter().filter(|c| **c == Code::OverLimit).count(), 2);
    for _ in 0..2 {
        assert_eq!(
            code(&s.call(one("dash", &[("shadowed", "x")])).await),
            Code::Ok
        );
    }
    // An in_flight slot taken, a second take denied, the slot freed: the lease calls' series.
    let slot = |k: &str, id: &str| one("dash", &[("slot", "s"), (k, id)]);
    assert_eq!(code(&s.call(slot("rid", "a")).await), Code::Ok);
    assert_eq!(code(&s.call(slot("rid", "b")).await), Code::OverLimit);
    assert_eq!(code(&s.call(slot("rdone", "a")).await), Code::Ok);
    // The lease gauges and counters: a free of nothing, a slot left to end by its lease and
    // dropped by the next take, a reservation held, a settle of nothing.
    assert_eq!(code(&s.call(slot("rdone", "zz")).await), Code::Ok);
    assert_eq!(code(&s.call(slot("rid", "c")).await), Code::Ok);
    clock.advance(std::time::Duration::from_secs(6));
    assert_eq!(code(&s.call(slot("rid", "d")).await), Code::Ok);
    let budget = |k: &str, id: &str| one("dash", &[("budget", "b"), (k, id)]);
    assert_eq!(code(&s.call(budget("rid", "r1")).await), Code::Ok);
    assert_eq!(code(&s.call(budget("rdone", "zz")).await), Code::Ok);
    // The store fails: decided locally.
    fake.fail_with(Some(sluice::store::StoreError::Transient("down".into())));
    assert_eq!(
        code(&s.call(one("dash", &[("shadowed", "y")])).await),
        Code::Ok
    );
    fake.fail_with(None);
    // An admin write, so the admin API's series exist.
    super::admin::admin(&s)
        .await
        .set_override(sluice::proto::sluice::admin::v1::SetOverrideRequest {
            domain: "dash".into(),
            entries: super::admin::entries(&[("tenant", "globex")]),
            limit: Some(sluice::proto::sluice::admin::v1::set_override_request::Limit::Deny(true)),
            ttl_seconds: 60,
            ..Default::default()
        })
        .await
        .expect("an admin override");
    // An RLQS stream with one bucket, so the quota service's series exist.
    let mut rlqs = crate::cases::quota::Stream::open(&s).await;
    let actions = rlqs
        .report(
            "dash",
            vec![crate::cases::quota::usage(&[("tenant", "q")], 1, 1)],
        )
        .await;
    assert_eq!(actions.len(), 1);
    let (status, body) = http(s.http_addr, "GET", "/metrics", "").await;
    assert_eq!(status, 200, "{body}");
    let live = scraped_names(&body);
    drop(rlqs);
    s.stop().await;

    let mut used = BTreeSet::new();
    for e in &exprs {
        let names = metric_names(e);
        assert!(!names.is_empty(), "selects no metric: {e}");
        used.extend(names);
    }
    let missing: Vec<&String> = used.difference(&live).collect();
    assert!(
        missing.is_empty(),
        "metrics the dashboard or the alerts use but /metrics does not serve: {missing:?}\n\
         served: {live:?}"
    );
    // The dashboard covers what the issue lists: decisions and denials per domain and key,
    // near-limit, shadow mode, decision and store latency, breaker state, config reloads,
    // evictions, top offenders.
    for name in [
        "sluice_rate_limit_total_hits",
        "sluice_rate_limit_over_limit",
        "sluice_rate_limit_over_limit_with_local_cache",
        "sluice_rate_limit_near_limit",
        "sluice_rate_limit_shadow_mode",
        "sluice_request_duration_seconds_bucket",
        "sluice_store_call_duration_seconds_bucket",
        "sluice_circuit_breaker_state",
        "sluice_store_up",
        "sluice_config_loads_total",
        "sluice_memory_evictions_total",
        "sluice_refund_failures_total",
        "sluice_rlqs_streams",
        "sluice_rlqs_buckets",
        "sluice_rlqs_assigned_rate",
        "sluice_rlqs_reported_requests_total",
        "sluice_rlqs_bucket_reports_total",
        "sluice_rlqs_refused_total",
        "sluice_in_flight_slots",
        "sluice_reservations_outstanding",
        "sluice_leases_expired_total",
        "sluice_lease_releases_unmatched_total",
        "sluice_admin_overrides",
        "sluice_admin_writes_total",
        "sluice_admin_counters_reset_total",
        "sluice_admin_refused_total",
        "sluice_candidate_decisions_total",
        "sluice_candidate_disagreements_total",
        "sluice_candidate_untracked_total",
    ] {
        assert!(
            used.contains(name),
            "no dashboard or alert query uses {name}"
        );
    }
    let text = serde_json::to_string(&dashboard).expect("json");
    assert!(text.contains("Top offenders"), "a top offenders panel");
    assert!(text.contains("Rate Limit Quota Service"), "an RLQS row");
    assert!(text.contains("Candidate limits"), "a candidate limits row");
}

/// The checker itself: a bad expression fails to parse, and a made-up metric is reported.
#[test]
fn the_checks_catch_bad_queries() {
    assert!(parser::parse(&as_grafana_sends("sum(rate(x[$__rate_interval])")).is_err());
    let names = metric_names("sum by (le) (rate(sluice_nope_bucket[$__rate_interval])) / up");
    assert_eq!(
        names,
        BTreeSet::from(["sluice_nope_bucket".to_string(), "up".to_string()])
    );
    assert!(
        !scraped_names("# HELP a b\nsluice_x{a=\"1\"} 2\nsluice_y 3\n")
            .contains("sluice_nope_bucket")
    );
}
