//! Rate-limit response headers (`LIMIT_RESPONSE_HEADERS_ENABLED`), which Envoy adds to the
//! client's response: envoyproxy/ratelimit's `RateLimit-Limit` / `-Remaining` / `-Reset` from
//! the most restrictive limit, optionally the IETF draft pair `RateLimit-Policy` / `RateLimit`
//! (draft-ietf-httpapi-ratelimit-headers), and `Retry-After` on OVER_LIMIT.

use crate::config::Limit;
use std::time::Duration;

/// Which headers to add, and under which names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderOptions {
    /// `LIMIT_LIMIT_HEADER` (default `RateLimit-Limit`).
    pub limit: String,
    /// `LIMIT_REMAINING_HEADER` (default `RateLimit-Remaining`).
    pub remaining: String,
    /// `LIMIT_RESET_HEADER` (default `RateLimit-Reset`).
    pub reset: String,
    /// `RATELIMIT_HEADERS_DRAFT=ietf`: also `RateLimit-Policy` and `RateLimit`.
    pub ietf_draft: bool,
}

impl Default for HeaderOptions {
    fn default() -> Self {
        Self {
            limit: "RateLimit-Limit".into(),
            remaining: "RateLimit-Remaining".into(),
            reset: "RateLimit-Reset".into(),
            ietf_draft: false,
        }
    }
}

/// One counted limit of the request as the headers see it.
#[derive(Debug, Clone)]
pub struct LimitState<'a> {
    /// Rule name; empty when unnamed.
    pub name: &'a str,
    pub limit: &'a Limit,
    pub remaining: u32,
    pub reset: Duration,
    /// This enforced limit denied the request; then the time until it would admit it again
    /// (`Duration::MAX` when it never will: more hits than the limit holds).
    pub denied_retry_after: Option<Duration>,
}

/// The headers for one decision. `states` holds every enforced (non-shadow) limit that was
/// decided; `over_limit` is the overall verdict.
pub fn headers(
    options: &HeaderOptions,
    states: &[LimitState<'_>],
    over_limit: bool,
) -> Vec<(String, String)> {
    // The most restrictive limit speaks for the request, as it speaks for a descriptor.
    let Some(most) = states
        .iter()
        .min_by_key(|s| restrictiveness(s.denied_retry_after.is_some(), s.remaining))
    else {
        return Vec::new();
    };
    let mut out = vec![
        (
            options.limit.clone(),
            most.limit.requests_per_unit.to_string(),
        ),
        (options.remaining.clone(), most.remaining.to_string()),
        (options.reset.clone(), ceil_secs(most.reset).to_string()),
    ];
    if options.ietf_draft {
        let (policy, state) = ietf_pair(states);
        out.push(("RateLimit-Policy".into(), policy));
        out.push(("RateLimit".into(), state));
    }
    if over_limit {
        // The request passes only once every denying limit admits it; a limit that never will
        // (hits above its size) has no honest retry time, so none is sent.
        let waits: Option<Vec<Duration>> = states
            .iter()
            .filter_map(|s| s.denied_retry_after)
            .map(|d| (d != Duration::MAX).then_some(d))
            .collect();
        if let Some(wait) = waits.and_then(|w| w.into_iter().max()) {
            out.push(("Retry-After".into(), ceil_secs(wait).max(1).to_string()));
        }
    }
    out
}

/// `RateLimit-Policy: "name";q=100;w=60, ...` and `RateLimit: "name";r=42;t=30, ...`, one item
/// per policy (a named rule, or the limit's shape `100/1m` when unnamed), most restrictive
/// state per policy, in request order.
fn ietf_pair(states: &[LimitState<'_>]) -> (String, String) {
    let mut items: Vec<(String, &LimitState<'_>)> = Vec::new();
    for s in states {
        let name = if s.name.is_empty() {
            format!("{}/{}", s.limit.requests_per_unit, s.limit.period)
        } else {
            s.name.to_string()
        };
        match items.iter_mut().find(|(n, _)| *n == name) {
            Some((_, kept)) if s.remaining < kept.remaining => *kept = s,
            Some(_) => {}
            None => items.push((name, s)),
        }
    }
    let policy = items
        .iter()
        .map(|(n, s)| {
            format!(
                "{};q={};w={}",
                sf_string(n),
                s.limit.requests_per_unit,
                ceil_secs(Duration::from_millis(s.limit.period.millis())).max(1)
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    let state = items
        .iter()
        .map(|(n, s)| {
            format!(
                "{};r={};t={}",
                sf_string(n),
                s.remaining,
                ceil_secs(s.reset)
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    (policy, state)
}

/// An RFC 8941 sf-string: printable ASCII only, `"` and `\` escaped; anything else (a config
/// name is free text) becomes `_` so the header always parses.
fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('_'),
        }
    }
    out.push('"');
    out
}

/// Whole seconds, rounded up, so a client waiting that long is never early.
fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// The order in which limits speak, for a descriptor's status and for the request's headers:
/// an enforcing denial first, then the fewest hits remaining; `min_by_key` keeps the first of
/// equals, so ties go to config order, as envoyproxy/ratelimit picks.
pub(super) fn restrictiveness(denies: bool, remaining: u32) -> (bool, u32) {
    (!denies, remaining)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Period, Unit};

    fn state<'a>(name: &'a str, limit: &'a Limit, remaining: u32, reset_ms: u64) -> LimitState<'a> {
        LimitState {
            name,
            limit,
            remaining,
            reset: Duration::from_millis(reset_ms),
            denied_retry_after: None,
        }
    }

    fn get<'a>(h: &'a [(String, String)], name: &str) -> Option<&'a str> {
        h.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    #[test]
    fn the_most_restrictive_limit_speaks() {
        let a = Limit::fixed(100, Unit::Minute);
        let b = Limit::fixed(10, Unit::Second);
        let h = headers(
            &HeaderOptions::default(),
            &[state("a", &a, 40, 30_000), state("b", &b, 3, 200)],
            false,
        );
        assert_eq!(
            h,
            [
                ("RateLimit-Limit".to_string(), "10".to_string()),
                ("RateLimit-Remaining".to_string(), "3".to_string()),
                ("RateLimit-Reset".to_string(), "1".to_string()),
            ]
        );
        assert_eq!(headers(&HeaderOptions::default(), &[], true), []);
    }

    #[test]
    fn a_denying_limit_wins_and_sets_retry_after() {
        let a = Limit::fixed(100, Unit::Minute);
        let b = Limit::fixed(10, Unit::Hour);
        let mut denied = state("b", &b, 0, 1_800_000);
        denied.denied_retry_after = Some(Duration::from_millis(1_500));
        let mut also = state("a", &a, 0, 20_000);
        also.denied_retry_after = Some(Duration::from_secs(20));
        let opts = HeaderOptions {
            limit: "X-Limit".into(),
            remaining: "X-Left".into(),
            reset: "X-Reset".into(),
            ietf_draft: false,
        };
        let h = headers(&opts, &[denied.clone(), also], true);
        assert_eq!(get(&h, "X-Limit"), Some("10"));
        assert_eq!(get(&h, "X-Left"), Some("0"));
        assert_eq!(get(&h, "X-Reset"), Some("1800"));
        assert_eq!(get(&h, "Retry-After"), Some("20"), "the later of both");
        // Never admitted (more hits than the limit holds): no Retry-After at all.
        denied.denied_retry_after = Some(Duration::MAX);
        let h = headers(&opts, &[denied], true);
        assert_eq!(get(&h, "Retry-After"), None);
    }

    #[test]
    fn ietf_draft_pair() {
        let a = Limit::fixed(100, Unit::Minute);
        let b = Limit {
            period: Period::parse("500ms").unwrap(),
            ..Limit::fixed(5, Unit::Second)
        };
        let opts = HeaderOptions {
            ietf_draft: true,
            ..HeaderOptions::default()
        };
        let h = headers(
            &opts,
            &[
                state("per-user \"x\"", &a, 42, 30_000),
                state("", &b, 4, 300),
                state("per-user \"x\"", &a, 41, 30_000),
            ],
            false,
        );
        assert_eq!(
            get(&h, "RateLimit-Policy"),
            Some(r#""per-user \"x\"";q=100;w=60, "5/500ms";q=5;w=1"#)
        );
        assert_eq!(
            get(&h, "RateLimit"),
            Some(r#""per-user \"x\"";r=41;t=30, "5/500ms";r=4;t=1"#)
        );
        assert_eq!(sf_string("é\\"), r#""_\\""#);
    }
}
