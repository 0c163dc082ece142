//! What a stream is assigned for a bucket: its max-min fair share of what the limit's window
//! still has, paced over the time the window has left, as a token bucket Envoy enforces.
//!
//! - Available rate: `remaining / time left` of the tightest limit (the one with the lowest such
//!   rate), so a window is spread over its length instead of spent at its start.
//! - Max-min fairness over the streams that reported usage of the same counter recently: a
//!   stream that wants less than an equal share gets what it wants, the rest is split among the
//!   others (L = 120/min with demands 4/s and 0.5/s gives about 1.5/s and 0.5/s, 90 and 30 a
//!   minute). A stream with no measured demand yet counts as wanting an equal share.
//! - The token bucket refills every second (Envoy 1.40 rebuilds a bucket only when
//!   `max_tokens`, `tokens_per_fill` or the nanos of `fill_interval` change, so the interval
//!   stays fixed and the rate moves through `tokens_per_fill`), at least 1 token a second while
//!   the window has any budget, rounded up; `max_tokens` is one second of it (a fresh bucket
//!   starts full).
//! - A spent budget is DENY_ALL until the window ends.

use crate::proto::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use crate::proto::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use std::time::Duration;

/// How long an assignment lives without being renewed: three of Envoy's 5 s report periods, so
/// a live stream renews it long before it expires, and a stream cut for longer falls back to its
/// `expired_assignment_behavior`.
pub const ASSIGNMENT_TTL: Duration = Duration::from_secs(15);

/// What a bucket that names no limit (or a domain sluice does not know) is assigned, and for
/// how long: everything is allowed, renewed at each report while the bucket is used.
pub const ALLOW_TTL: Duration = Duration::from_secs(3600);

/// Each demand's max-min fair share of `available` (same units), in the order given.
pub fn max_min_shares(demands: &[Option<f64>], available: f64) -> Vec<f64> {
    let n = demands.len();
    if n == 0 {
        return Vec::new();
    }
    // An unmeasured demand wants an equal share.
    let equal = available / n as f64;
    let want: Vec<f64> = demands
        .iter()
        .map(|d| d.unwrap_or(equal).max(0.0))
        .collect();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| want[a].total_cmp(&want[b]));
    let mut shares = vec![0.0; n];
    let mut left = available.max(0.0);
    for (k, &i) in order.iter().enumerate() {
        let fair = left / (n - k) as f64;
        let give = want[i].min(fair);
        shares[i] = give;
        left -= give;
    }
    // Capacity nobody wanted goes to the stream that asked the most: demand measured over the
    // last report period may be rising, and the next report rebalances.
    if left > 0.0 {
        if let Some(&top) = order.last() {
            shares[top] += left;
        }
    }
    shares
}

/// The strategy for a share of `rate` requests per second, with `remaining` hits left in the
/// window.
pub fn strategy(rate: f64, remaining: u64) -> RateLimitStrategy {
    if remaining == 0 {
        return blanket(BlanketRule::DenyAll);
    }
    // Rounded up: Envoy's reports lag up to a period behind, so the budget a window's counter
    // shows at its start is already lower than what the window will see; erring up keeps the
    // window near L (over-admission stays within the stated bound).
    let per_second = (rate.ceil() as u64).clamp(1, u64::from(u32::MAX)) as u32;
    RateLimitStrategy {
        strategy: Some(Strategy::TokenBucket(TokenBucket {
            max_tokens: per_second,
            tokens_per_fill: Some(per_second),
            fill_interval: Some(prost_types::Duration {
                seconds: 1,
                nanos: 0,
            }),
        })),
    }
}

/// The requests per second a strategy's token bucket refills (0 for a blanket rule).
pub fn token_rate(s: &RateLimitStrategy) -> f64 {
    match &s.strategy {
        Some(Strategy::TokenBucket(tb)) => {
            let secs = tb.fill_interval.map_or(1, |d| d.seconds.max(1));
            f64::from(tb.tokens_per_fill.unwrap_or(0)) / secs as f64
        }
        _ => 0.0,
    }
}

pub fn blanket(rule: BlanketRule) -> RateLimitStrategy {
    RateLimitStrategy {
        strategy: Some(Strategy::BlanketRule(rule as i32)),
    }
}

/// The rate a limit can still afford: `remaining` over the time its window has left (at least
/// one second, so the last second of a window is not a division by nothing).
pub fn available_rate(remaining: u64, left: Duration) -> f64 {
    remaining as f64 / left.as_secs_f64().max(1.0)
}

/// Whole seconds, at least one: Envoy reads TTLs in whole seconds and an unset or zero TTL
/// expires at once.
pub fn ttl(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(d.as_secs().max(1)).unwrap_or(i64::MAX),
        nanos: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_demand_gets_what_it_wants_and_the_rest_goes_to_the_busy_stream() {
        // L = 120 a minute (2/s) for demands 4/s and 0.5/s: 1.5/s and 0.5/s (90 and 30).
        let s = max_min_shares(&[Some(4.0), Some(0.5)], 2.0);
        assert!(
            (s[0] - 1.5).abs() < 1e-9 && (s[1] - 0.5).abs() < 1e-9,
            "{s:?}"
        );
        // Two busy streams split evenly.
        let s = max_min_shares(&[Some(10.0), Some(10.0)], 2.0);
        assert!(
            (s[0] - 1.0).abs() < 1e-9 && (s[1] - 1.0).abs() < 1e-9,
            "{s:?}"
        );
        // An unmeasured stream wants an equal share.
        let s = max_min_shares(&[None, Some(0.2)], 2.0);
        assert!(
            (s[0] - 1.8).abs() < 1e-9 && (s[1] - 0.2).abs() < 1e-9,
            "{s:?}"
        );
        // Nobody wants it all: the leftover goes to the biggest asker.
        let s = max_min_shares(&[Some(0.1), Some(0.2)], 2.0);
        assert!((s.iter().sum::<f64>() - 2.0).abs() < 1e-9, "{s:?}");
    }

    #[test]
    fn a_share_becomes_a_one_second_token_bucket_and_a_spent_budget_denies() {
        let s = strategy(9.6, 100);
        match s.strategy {
            Some(Strategy::TokenBucket(tb)) => {
                assert_eq!((tb.max_tokens, tb.tokens_per_fill), (10, Some(10)));
                assert_eq!(tb.fill_interval.map(|d| d.seconds), Some(1));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            strategy(0.01, 3).strategy,
            strategy(1.0, 3).strategy,
            "at least one a second while anything is left"
        );
        assert_eq!(strategy(5.0, 0), blanket(BlanketRule::DenyAll));
        assert_eq!(ttl(Duration::from_millis(10)).seconds, 1);
        assert_eq!(available_rate(600, Duration::from_secs(60)), 10.0);
    }
}
