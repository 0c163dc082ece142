//! The rate-limit rule model: envoyproxy/ratelimit's YAML, parsed once into an immutable
//! [`RuleSet`] that requests read through an `Arc` snapshot. Everything a request needs is
//! decided at load time (units, wildcard patterns, replaces), so a bad rule fails at load with its
//! file and line instead of at request time.

mod load;
mod yaml;

#[cfg(test)]
mod tests;

pub use load::{load_path, load_sources, ConfigError, ConfigErrors, LoadOptions};

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

/// A time unit of envoyproxy/ratelimit (`month` is 30 days, `year` 365 days, as there).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    Month,
    Year,
}

impl Unit {
    pub const ALL: [Unit; 7] = [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Week,
        Unit::Month,
        Unit::Year,
    ];

    /// Case-insensitive parse of a config unit name.
    pub fn parse(s: &str) -> Option<Unit> {
        Unit::ALL
            .into_iter()
            .find(|u| u.name().eq_ignore_ascii_case(s))
    }

    pub fn name(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }

    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        }
    }
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name().to_ascii_uppercase())
    }
}

/// Where a rule was written: used in load errors and in `/rlconfig`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub file: Arc<str>,
    /// 1-based line.
    pub line: usize,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file, self.line)
    }
}

/// How much a limit admits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quota {
    /// `unlimited: true`: never counted, always OK.
    Unlimited,
    /// `requests_per_unit` per `unit`; 0 blocks everything.
    Limited { requests_per_unit: u32, unit: Unit },
}

/// A `rate_limit` block together with the descriptor-level flags that modify it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimitRule {
    pub name: Option<String>,
    pub quota: Quota,
    /// Names of limits this one replaces when both match one request.
    pub replaces: Vec<String>,
    pub shadow_mode: bool,
    /// `quota_mode` is accepted for compatibility; it does not act yet.
    pub quota_mode: bool,
}

/// How a config node's `value` matches a request entry's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueMatch {
    /// `value: foo`
    Exact(String),
    /// `value: foo*bar*`: `*` matches any run of characters.
    Wildcard(String),
    /// No `value` (or empty): any value; counted per runtime value.
    Any,
}

/// One entry of a `descriptors` list.
#[derive(Debug, Clone)]
pub struct DescriptorNode {
    pub key: String,
    pub value: ValueMatch,
    pub rate_limit: Option<RateLimitRule>,
    /// With a wildcard value: all matching values share one counter.
    pub share_threshold: bool,
    pub detailed_metric: bool,
    pub value_to_metric: bool,
    /// `metadata` is accepted for compatibility; it does not act yet.
    pub children: Level,
    pub location: Location,
    /// Dotted path for stats and `/rlconfig`, e.g. `domain.key_value.key2`.
    pub path: String,
}

/// The nodes of one `descriptors` list, indexed for the per-level lookup order: exact key+value,
/// then wildcards in file order, then the bare key.
#[derive(Debug, Clone, Default)]
pub struct Level {
    pub exact: HashMap<String, HashMap<String, DescriptorNode>>,
    pub wildcards: Vec<DescriptorNode>,
    pub bare: HashMap<String, DescriptorNode>,
}

impl Level {
    pub fn is_empty(&self) -> bool {
        self.exact.is_empty() && self.wildcards.is_empty() && self.bare.is_empty()
    }

    /// Every node of this level (exact, wildcard, bare), in no particular order.
    pub fn nodes(&self) -> impl Iterator<Item = &DescriptorNode> {
        self.exact
            .values()
            .flat_map(|m| m.values())
            .chain(self.wildcards.iter())
            .chain(self.bare.values())
    }
}

/// All rules of one domain (one file).
#[derive(Debug, Clone)]
pub struct DomainRules {
    pub domain: String,
    pub file: Arc<str>,
    pub root: Level,
}

/// The loaded, validated configuration: one immutable snapshot.
#[derive(Debug, Clone)]
pub struct RuleSet {
    pub domains: HashMap<String, DomainRules>,
    pub loaded_at: SystemTime,
    pub sources: Vec<PathBuf>,
}

impl RuleSet {
    pub fn empty() -> Self {
        Self {
            domains: HashMap::new(),
            loaded_at: SystemTime::now(),
            sources: Vec::new(),
        }
    }

    /// Number of rate limits (nodes carrying a `rate_limit`) per domain, for logs.
    pub fn rule_counts(&self) -> Vec<(String, usize)> {
        fn count(level: &Level) -> usize {
            level
                .nodes()
                .map(|n| usize::from(n.rate_limit.is_some()) + count(&n.children))
                .sum()
        }
        let mut v: Vec<_> = self
            .domains
            .values()
            .map(|d| (d.domain.clone(), count(&d.root)))
            .collect();
        v.sort();
        v
    }

    /// Human-readable dump of every limit, one line per node with a limit, sorted; served by
    /// `GET /rlconfig` in the envoyproxy/ratelimit format (`path: unit=.. requests_per_unit=..`).
    pub fn dump(&self) -> String {
        fn walk(level: &Level, out: &mut Vec<String>) {
            for n in level.nodes() {
                if let Some(rl) = &n.rate_limit {
                    let quota = match rl.quota {
                        Quota::Unlimited => "unlimited=true".to_string(),
                        Quota::Limited {
                            requests_per_unit,
                            unit,
                        } => format!("unit={unit} requests_per_unit={requests_per_unit}"),
                    };
                    let name = rl
                        .name
                        .as_deref()
                        .map(|n| format!(", name: {n}"))
                        .unwrap_or_default();
                    out.push(format!(
                        "{}: {quota}, shadow_mode: {}{name}",
                        n.path, rl.shadow_mode
                    ));
                }
                walk(&n.children, out);
            }
        }
        let mut lines = Vec::new();
        for d in self.domains.values() {
            walk(&d.root, &mut lines);
        }
        lines.sort();
        let mut s = lines.join("\n");
        s.push('\n');
        s
    }
}
