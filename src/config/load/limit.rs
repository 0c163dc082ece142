//! One limit (a `rate_limit` block or a `rate_limits` entry) into a [`RateLimitRule`]: unit or
//! period, algorithm, burst, `replaces`, and the checks between them.

use super::super::yaml::{Node, Resolved, Value};
use super::super::{Algorithm, Limit, Period, Quota, RateLimitRule, Unit};
use super::ctx::{join, kind, Ctx, ParsedLimit};
use super::schema::Scope;

/// A limit's keys as written: each the line of its value when given, and its text or value when
/// well-formed (a malformed one is reported once and not judged again).
#[derive(Default)]
struct LimitKeys {
    unit: Option<(String, usize)>,
    /// A unit already reported as malformed.
    unit_bad: bool,
    requests_per_unit: Option<u32>,
    unlimited: bool,
    /// An unlimited flag already reported as malformed.
    unlimited_bad: bool,
    name: String,
    name_line: Option<usize>,
    replaces: Vec<(String, usize)>,
    period: (Option<usize>, Option<String>),
    algorithm: (Option<usize>, Option<String>),
    burst: (Option<usize>, Option<u32>),
    descendants_line: Option<usize>,
    record_usage: bool,
    /// `calendar`: its line, and the block when well-formed.
    calendar: Option<(usize, Option<super::calendar::CalendarBlock>)>,
}

impl LimitKeys {
    fn unit_written(&self) -> bool {
        self.unit.as_ref().is_some_and(|(u, _)| !u.is_empty())
    }
}

/// sliding_log stores every admitted hit; beyond this a single counter would hold megabytes.
pub const MAX_SLIDING_LOG_LIMIT: u32 = 100_000;

impl Ctx {
    /// A `rate_limits` list (sluice extension): one limit per entry, at least one.
    pub(super) fn rate_limits(&mut self, node: &Node, path: &str) -> Vec<ParsedLimit> {
        let items = match &node.value {
            Value::Seq(items) if !items.is_empty() => items,
            Value::Seq(_) => {
                self.err(
                    node.line,
                    path,
                    "`rate_limits` is empty; list at least one limit, or remove the key for a \
                     descriptor without limits",
                );
                return Vec::new();
            }
            Value::Scalar(s) if s.resolve() == Resolved::Null => {
                self.err(
                    node.line,
                    path,
                    "`rate_limits` has no entries; list at least one limit, or remove the key for \
                     a descriptor without limits",
                );
                return Vec::new();
            }
            _ => {
                self.err(
                    node.line,
                    path,
                    format!(
                        "`rate_limits` must be a list of limits (a mapping per limit), not a {}",
                        kind(node)
                    ),
                );
                return Vec::new();
            }
        };
        items
            .iter()
            .enumerate()
            .filter_map(|(i, item)| {
                self.limit(item, &format!("{path}[{i}]"), Scope::RateLimitsEntry)
            })
            .collect()
    }

    /// One limit: a `rate_limit` block or a `rate_limits` entry. `None` when it is not a mapping
    /// (reported) or a null `rate_limit` (no limit, as envoyproxy/ratelimit treats it).
    /// `shadow_mode`/`quota_mode` are descriptor-level and filled in by the caller.
    pub(super) fn limit(&mut self, node: &Node, path: &str, scope: Scope) -> Option<ParsedLimit> {
        let entries = match &node.value {
            Value::Map(entries) => entries,
            Value::Scalar(s) if scope == Scope::RateLimit && s.resolve() == Resolved::Null => {
                return None
            }
            _ => {
                let message = if scope == Scope::RateLimit {
                    format!("`rate_limit` must be a mapping, not a {}", kind(node))
                } else {
                    format!(
                        "each `rate_limits` entry must be a mapping like {{requests_per_unit: 10, \
                         unit: second}}, not a {}",
                        kind(node)
                    )
                };
                self.err(node.line, path, message);
                return None;
            }
        };
        let errors_before = self.errors.len();
        let keys = self.limit_keys(entries, path, scope);
        let quota = if keys.unlimited_bad {
            Quota::Unlimited
        } else if keys.unlimited {
            self.check_unlimited(&keys, path);
            Quota::Unlimited
        } else {
            let limit = self.counted_limit(&keys, node, path);
            if keys.requests_per_unit.is_none() && self.errors.len() == errors_before {
                // The reference's Go zero value: a limit without requests_per_unit admits
                // nothing. Valid, but rarely meant, so say so.
                tracing::warn!(
                    file = %self.file,
                    line = node.line,
                    path,
                    "rate limit has no requests_per_unit; it defaults to 0 and blocks every request"
                );
            }
            Quota::Limited(limit)
        };
        let LimitKeys {
            name,
            name_line,
            replaces,
            descendants_line,
            record_usage,
            ..
        } = keys;
        if !name.is_empty() {
            for (replaced, line) in &replaces {
                if *replaced == name {
                    self.err(
                        *line,
                        &join(path, "replaces"),
                        format!("replaces should not contain name of same descriptor ('{name}')"),
                    );
                }
            }
        }
        Some(ParsedLimit {
            path: path.to_owned(),
            name_line: name_line.filter(|_| !name.is_empty()),
            rule: RateLimitRule {
                name: (!name.is_empty()).then_some(name),
                quota,
                replaces: replaces.into_iter().map(|(n, _)| n).collect(),
                shadow_mode: false,
                quota_mode: false,
                applies_to_descendants: descendants_line.is_some(),
                record_usage,
                reservations: None,
                leased: None,
                own_tag: false,
            },
            descendants_line,
        })
    }

    /// Reads a limit's keys, reporting malformed values (each once).
    fn limit_keys(&mut self, entries: &[(Node, Node)], path: &str, scope: Scope) -> LimitKeys {
        let mut k = LimitKeys::default();
        for (key, _, v) in self.entries(entries, path, scope) {
            let p = join(path, key);
            match key {
                "unit" => match self.string(v, &p, key) {
                    Some(u) => k.unit = Some((u, v.line)),
                    None => k.unit_bad = true,
                },
                "requests_per_unit" => k.requests_per_unit = self.requests_per_unit(v, &p),
                "unlimited" => match self.flag(v, &p, key) {
                    Some(u) => k.unlimited = u,
                    None => k.unlimited_bad = true,
                },
                "name" => {
                    k.name = self.string(v, &p, key).unwrap_or_default();
                    k.name_line = Some(v.line);
                }
                "replaces" => k.replaces = self.replaces(v, &p),
                "period" => {
                    let expected = "a duration such as 500ms, 10s, 5m, 1h, 2d or 1w";
                    k.period = (Some(v.line), self.text(v, &p, key, expected));
                }
                "algorithm" => {
                    let expected = format!("one of {}", algorithm_names());
                    k.algorithm = (Some(v.line), self.text(v, &p, key, &expected));
                }
                "burst" => k.burst = (Some(v.line), self.burst(v, &p)),
                "applies_to_descendants" => {
                    k.descendants_line = (self.flag(v, &p, key) == Some(true)).then_some(v.line);
                }
                "record_usage" => k.record_usage = self.flag(v, &p, key) == Some(true),
                "calendar" => k.calendar = Some((v.line, self.calendar_block(v, &p))),
                _ => {}
            }
        }
        k
    }

    /// An unlimited limit is never counted: everything that shapes a count contradicts it.
    fn check_unlimited(&mut self, keys: &LimitKeys, path: &str) {
        if let (true, Some((_, line))) = (keys.unit_written(), &keys.unit) {
            // envoyproxy/ratelimit only rejects a *valid* unit here; any unit next to
            // `unlimited: true` is a contradiction, so sluice rejects them all.
            self.err(
                *line,
                &join(path, "unit"),
                "should not specify rate limit unit when unlimited",
            );
        }
        for (key, line) in [
            ("period", keys.period.0),
            ("algorithm", keys.algorithm.0),
            ("burst", keys.burst.0),
            ("calendar", keys.calendar.as_ref().map(|c| c.0)),
        ] {
            if let Some(line) = line {
                self.err(
                    line,
                    &join(path, key),
                    format!("should not specify rate limit {key} when unlimited"),
                );
            }
        }
    }

    /// A counted limit: its window, algorithm and burst, each checked against the others.
    fn counted_limit(&mut self, keys: &LimitKeys, node: &Node, path: &str) -> Limit {
        let period = self.limit_period(keys, node, path);
        let algorithm = self.limit_algorithm(keys, path);
        let period = self.calendar_period(
            keys.calendar.as_ref(),
            (period, keys.period.0.is_some()),
            algorithm,
            path,
        );
        let rpu = keys.requests_per_unit.unwrap_or(0);
        if algorithm == Some(Algorithm::SlidingLog) && rpu > MAX_SLIDING_LOG_LIMIT {
            self.err(
                node.line,
                &join(path, "requests_per_unit"),
                format!(
                    "sliding_log keeps one entry per admitted request (about 50 bytes each in \
                     Redis), so its requests_per_unit is capped at {MAX_SLIDING_LOG_LIMIT}; \
                     got {rpu}. Use sliding_window for large limits"
                ),
            );
        }
        let burst = self.limit_burst(keys, algorithm, rpu, path);
        if algorithm == Some(Algorithm::TokenBucket) && rpu > 0 {
            self.check_token_bucket_exact(rpu, burst, period, node, path);
        }
        Limit {
            requests_per_unit: rpu,
            period,
            algorithm: algorithm.unwrap_or_default(),
            burst,
        }
    }

    /// The window: `unit` or `period`, exactly one of them (a second when neither is usable).
    fn limit_period(&mut self, keys: &LimitKeys, node: &Node, path: &str) -> Period {
        let from_unit = match (&keys.unit, keys.unit_bad) {
            (Some((u, line)), false) if !u.is_empty() => match Unit::parse(u) {
                Some(u) => Some(Period::from_unit(u)),
                None => {
                    self.err(
                        *line,
                        &join(path, "unit"),
                        format!(
                            "invalid rate limit unit '{u}'; expected one of {} (any case)",
                            unit_names()
                        ),
                    );
                    None
                }
            },
            _ => None,
        };
        let from_period = match &keys.period {
            (Some(line), Some(text)) => match parse_period(text) {
                Ok(p) => Some(p),
                Err(message) => {
                    self.err(*line, &join(path, "period"), message);
                    None
                }
            },
            _ => None,
        };
        let unit_line = keys.unit.as_ref().map_or(node.line, |(_, l)| *l);
        match (keys.unit_written() || keys.unit_bad, keys.period.0) {
            (true, Some(line)) => self.err(
                line,
                &join(path, "period"),
                format!(
                    "`period` and `unit` cannot both be given (`unit` is at line {unit_line}); \
                     keep one of them"
                ),
            ),
            (false, None) => self.err(
                unit_line,
                &join(path, "unit"),
                format!(
                    "invalid rate limit unit '': `unit` is required unless `unlimited: true` \
                     (one of {}), or give a `period` instead (a duration such as 500ms, 10s, \
                     5m, 1h, 2d or 1w)",
                    unit_names()
                ),
            ),
            _ => {}
        }
        from_unit
            .or(from_period)
            .unwrap_or(Period::from_unit(Unit::Second))
    }

    /// The algorithm (fixed window when not given); `None` when the given one is invalid.
    fn limit_algorithm(&mut self, keys: &LimitKeys, path: &str) -> Option<Algorithm> {
        match &keys.algorithm {
            (Some(line), Some(text)) => match Algorithm::parse(text) {
                Some(a) => Some(a),
                None => {
                    let case = if Algorithm::parse(&text.to_ascii_lowercase()).is_some() {
                        " (names are lower-case)"
                    } else {
                        ""
                    };
                    self.err(
                        *line,
                        &join(path, "algorithm"),
                        format!(
                            "invalid algorithm '{text}'; expected one of {}{case}",
                            algorithm_names()
                        ),
                    );
                    None
                }
            },
            (Some(_), None) => None,
            (None, _) => Some(Algorithm::FixedWindow),
        }
    }

    /// The burst: token_bucket's own (a full limit less one by default); 0 for the others,
    /// which refuse one.
    fn limit_burst(
        &mut self,
        keys: &LimitKeys,
        algorithm: Option<Algorithm>,
        rpu: u32,
        path: &str,
    ) -> u32 {
        match (keys.burst, algorithm) {
            // A bad algorithm is already reported; a burst next to it is not judged.
            (_, None) => 0,
            ((None, _), Some(Algorithm::TokenBucket)) => rpu.saturating_sub(1),
            ((Some(_), b), Some(Algorithm::TokenBucket)) => b.unwrap_or(0),
            ((Some(line), _), Some(other)) => {
                let default = if keys.algorithm.0.is_some() {
                    ""
                } else {
                    " (the default)"
                };
                self.err(
                    line,
                    &join(path, "burst"),
                    format!(
                        "`burst` only applies to `algorithm: token_bucket`; this limit uses \
                         {}{default}",
                        other.name()
                    ),
                );
                0
            }
            ((None, _), Some(_)) => 0,
        }
    }

    /// The TAT carries the emission interval's remainder in 1/rpu µs; products of it must stay
    /// exact in the Lua script's doubles.
    fn check_token_bucket_exact(
        &mut self,
        rpu: u32,
        burst: u32,
        period: Period,
        node: &Node,
        path: &str,
    ) {
        let rem = period.millis().saturating_mul(1000) % u64::from(rpu);
        if (u64::from(burst) + 1).saturating_mul(rem) >= 1 << 53 {
            self.err(
                node.line,
                path,
                format!(
                    "token_bucket with requests_per_unit {rpu} and burst {burst} over {period} \
                     cannot be decided exactly: (burst + 1) x (period in µs mod \
                     requests_per_unit) must stay below 2^53. Lower the burst or pick a period \
                     that is a multiple of requests_per_unit µs"
                ),
            );
        }
    }
}

pub(super) fn unit_names() -> String {
    Unit::ALL.map(Unit::name).join(", ")
}

pub(super) fn algorithm_names() -> String {
    Algorithm::ALL.map(Algorithm::name).join(", ")
}

/// A `period` value through [`Period::parse`], with a clearer message for a fraction (`1.5s`),
/// which the duration syntax does not have.
pub(super) fn parse_period(text: &str) -> Result<Period, String> {
    let t = text.trim();
    let number_end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    if t[..number_end].contains('.') {
        return Err(format!(
            "period '{t}' must be a whole number and a suffix (ms, s, m, h, d or w); write a \
             fraction with a smaller suffix, e.g. 1500ms for 1.5s"
        ));
    }
    Period::parse(t)
}
