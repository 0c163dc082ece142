//! What a replay found, per config: requests admitted and denied beside what the log says was
//! answered then, per limit (the descriptors it decided) and per consumer (a descriptor's
//! entries) under it, and over time (for the picture). Plain data: serialised as the JSON of
//! `sluice replay --json`, drawn by `render.rs`.

use crate::decision_log::line::Line;
use crate::proto::rate_limit_response::rate_limit::Unit;
use crate::proto::rate_limit_response::Code;
use crate::proto::RateLimitResponse;
use serde::Serialize;
use std::collections::HashMap;

/// Time buckets of the timeline (the picture's bars).
pub const BUCKETS: usize = 96;

/// Requests (or descriptors) admitted and denied.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Totals {
    pub admitted: u64,
    pub denied: u64,
}

/// One replayed config.
#[derive(Debug, Clone, Serialize)]
pub struct ConfigReport {
    pub config: String,
    /// Requests as replayed.
    pub requests: Totals,
    /// Requests as the log says they were answered (lines answered by `FAILURE_MODE` left out
    /// of every comparison).
    pub logged: Totals,
    /// Admitted then, denied now.
    pub newly_denied: u64,
    /// Denied then, admitted now.
    pub newly_admitted: u64,
    /// Lines the replay refused as invalid requests.
    pub invalid: u64,
    /// Lines answered by `FAILURE_MODE` then (the store down): replayed, never compared.
    pub fallback: u64,
    /// Per limit, the most denying first.
    pub limits: Vec<LimitReport>,
    /// When the timeline starts and each bucket's length (Unix µs).
    pub start_us: u64,
    pub bucket_us: u64,
    /// Per time bucket: requests admitted and denied as replayed, and denied as logged.
    pub timeline: Vec<(u64, u64, u64)>,
}

/// One limit of the config, as the replay's answers named it.
#[derive(Debug, Clone, Serialize)]
pub struct LimitReport {
    /// Its `name:`, else its domain, descriptor keys and rate.
    pub limit: String,
    /// Descriptors it decided: admitted and denied as replayed.
    pub descriptors: Totals,
    /// Of those, denied as logged (under whatever limit was in force then).
    pub logged_denied: u64,
    /// Denied now, admitted then.
    pub newly_denied: u64,
    /// The consumers it would stop most, most denied first.
    pub top: Vec<Consumer>,
}

/// A consumer under a limit: a descriptor's entries, as JSON (`[["user","alice"]]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Consumer {
    pub consumer: String,
    pub denied: u64,
    pub logged_denied: u64,
    pub requests: u64,
}

/// A whole replay: every config against the same log.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub lines: u64,
    pub first_us: u64,
    pub last_us: u64,
    pub configs: Vec<ConfigReport>,
}

impl ConfigReport {
    /// Nothing replayed yet; a timeline of [`BUCKETS`] from `start_us`.
    pub fn empty(config: &str, start_us: u64, bucket_us: u64) -> Self {
        Self {
            config: config.to_string(),
            requests: Totals::default(),
            logged: Totals::default(),
            newly_denied: 0,
            newly_admitted: 0,
            invalid: 0,
            fallback: 0,
            limits: Vec::new(),
            start_us,
            bucket_us,
            timeline: vec![(0, 0, 0); BUCKETS],
        }
    }
}

#[derive(Default)]
struct LimitTally {
    descriptors: Totals,
    logged_denied: u64,
    newly_denied: u64,
    consumers: HashMap<String, Consumer>,
}

pub(super) struct Builder {
    out: ConfigReport,
    limits: HashMap<String, LimitTally>,
    top: usize,
}

impl Builder {
    pub fn new(name: &str, lines: &[Line], top: usize) -> Self {
        let start_us = lines.iter().map(|l| l.t).min().unwrap_or(0);
        let end_us = lines.iter().map(|l| l.t).max().unwrap_or(0);
        let bucket_us = (end_us.saturating_sub(start_us) / BUCKETS as u64).saturating_add(1);
        Self {
            out: ConfigReport::empty(name, start_us, bucket_us),
            limits: HashMap::new(),
            top,
        }
    }

    pub fn invalid(&mut self) {
        self.out.invalid += 1;
    }

    pub fn add(&mut self, line: &Line, response: &RateLimitResponse) {
        let ok = response.overall_code != Code::OverLimit as i32;
        count(&mut self.out.requests, ok);
        let bucket = usize::try_from(line.t.saturating_sub(self.out.start_us) / self.out.bucket_us)
            .unwrap_or(BUCKETS - 1)
            .min(BUCKETS - 1);
        let b = &mut self.out.timeline[bucket];
        if ok {
            b.0 += 1;
        } else {
            b.1 += 1;
        }
        if line.fallback {
            self.out.fallback += 1;
        } else {
            count(&mut self.out.logged, line.ok);
            b.2 += u64::from(!line.ok);
            match (line.ok, ok) {
                (true, false) => self.out.newly_denied += 1,
                (false, true) => self.out.newly_admitted += 1,
                _ => {}
            }
        }
        for (status, d) in response.statuses.iter().zip(&line.descriptors) {
            let Some(limit) = &status.current_limit else {
                continue;
            };
            let name = if limit.name.is_empty() {
                let keys: Vec<&str> = d.entries.iter().map(|(k, _)| k.as_str()).collect();
                let unit = Unit::try_from(limit.unit).map_or("UNKNOWN", |u| u.as_str_name());
                format!(
                    "{} {} {}/{}",
                    line.domain,
                    keys.join("."),
                    limit.requests_per_unit,
                    unit.to_ascii_lowercase()
                )
            } else {
                limit.name.clone()
            };
            let over = status.code == Code::OverLimit as i32;
            let logged_over = d.over && !line.fallback;
            let t = self.limits.entry(name).or_default();
            count(&mut t.descriptors, !over);
            t.logged_denied += u64::from(logged_over);
            t.newly_denied += u64::from(over && !logged_over && !line.fallback);
            // The entries as JSON (no value can pass for two entries), with no control or
            // direction character left to act on the operator's terminal.
            let consumer = printable(&serde_json::to_string(&d.entries).unwrap_or_default());
            let c = t
                .consumers
                .entry(consumer)
                .or_insert_with_key(|k| Consumer {
                    consumer: k.clone(),
                    denied: 0,
                    logged_denied: 0,
                    requests: 0,
                });
            c.requests += 1;
            c.denied += u64::from(over);
            c.logged_denied += u64::from(logged_over);
        }
    }

    pub fn finish(mut self) -> ConfigReport {
        let top = self.top;
        let mut limits: Vec<LimitReport> = self
            .limits
            .drain()
            .map(|(limit, t)| {
                let mut all: Vec<Consumer> =
                    t.consumers.into_values().filter(|c| c.denied > 0).collect();
                all.sort_by(|a, b| b.denied.cmp(&a.denied).then(a.consumer.cmp(&b.consumer)));
                all.truncate(top);
                LimitReport {
                    limit,
                    descriptors: t.descriptors,
                    logged_denied: t.logged_denied,
                    newly_denied: t.newly_denied,
                    top: all,
                }
            })
            .collect();
        limits.sort_by(|a, b| {
            b.descriptors
                .denied
                .cmp(&a.descriptors.denied)
                .then(a.limit.cmp(&b.limit))
        });
        self.out.limits = limits;
        self.out
    }
}

/// `s` with every control character (C0, DEL, C1) and every bidirectional formatting
/// character written as `\u{…}`.
pub(super) fn printable(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        let bidi = matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if c.is_control() || bidi {
            out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    out
}

fn count(t: &mut Totals, ok: bool) {
    if ok {
        t.admitted += 1;
    } else {
        t.denied += 1;
    }
}
