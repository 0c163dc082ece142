use super::*;
use crate::config::Unit;
use crate::store::{charged, Admission, LimitCheck};

fn seen<'a>(limit: &'a Limit, entries: &'a [(String, String)], allowed: bool) -> Seen<'a> {
    Seen {
        domain: "d",
        key: "tenant",
        name: "n\"ew",
        limit,
        entries,
        hits: 1,
        allowed,
    }
}

fn entries(v: &str) -> Vec<(String, String)> {
    vec![("tenant".to_string(), v.to_string())]
}

#[test]
fn counts_disagreements_and_stopped_consumers_per_limit() {
    let c = Candidates::default();
    c.replace(RuleSet::empty(), 7);
    let l = Limit::fixed(50, Unit::Minute);
    let (a, b) = (entries("a"), entries("b"));
    c.record(&[seen(&l, &a, true)], true);
    c.record(&[seen(&l, &a, false)], true);
    c.record(&[seen(&l, &a, false)], false);
    c.record(&[seen(&l, &b, true)], false);
    c.record(&[seen(&l, &b, false)], true);
    let r = c.report("d", 10);
    assert_eq!(r.len(), 1);
    let r = &r[0];
    assert_eq!(
        (r.would_admit, r.would_deny),
        (2, 3),
        "per request it matched"
    );
    assert_eq!((r.denied_where_admitted, r.admitted_where_denied), (2, 1));
    assert_eq!(r.limit, "50/minute");
    let top: Vec<(&str, u64)> = r
        .top
        .iter()
        .map(|s| (s.consumer.as_str(), s.denied))
        .collect();
    assert_eq!(top, [("tenant=a", 2), ("tenant=b", 1)]);
    assert!(c.report("other", 10).is_empty());
    assert_eq!(c.since(), 7);
    // Labels are escaped; every series is there.
    let mut m = String::new();
    c.render_metrics(&mut m);
    assert!(
        m.contains(
            "sluice_candidate_decisions_total{domain=\"d\",key=\"tenant\",name=\"n\\\"ew\",\
             limit=\"50/minute\",verdict=\"deny\"} 3"
        ),
        "{m}"
    );
    assert!(m.contains("kind=\"admit_denied\"} 1"), "{m}");
    // A new candidate config starts the counts over.
    c.replace(RuleSet::empty(), 9);
    assert!(c.report("", 10).is_empty());
}

#[test]
fn limits_tracked_are_bounded() {
    let c = Candidates::default();
    let e = entries("a");
    let limits: Vec<Limit> = (0..MAX_CANDIDATE_LIMITS as u32 + 5)
        .map(|n| Limit::fixed(n, Unit::Hour))
        .collect();
    for l in &limits {
        c.record(&[seen(l, &e, false)], true);
    }
    assert_eq!(c.report("", 1).len(), MAX_CANDIDATE_LIMITS);
    assert_eq!(c.overflow(), 5);
}

fn check(value: &str, candidate: bool) -> LimitCheck {
    let mut c = LimitCheck::for_tests("d", value, Limit::fixed(5, Unit::Minute), 1);
    c.candidate = candidate;
    c.key.candidate = candidate;
    c
}

#[test]
fn candidates_are_admitted_and_charged_as_a_request_of_their_own() {
    let checks = [check("a", false), check("b", true), check("c", true)];
    // The enforced check denies: the candidates, both allowing, are still charged.
    let allowed = [false, true, true];
    let mut a = Admission::default();
    for (c, &ok) in checks.iter().zip(&allowed) {
        a.add(c, ok);
    }
    assert!(!a.admitted());
    assert_eq!(charged(&checks, &allowed, false), [false, true, true]);
    // One candidate denies: no candidate is charged; the enforced answer does not move.
    let allowed = [true, true, false];
    let mut a = Admission::default();
    for (c, &ok) in checks.iter().zip(&allowed) {
        a.add(c, ok);
    }
    assert!(a.admitted(), "a candidate never denies the request");
    assert!(!Admission::candidates(&checks, &allowed).admitted());
    assert_eq!(charged(&checks, &allowed, true), [true, false, false]);
}
