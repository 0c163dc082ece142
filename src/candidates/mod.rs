//! Candidate limits (`CANDIDATE_CONFIG`): a second config, in the same YAML, decided beside the
//! enforced one on every request it matches and never changing an answer. The service plans
//! its checks with the enforced ones and the store decides them in the same call, as a request
//! of their own (`store::Admission`, `store::charged`); this module keeps what they would have
//! done, per candidate limit: would-admit and would-deny counts, the requests they would deny
//! that the enforced config admitted (and the reverse), and the consumers they would stop most
//! (a bounded sketch). Served by the admin API (`Candidates`), `/metrics` and the dashboard.
//!
//! Bounded: at most [`MAX_CANDIDATE_LIMITS`] limits are tracked (a config is finite; the bound
//! holds whatever it holds), each with a sketch of [`sketch::CAPACITY`] consumers. A new
//! candidate config starts the counts over: they always describe the candidate in force.

pub mod sketch;

use crate::config::{Limit, RuleSet};
use sketch::{Sketch, Stopped};
use std::collections::HashMap;
use std::fmt::Write;
use std::hash::{BuildHasher, Hash};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

/// Candidate limits tracked at most; the decisions of any beyond are counted as `overflow`.
pub const MAX_CANDIDATE_LIMITS: usize = 1024;

/// One candidate limit as a request met it.
#[derive(Debug, Clone, Copy)]
pub struct Seen<'a> {
    pub domain: &'a str,
    /// The descriptor key the limit matched (its stat key: config keys, never request values
    /// unless the config names them).
    pub key: &'a str,
    /// The limit's `name` (empty when unnamed).
    pub name: &'a str,
    pub limit: &'a Limit,
    /// The entries keying its counter: the consumer, as the sketch reports it.
    pub entries: &'a [(String, String)],
    pub hits: u64,
    /// It alone would have admitted the request.
    pub allowed: bool,
}

/// A candidate limit's identity in the counts.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct LimitId {
    domain: String,
    key: String,
    name: String,
    limit: Limit,
}

impl LimitId {
    fn matches(&self, s: &Seen<'_>) -> bool {
        self.domain == s.domain
            && self.key == s.key
            && self.name == s.name
            && self.limit == *s.limit
    }
}

#[derive(Debug, Default)]
struct Tally {
    admit: AtomicU64,
    deny: AtomicU64,
    /// Would deny; the enforced config admitted the request.
    deny_admitted: AtomicU64,
    /// Would admit; the enforced config denied the request.
    admit_denied: AtomicU64,
    top: Mutex<Sketch>,
}

/// What one candidate limit would have done, as the admin API and `sluice admin candidates`
/// report it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LimitReport {
    pub domain: String,
    pub key: String,
    pub name: String,
    /// `requests_per_unit/period algorithm`.
    pub limit: String,
    pub would_admit: u64,
    pub would_deny: u64,
    pub denied_where_admitted: u64,
    pub admitted_where_denied: u64,
    /// The consumers it would stop most, largest first.
    pub top: Vec<Stopped>,
}

/// Tallies by a hash of (domain, stat key, name, limit); a bucket holds the few that collide.
type TallyMap = HashMap<u64, Vec<(LimitId, Arc<Tally>)>>;

/// The candidate config in force and its counts.
#[derive(Debug, Default)]
pub struct Candidates {
    rules: RwLock<Option<Arc<RuleSet>>>,
    tallies: RwLock<TallyMap>,
    hasher: std::collections::hash_map::RandomState,
    tracked: AtomicU64,
    overflow: AtomicU64,
    lost: AtomicU64,
    budget: AtomicU64,
    /// Candidate configs put in force, and reloads refused (the previous one kept).
    loads: [AtomicU64; 2],
    /// Unix seconds the counts started (the candidate config's load).
    since: AtomicU64,
}

impl Candidates {
    /// The candidate rules in force, if any.
    pub fn rules(&self) -> Option<Arc<RuleSet>> {
        self.rules
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// A new candidate config: the counts start over. Its `detailed_metric` and
    /// `value_to_metric` are turned off: a candidate's tally and series are named by the config
    /// alone, never by values a caller sends (which would make their number the caller's).
    pub fn replace(&self, mut rules: RuleSet, now_s: u64) {
        for d in rules.domains.values_mut() {
            no_values_in_names(&mut d.root);
        }
        let mut tallies = self.tallies.write().unwrap_or_else(PoisonError::into_inner);
        tallies.clear();
        self.tracked.store(0, Ordering::Relaxed);
        self.overflow.store(0, Ordering::Relaxed);
        self.lost.store(0, Ordering::Relaxed);
        self.budget.store(0, Ordering::Relaxed);
        self.since.store(now_s, Ordering::Relaxed);
        self.loads[0].fetch_add(1, Ordering::Relaxed);
        *self.rules.write().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(rules));
    }

    /// Unix seconds the counts started.
    pub fn since(&self) -> u64 {
        self.since.load(Ordering::Relaxed)
    }

    /// Requests whose candidate checks the store could not decide (their own call failed).
    pub fn lost(&self) -> u64 {
        self.lost.load(Ordering::Relaxed)
    }

    /// Decisions of candidate limits past [`MAX_CANDIDATE_LIMITS`], not counted per limit.
    pub fn overflow(&self) -> u64 {
        self.overflow.load(Ordering::Relaxed)
    }

    /// Candidate limits a request matched past the per-request budget (not decided).
    pub fn record_over_budget(&self, n: usize) {
        self.budget.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Candidate limits not decided for want of the per-request budget.
    pub fn over_budget(&self) -> u64 {
        self.budget.load(Ordering::Relaxed)
    }

    /// A candidate config reload was refused: the one in force stays, its counts go on.
    pub fn record_failed_load(&self) {
        self.loads[1].fetch_add(1, Ordering::Relaxed);
    }

    /// A request's candidate checks were not decided.
    pub fn record_lost(&self) {
        self.lost.fetch_add(1, Ordering::Relaxed);
    }

    /// One request's candidate limits as decided, and whether the enforced config admitted it.
    pub fn record(&self, seen: &[Seen<'_>], enforced_admitted: bool) {
        for s in seen {
            let Some(t) = self.tally(s) else {
                self.overflow.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            if s.allowed {
                t.admit.fetch_add(1, Ordering::Relaxed);
                if !enforced_admitted {
                    t.admit_denied.fetch_add(1, Ordering::Relaxed);
                }
                continue;
            }
            t.deny.fetch_add(1, Ordering::Relaxed);
            if enforced_admitted {
                t.deny_admitted.fetch_add(1, Ordering::Relaxed);
            }
            let consumer = consumer(s.entries);
            t.top
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .add(&consumer, s.hits.max(1));
        }
    }

    fn tally(&self, s: &Seen<'_>) -> Option<Arc<Tally>> {
        let h = self.hasher.hash_one((s.domain, s.key, s.name, s.limit));
        let found = |m: &TallyMap| {
            m.get(&h)
                .and_then(|v| v.iter().find(|(id, _)| id.matches(s)))
                .map(|(_, t)| Arc::clone(t))
        };
        if let Some(t) = found(&self.tallies.read().unwrap_or_else(PoisonError::into_inner)) {
            return Some(t);
        }
        if self.tracked.load(Ordering::Relaxed) >= MAX_CANDIDATE_LIMITS as u64 {
            return None;
        }
        let mut m = self.tallies.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(t) = found(&m) {
            return Some(t);
        }
        if self.tracked.load(Ordering::Relaxed) >= MAX_CANDIDATE_LIMITS as u64 {
            return None;
        }
        self.tracked.fetch_add(1, Ordering::Relaxed);
        let id = LimitId {
            domain: s.domain.to_string(),
            key: s.key.to_string(),
            name: s.name.to_string(),
            limit: *s.limit,
        };
        let t = Arc::new(Tally::default());
        m.entry(h).or_default().push((id, Arc::clone(&t)));
        Some(t)
    }

    /// Every tracked limit of `domain` (every domain when empty), with its `top` consumers,
    /// in a stable order (key, name, limit).
    pub fn report(&self, domain: &str, top: usize) -> Vec<LimitReport> {
        let m = self.tallies.read().unwrap_or_else(PoisonError::into_inner);
        let mut out: Vec<LimitReport> = m
            .values()
            .flatten()
            .filter(|(id, _)| domain.is_empty() || id.domain == domain)
            .map(|(id, t)| LimitReport {
                domain: id.domain.clone(),
                key: id.key.clone(),
                name: id.name.clone(),
                limit: describe(&id.limit),
                would_admit: t.admit.load(Ordering::Relaxed),
                would_deny: t.deny.load(Ordering::Relaxed),
                denied_where_admitted: t.deny_admitted.load(Ordering::Relaxed),
                admitted_where_denied: t.admit_denied.load(Ordering::Relaxed),
                top: t
                    .top
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .top(top),
            })
            .collect();
        out.sort_by(|a, b| {
            (&a.domain, &a.key, &a.name, &a.limit).cmp(&(&b.domain, &b.key, &b.name, &b.limit))
        });
        out
    }

    /// The Prometheus series (text exposition), appended to `/metrics`: per tracked limit,
    /// decisions by verdict and disagreements by kind, so cardinality is bounded by
    /// [`MAX_CANDIDATE_LIMITS`].
    pub fn render_metrics(&self, out: &mut String) {
        let all = self.report("", 0);
        out.push_str(
            "# HELP sluice_candidate_decisions_total Requests a candidate limit \
             (CANDIDATE_CONFIG) matched, by what it alone would have answered.\n\
             # TYPE sluice_candidate_decisions_total counter\n",
        );
        for r in &all {
            for (verdict, n) in [("admit", r.would_admit), ("deny", r.would_deny)] {
                let _ = writeln!(
                    out,
                    "sluice_candidate_decisions_total{{{},verdict=\"{verdict}\"}} {n}",
                    labels(r)
                );
            }
        }
        out.push_str(
            "# HELP sluice_candidate_disagreements_total Requests a candidate limit would have \
             answered otherwise than the enforced config: deny_admitted (it would deny, the \
             enforced config admitted), admit_denied (it would admit, the enforced config \
             denied).\n# TYPE sluice_candidate_disagreements_total counter\n",
        );
        for r in &all {
            for (kind, n) in [
                ("deny_admitted", r.denied_where_admitted),
                ("admit_denied", r.admitted_where_denied),
            ] {
                let _ = writeln!(
                    out,
                    "sluice_candidate_disagreements_total{{{},kind=\"{kind}\"}} {n}",
                    labels(r)
                );
            }
        }
        let _ = write!(
            out,
            "# HELP sluice_candidate_untracked_total Candidate decisions not counted per limit: \
             lost (their store call failed or did not answer in time), overflow (past {MAX_CANDIDATE_LIMITS} limits), \
             budget (a request's candidate limits past the per-request budget).\n\
             # TYPE sluice_candidate_untracked_total counter\n\
             sluice_candidate_untracked_total{{reason=\"lost\"}} {}\n\
             sluice_candidate_untracked_total{{reason=\"overflow\"}} {}\n\
             sluice_candidate_untracked_total{{reason=\"budget\"}} {}\n",
            self.lost(),
            self.overflow(),
            self.over_budget()
        );
        let _ = write!(
            out,
            "# HELP sluice_candidate_config_loads_total Candidate configs (CANDIDATE_CONFIG) put \
             in force (success; their counts start over) and reloads refused (failure; the \
             candidates in force stay).\n\
             # TYPE sluice_candidate_config_loads_total counter\n\
             sluice_candidate_config_loads_total{{result=\"success\"}} {}\n\
             sluice_candidate_config_loads_total{{result=\"failure\"}} {}\n",
            self.loads[0].load(Ordering::Relaxed),
            self.loads[1].load(Ordering::Relaxed)
        );
    }
}

/// A limit as the reports write it: `50/minute`, `10/30s token_bucket`.
pub fn describe(l: &Limit) -> String {
    let period = l.period.to_string().to_ascii_lowercase();
    match l.algorithm {
        crate::config::Algorithm::FixedWindow => format!("{}/{period}", l.requests_per_unit),
        // Two buckets of one rate differ by their burst alone: so do their labels.
        a @ crate::config::Algorithm::TokenBucket => {
            format!(
                "{}/{period} {} burst {}",
                l.requests_per_unit,
                a.name(),
                l.burst
            )
        }
        a => format!("{}/{period} {}", l.requests_per_unit, a.name()),
    }
}

/// The consumer a counter stands for: its entries, `key=value, key=value`.
fn consumer(entries: &[(String, String)]) -> String {
    let mut s = String::new();
    for (i, (k, v)) in entries.iter().enumerate() {
        // The sketch keeps 256 bytes of it: no more is built.
        if s.len() > sketch::MAX_CONSUMER_BYTES {
            break;
        }
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "{k}={v}");
    }
    s
}

fn labels(r: &LimitReport) -> String {
    format!(
        "domain=\"{}\",key=\"{}\",name=\"{}\",limit=\"{}\"",
        escape(&r.domain),
        escape(&r.key),
        escape(&r.name),
        escape(&r.limit)
    )
}

/// A label value in the text exposition: backslash, quote and newline escaped.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests;

/// Turns off `detailed_metric` and `value_to_metric` on every node of `level` and below.
fn no_values_in_names(level: &mut crate::config::Level) {
    let nodes = level.exact.values_mut().flat_map(|m| m.values_mut());
    for n in nodes
        .chain(level.wildcards.iter_mut())
        .chain(level.bare.values_mut())
    {
        n.detailed_metric = false;
        n.value_to_metric = false;
        no_values_in_names(&mut n.children);
    }
}
