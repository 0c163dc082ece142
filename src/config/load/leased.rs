//! A descriptor's `leased: {max_slice, ahead}` block: its rate limits are spent by each replica
//! from slices of the current window reserved from the store (`store/slices.rs`), so a hot limit
//! costs the store one call per slice instead of one per request, never admitting over it.
//!
//! What it composes with is decided here, at load, with a clear error for the rest: a counted
//! `fixed_window` limit (a calendar one too) of a period of at least a second (a shorter
//! window ends before its slices could be spent or given back; starts travel in ms) or a `token_bucket` (a slice is a batch of its
//! tokens, at most burst + 1), not `record_usage` (it charges past the limit,
//! which a slice cannot), not `reservations` (a reservation settles on the store).

use super::super::yaml::{Node, Resolved, Value};
use super::super::{Algorithm, Period, Quota, RateLimitRule};
use super::ctx::{describe, join, kind, Ctx};
use super::limit::parse_period;
use super::schema::Scope;

/// A limit's `leased` terms, resolved against its quota at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Leasing {
    /// The most one grant takes from the store (`max_slice`; by default 1 % of the limit, at
    /// least 1): with R replicas, at most R of these are left unspent when a window ends.
    pub max_slice: u32,
    /// How much of a replica's demand one grant covers (`ahead`, 100 ms by default): a grant
    /// asks for what the replica admitted over this long, refilled before it runs out.
    pub ahead: Period,
    /// `global: {}`: the counter lives in the home store every region reaches; slices are
    /// granted from the region's pool of it, refilled from home (`store/global`).
    pub global: bool,
}

/// What one grant covers by default: the replica's demand over this long.
pub const DEFAULT_AHEAD_MS: u64 = 100;

/// The block as written, before it meets each limit.
struct LeasedBlock {
    max_slice: Option<u32>,
    ahead: super::super::Period,
    global: bool,
}

impl Ctx {
    /// Sets `leased` (or, `global`, `global`) on the node's rate limits, or reports why one
    /// cannot be.
    pub(super) fn leased_on(
        &mut self,
        node: &Node,
        path: &str,
        rules: &mut [RateLimitRule],
        global: bool,
    ) {
        let name = if global { "global" } else { "leased" };
        let Some(mut block) = self.leased_block(node, path, name) else {
            return;
        };
        block.global = global;
        if rules.is_empty() {
            self.err(
                node.line,
                path,
                format!("`{name}` slices the descriptor's `rate_limit`, and it has none"),
            );
        }
        if global {
            self.globals
                .push((self.file.clone(), node.line, path.to_owned()));
        }
        for r in rules.iter_mut() {
            let why = lease(r, &block).map(|w| w.replace("`leased`", &format!("`{name}`")));
            if let Some(why) = why {
                let name = r
                    .name
                    .as_deref()
                    .map_or(String::new(), |n| format!(" ('{n}')"));
                self.err(node.line, path, format!("limit{name}: {why}"));
            }
        }
    }

    fn leased_block(&mut self, node: &Node, path: &str, name: &str) -> Option<LeasedBlock> {
        let entries = match &node.value {
            Value::Map(entries) => entries.as_slice(),
            // `leased: {}` written as `leased:` (null) or `leased: true`: the defaults.
            Value::Scalar(s) if matches!(s.resolve(), Resolved::Null | Resolved::Bool(true)) => &[],
            _ => {
                self.err(
                    node.line,
                    path,
                    format!(
                        "`{name}` must be a mapping like {{}} or {{max_slice: 200, ahead: 100ms}}, \
                         not a {}",
                        kind(node)
                    ),
                );
                return None;
            }
        };
        let errors_before = self.errors.len();
        let mut block = LeasedBlock {
            max_slice: None,
            ahead: super::super::Period::from_millis(DEFAULT_AHEAD_MS)?,
            global: false,
        };
        let scope = if name == "global" {
            Scope::Global
        } else {
            Scope::Leased
        };
        for (key, _, v) in self.entries(entries, path, scope) {
            let p = join(path, key);
            match key {
                "max_slice" => block.max_slice = self.max_slice(v, &p),
                "ahead" => {
                    let text = self.text(v, &p, key, "a duration such as 50ms, 100ms or 1s")?;
                    match parse_period(&text) {
                        Ok(a) if a.millis() <= 60_000 => block.ahead = a,
                        Ok(_) => self.err(
                            v.line,
                            &p,
                            "`ahead` must be at most 60s: a grant covers a moment of demand, \
                             not a window"
                                .to_string(),
                        ),
                        Err(e) => self.err(v.line, &p, format!("`ahead` {e}")),
                    }
                }
                _ => {}
            }
        }
        (self.errors.len() == errors_before).then_some(block)
    }

    fn max_slice(&mut self, node: &Node, path: &str) -> Option<u32> {
        if let Some(n) = super::lease::positive_u32(node) {
            return Some(n);
        }
        self.err(
            node.line,
            path,
            format!(
                "`max_slice` must be a whole number from 1 to 4294967295 (the most one grant \
                 takes from the store), got {}",
                describe(node)
            ),
        );
        None
    }
}

/// Why `r` cannot be leased under `block`, or `None` once its `leased` terms are set.
fn lease(r: &mut RateLimitRule, block: &LeasedBlock) -> Option<String> {
    match r.quota {
        Quota::Unlimited => Some("an `unlimited` limit has nothing to slice".to_string()),
        Quota::Limited(l)
            if !matches!(l.algorithm, Algorithm::FixedWindow | Algorithm::TokenBucket) =>
        {
            Some(format!(
                "`leased` slices `fixed_window` limits (calendar ones too) and \
                 `token_bucket` ones; this one is `{}`: its state is not a count or a \
                 bucket of tokens a slice can be taken from",
                l.algorithm.name()
            ))
        }
        Quota::Limited(l)
            if l.algorithm == Algorithm::TokenBucket
                && block
                    .max_slice
                    .is_some_and(|m| m > l.burst.saturating_add(1)) =>
        {
            Some(format!(
                "`max_slice` {} is more than this token bucket holds (burst + 1 = {}): \
                 no grant could ever take it",
                block.max_slice.unwrap_or(0),
                l.burst.saturating_add(1)
            ))
        }
        Quota::Limited(l) if l.algorithm == Algorithm::FixedWindow && l.period.millis() < 1000 => {
            Some(
                "`leased` needs a window of at least 1s (a shorter one ends before \
                 the slices its replicas hold could be spent or given back)"
                    .to_string(),
            )
        }
        Quota::Limited(_) if r.record_usage => Some(
            "`leased` with `record_usage`: a recorded hit is charged past the limit, \
             which no slice can hold"
                .to_string(),
        ),
        Quota::Limited(_) if r.reservations.is_some() => Some(
            "`leased` with `reservations`: a reservation is settled on the store, not \
             in a slice"
                .to_string(),
        ),
        Quota::Limited(l) => {
            // A token bucket never holds more than burst + 1 tokens to grant.
            let most = match l.algorithm {
                Algorithm::TokenBucket => l.burst.saturating_add(1),
                _ => u32::MAX,
            };
            let max_slice = block
                .max_slice
                .unwrap_or((l.requests_per_unit / 100).clamp(1, most))
                .max(1);
            r.leased = Some(Leasing {
                max_slice,
                ahead: block.ahead,
                global: block.global,
            });
            None
        }
    }
}
