//! The rate-limit rule model: envoyproxy/ratelimit's YAML, parsed once into an immutable
//! [`RuleSet`] that requests read through an `Arc` snapshot. Everything a request needs is
//! decided at load time (units, wildcard patterns, replaces), so a bad rule fails at load with its
//! file and line instead of at request time.

pub mod calendar;
mod load;
mod metadata;
mod warnings;
mod xds;
mod yaml;

#[cfg(test)]
mod tests;

pub use load::{
    fingerprint, load_path, load_sources, ConfigError, ConfigErrors, Leasing, LoadOptions,
    MAX_DOMAIN_BYTES, MAX_IN_FLIGHT, MAX_LEASE_ID_BYTES, MAX_SLIDING_LOG_LIMIT,
};
pub use xds::load_xds;

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

/// The decision algorithm of one limit (sluice extension `algorithm`; envoyproxy configs get
/// `FixedWindow`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// Counter per epoch-aligned window (envoyproxy/ratelimit's behaviour).
    #[default]
    FixedWindow,
    /// Two-window weighted counter: O(1) state, approximate.
    SlidingWindow,
    /// Exact log of hit timestamps: O(limit) state.
    SlidingLog,
    /// GCRA (the redis-cell math): one stored value, smooth rate with a burst allowance.
    TokenBucket,
    /// `in_flight`: not a rate but requests holding a slot, `requests_per_unit` slots, each
    /// held until its request's stream-done call frees it or its lease (`period`) ends. Never
    /// written as `algorithm:`; a descriptor's `in_flight` block makes it.
    InFlight,
}

impl Algorithm {
    pub const ALL: [Algorithm; 4] = [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
        Algorithm::TokenBucket,
    ];

    /// Every name an algorithm goes by, in one table: `(config name, code the Lua script
    /// switches on, tag in Redis keys)`. The sliding_log tag is `slw` (one entry per charge);
    /// the per-hit sets of earlier versions were `sl`, so they are never read with the new
    /// layout and expire on their own.
    const fn names(self) -> (&'static str, u8, &'static str) {
        match self {
            Algorithm::FixedWindow => ("fixed_window", 0, "fw"),
            Algorithm::SlidingWindow => ("sliding_window", 1, "sw"),
            Algorithm::SlidingLog => ("sliding_log", 2, "slw"),
            Algorithm::TokenBucket => ("token_bucket", 3, "tb"),
            // Decided by its own branch of the script, not by the algorithm code.
            Algorithm::InFlight => ("in_flight", 0, "if"),
        }
    }

    /// The name the config uses (`algorithm: token_bucket`).
    pub fn name(self) -> &'static str {
        self.names().0
    }

    /// The code the Lua script switches on.
    pub fn code(self) -> u8 {
        self.names().1
    }

    /// The tag in Redis keys, so two algorithms never share a counter.
    pub fn key_tag(self) -> &'static str {
        self.names().2
    }

    pub fn parse(s: &str) -> Option<Algorithm> {
        Algorithm::ALL.into_iter().find(|a| a.name() == s)
    }
}

/// The window of a limit: a whole, positive number of milliseconds, plus the envoyproxy unit it
/// was written as, if any (`unit: minute`), which the response reports as is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Period {
    millis: u64,
    unit: Option<Unit>,
    /// A calendar window (`calendar:`): `unit` aligned to the calendar in a time zone, `millis`
    /// its nominal length (the real window comes from the calendar at each request).
    calendar: Option<calendar::CalendarId>,
}

impl Period {
    pub fn from_unit(unit: Unit) -> Self {
        Self {
            millis: unit.seconds() * 1000,
            unit: Some(unit),
            calendar: None,
        }
    }

    /// `spec.unit` aligned to the calendar (see `calendar.rs`); an unknown zone is an error.
    pub fn from_calendar(spec: &calendar::CalendarSpec) -> Result<Self, String> {
        Ok(Self {
            calendar: Some(calendar::intern(spec)?),
            ..Self::from_unit(spec.unit)
        })
    }

    /// The calendar this period follows, if any.
    pub fn calendar(self) -> Option<calendar::CalendarId> {
        self.calendar
    }

    /// A `period:` duration; `None` for zero. A period equal to a unit is that unit.
    pub fn from_millis(millis: u64) -> Option<Self> {
        if millis == 0 {
            return None;
        }
        let unit = Unit::ALL.into_iter().find(|u| u.seconds() * 1000 == millis);
        Some(Self {
            millis,
            unit,
            calendar: None,
        })
    }

    pub fn millis(self) -> u64 {
        self.millis
    }

    pub fn as_duration(self) -> std::time::Duration {
        std::time::Duration::from_millis(self.millis)
    }

    /// The unit this period is exactly, if any.
    pub fn unit(self) -> Option<Unit> {
        self.unit
    }

    /// Parses `500ms`, `10s`, `5m`, `1h`, `2d`, `1w` (a number and one suffix).
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        crate::duration::parse_period_millis(s).and_then(|ms| {
            Self::from_millis(ms).ok_or_else(|| {
                format!("period '{s}' must be longer than zero and shorter than 584 million years")
            })
        })
    }
}

impl fmt::Display for Period {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(c) = self.calendar {
            return write!(f, "{}", c.calendar().spec);
        }
        match self.unit {
            Some(u) => write!(f, "{u}"),
            None if self.millis % 1000 == 0 => write!(f, "{}s", self.millis / 1000),
            None => write!(f, "{}ms", self.millis),
        }
    }
}

/// A counted limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limit {
    /// Requests admitted per period; 0 blocks everything.
    pub requests_per_unit: u32,
    pub period: Period,
    pub algorithm: Algorithm,
    /// token_bucket: requests allowed above the steady rate at once (default
    /// `requests_per_unit - 1`, resolved at load); 0 for the other algorithms.
    pub burst: u32,
}

impl Limit {
    /// A plain envoyproxy limit: fixed window, `requests_per_unit` per `unit`.
    pub fn fixed(requests_per_unit: u32, unit: Unit) -> Self {
        Self {
            requests_per_unit,
            period: Period::from_unit(unit),
            algorithm: Algorithm::FixedWindow,
            burst: 0,
        }
    }
}

/// How much a limit admits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quota {
    /// `unlimited: true`: never counted, always OK.
    Unlimited,
    Limited(Limit),
}

/// One limit of a node (a `rate_limit` block or one entry of `rate_limits`) together with the
/// descriptor-level flags that modify it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimitRule {
    pub name: Option<String>,
    pub quota: Quota,
    /// Names of limits this one replaces when both match one request.
    pub replaces: Vec<String>,
    pub shadow_mode: bool,
    /// envoyproxy's `quota_mode`: this limit's denial alone does not deny a request; a request
    /// is denied when every quota-mode limit of it denies (see [`crate::store::Admission`]).
    pub quota_mode: bool,
    /// A resource limit: also charged, on one counter keyed by the path down to its node, for
    /// every request that matches a node below it.
    pub applies_to_descendants: bool,
    /// `record_usage: true`: always charged, also on a rejected request, and denies only when
    /// its count is above the limit (what `all_or_nothing` domains use for reported usage).
    pub record_usage: bool,
    /// The descriptor's `reservations`: a request-time call naming a request reserves its hits
    /// on this limit, its stream-done call settles them at the actual.
    pub reservations: Option<Reservations>,
    /// The descriptor's `leased` terms (`store/slices`).
    pub leased: Option<Leasing>,
    /// Strictly below a node with `own_hash_tags: true`: its counters' Redis hash tags are all
    /// their entries (a hot resource's consumers spread over a Cluster). Fixed at load: every
    /// request that reaches it names one counter; `leased:` above it changes no key.
    pub own_tag: bool,
}

/// A rate limit's `reservations` terms: how long a reservation waits for its settle, and how
/// many one counter holds at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Reservations {
    pub lease: Period,
    pub max: u32,
    /// The least a reservation reserves, whatever the caller's estimate (`min_estimate`, 1 by
    /// default): an estimate of 0 would turn a budget into a check.
    pub min_estimate: u32,
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
    /// The node's limits: none, the one `rate_limit`, or every entry of `rate_limits`.
    pub rate_limits: Vec<RateLimitRule>,
    /// With a wildcard value: all matching values share one counter.
    pub share_threshold: bool,
    pub detailed_metric: bool,
    pub value_to_metric: bool,
    pub children: Level,
    pub location: Location,
    /// Dotted path for stats and `/rlconfig`, e.g. `domain.key_value.key2`.
    pub path: String,
    /// `metadata`: returned to Envoy for a descriptor this node passed, with
    /// `RESPONSE_DYNAMIC_METADATA`.
    pub metadata: Option<Arc<prost_types::Struct>>,
    /// `in_flight`'s and `reservations`' entry names: a descriptor one entry longer than this
    /// node, ending in one
    /// of them, is this node's, that entry naming the request (not part of the counter).
    pub lease_keys: Option<LeaseKeys>,
}

/// The names of the trailing entry that names a request on a lease limit (`in_flight`,
/// `reservations`): the
/// request-time call carries `id_key`, the stream-done call `done_key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseKeys {
    pub id_key: String,
    pub done_key: String,
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
    /// The domain as counter keys hold it, built once at load (no allocation per request).
    pub name: Arc<str>,
    pub file: Arc<str>,
    pub root: Level,
    /// `hash_tag: domain` (sluice extension): every counter of the domain in one Cluster slot.
    pub domain_tag: bool,
    /// `counting:`; `None` means the global `COUNTING` (what an xDS-pushed domain gets).
    pub counting: Option<Counting>,
    /// `allow_limit_override:` (sluice extension): whether Envoy's per-descriptor `limit`
    /// replaces the configured limit; `None` means the global `ALLOW_LIMIT_OVERRIDE`.
    pub allow_limit_override: Option<bool>,
    /// (file, line, path) of the domain's `global` blocks (limits kept in the home store).
    pub globals: Vec<(Arc<str>, usize, String)>,
}

/// How a domain's limits are charged (the domain's `counting`, else the global `COUNTING`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Counting {
    /// As envoyproxy/ratelimit: every descriptor's hits are recorded, on a denied request too;
    /// a limit denies when its count is above the limit. Usage Envoy reports after a response
    /// (`apply_on_stream_done`) is never lost.
    #[default]
    Envoyproxy,
    /// Only if every limit admits the request are all charged; a rejected request charges
    /// nothing, except limits with `record_usage: true`.
    AllOrNothing,
}

impl Counting {
    pub fn as_str(self) -> &'static str {
        match self {
            Counting::Envoyproxy => "envoyproxy",
            Counting::AllOrNothing => "all_or_nothing",
        }
    }
}

impl std::fmt::Display for Counting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Counting {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "envoyproxy" => Ok(Counting::Envoyproxy),
            "all_or_nothing" => Ok(Counting::AllOrNothing),
            _ => Err(format!(
                "counting must be `envoyproxy` (record every hit, as envoyproxy/ratelimit) or \
                 `all_or_nothing` (a rejected request charges nothing), got {s:?}"
            )),
        }
    }
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

    /// What a config with `global` limits is, loaded where no home store is set
    /// (`GLOBAL_REDIS_URL`): an error per `global` block, naming its file and line.
    pub fn without_home_store(&self) -> Result<(), ConfigErrors> {
        let mut errors: Vec<ConfigError> = Vec::new();
        for d in self.domains.values() {
            for (file, line, path) in &d.globals {
                errors.push(ConfigError {
                    file: file.to_string(),
                    line: (*line > 0).then_some(*line),
                    path: path.clone(),
                    message: "`global` keeps the limit's counter in the home store every region \
                              reaches, and none is set: set GLOBAL_REDIS_URL (and GLOBAL_REDIS_TYPE \
                              for a Cluster or Sentinel), or remove `global`"
                        .to_string(),
                });
            }
        }
        errors.sort_by(|a, b| (&a.file, a.line).cmp(&(&b.file, b.line)));
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ConfigErrors(errors))
        }
    }

    /// Number of rate limits (every entry of every node's `rate_limits`) per domain, for logs.
    pub fn rule_counts(&self) -> Vec<(String, usize)> {
        fn count(level: &Level) -> usize {
            level
                .nodes()
                .map(|n| n.rate_limits.len() + count(&n.children))
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
    /// `GET /rlconfig` in the envoyproxy/ratelimit format (`path: unit=.. requests_per_unit=..`),
    /// after one `domain: counting=..` line per domain.
    pub fn dump_with(&self, global: Counting) -> String {
        let mut heads: Vec<String> = self
            .domains
            .values()
            .map(|d| {
                let how = match d.counting {
                    Some(c) => c.to_string(),
                    None => format!("{global} (COUNTING)"),
                };
                format!("{}: counting={how}", d.domain)
            })
            .collect();
        heads.sort();
        let mut s = heads.join("\n");
        if !s.is_empty() {
            s.push('\n');
        }
        s.push_str(&self.dump());
        s
    }

    /// Every limit, one line per node with a limit, sorted (see [`RuleSet::dump_with`]).
    pub fn dump(&self) -> String {
        fn walk(level: &Level, out: &mut Vec<String>) {
            for n in level.nodes() {
                for rl in &n.rate_limits {
                    let quota = match rl.quota {
                        Quota::Unlimited => "unlimited=true".to_string(),
                        Quota::Limited(l) if l.algorithm == Algorithm::InFlight => {
                            let keys = n
                                .lease_keys
                                .as_ref()
                                .map(|k| format!(" id_key={} done_key={}", k.id_key, k.done_key))
                                .unwrap_or_default();
                            format!(
                                "in_flight max={} lease={}{keys}",
                                l.requests_per_unit, l.period
                            )
                        }
                        Quota::Limited(l) => {
                            let mut q = format!(
                                "unit={} requests_per_unit={}",
                                l.period, l.requests_per_unit
                            );
                            if l.algorithm != Algorithm::FixedWindow {
                                q.push_str(&format!(" algorithm={}", l.algorithm.name()));
                            }
                            if l.algorithm == Algorithm::TokenBucket {
                                q.push_str(&format!(" burst={}", l.burst));
                            }
                            if let (Some(r), Some(k)) = (rl.reservations, &n.lease_keys) {
                                q.push_str(&format!(
                                    " reservations lease={} max={} min_estimate={} id_key={} \
                                     done_key={}",
                                    r.lease, r.max, r.min_estimate, k.id_key, k.done_key
                                ));
                            }
                            q
                        }
                    };
                    let name = rl
                        .name
                        .as_deref()
                        .map(|n| format!(", name: {n}"))
                        .unwrap_or_default();
                    let descendants = if rl.applies_to_descendants {
                        ", applies_to_descendants: true"
                    } else {
                        ""
                    };
                    out.push(format!(
                        "{}: {quota}, shadow_mode: {}{name}{descendants}",
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
