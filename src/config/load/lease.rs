//! A descriptor's lease blocks, the limits a request holds from its request-time call to its
//! stream-done call (or until a lease ends):
//! - `in_flight: {max, lease, id_key, done_key}`: requests holding a slot at once. It loads to an
//!   ordinary [`RateLimitRule`] of algorithm [`Algorithm::InFlight`] (`max` slots, the lease as
//!   its period), so every part that handles limits (replaces, shadow, quota mode, metrics,
//!   `/rlconfig`) handles it too;
//! - `reservations: {lease, id_key, done_key, max}`: the node's rate limits reserve a request's
//!   hits when it starts and settle them at the actual when it ends ([`Reservations`] on each
//!   of the node's limits).
//!
//! Both name the request by the same trailing entry: the node's [`LeaseKeys`].

use super::super::yaml::{Node, Resolved, Value};
use super::super::{Algorithm, LeaseKeys, Limit, Period, Quota, RateLimitRule, Reservations};
use super::ctx::{describe, join, kind, Ctx, ParsedLimit};
use super::limit::parse_period;
use super::schema::Scope;

/// Slots one `in_flight` limit may have, and reservations one counter may hold: each is an
/// entry (its request id) kept with the counter, in memory and in Redis, so this bounds what one
/// counter holds.
pub const MAX_IN_FLIGHT: u32 = 10_000;
/// Reservations one counter holds at most when `max` is not set: each is an entry (its request
/// id, up to 128 bytes, in two Redis structures) kept with the counter, and a request whose
/// estimate does not fit makes none, so a few hundred cover any budget's concurrency while one
/// counter stays under about 100 KB in Redis (10 000 would let a client hold megabytes).
pub const DEFAULT_RESERVATIONS: u32 = 256;
/// Longest request id a lease entry may carry (bytes); a longer one is INVALID_ARGUMENT. Envoy's
/// `x-request-id` is a 36-character UUID.
pub const MAX_LEASE_ID_BYTES: usize = 128;

/// A lease block as written: `max` (required for `in_flight`, optional for `reservations`),
/// `min_estimate` (`reservations` only), the lease and the entry names.
struct LeaseBlock {
    max: Option<u32>,
    min_estimate: Option<u32>,
    lease: Period,
    keys: LeaseKeys,
}

impl Ctx {
    /// `in_flight: {max, lease, id_key, done_key}`.
    pub(super) fn in_flight(
        &mut self,
        node: &Node,
        path: &str,
    ) -> Option<(ParsedLimit, LeaseKeys)> {
        let block = self.lease_block(node, path, Scope::InFlight)?;
        let rule = RateLimitRule {
            name: None,
            quota: Quota::Limited(Limit {
                requests_per_unit: block.max?,
                period: block.lease,
                algorithm: Algorithm::InFlight,
                burst: 0,
            }),
            replaces: Vec::new(),
            shadow_mode: false,
            quota_mode: false,
            applies_to_descendants: false,
            record_usage: false,
            reservations: None,
            leased: None,
            own_tag: false,
        };
        let parsed = ParsedLimit {
            rule,
            path: path.to_owned(),
            name_line: None,
            descendants_line: None,
        };
        Some((parsed, block.keys))
    }

    /// `reservations: {lease, id_key, done_key, max, min_estimate}` (`max` defaults to
    /// [`DEFAULT_RESERVATIONS`], `min_estimate` to 1).
    pub(super) fn reservations(
        &mut self,
        node: &Node,
        path: &str,
    ) -> Option<(Reservations, LeaseKeys)> {
        let block = self.lease_block(node, path, Scope::Reservations)?;
        let terms = Reservations {
            lease: block.lease,
            max: block.max.unwrap_or(DEFAULT_RESERVATIONS),
            min_estimate: block.min_estimate.unwrap_or(1),
        };
        Some((terms, block.keys))
    }

    fn lease_block(&mut self, node: &Node, path: &str, scope: Scope) -> Option<LeaseBlock> {
        let (name, example, max_means) = match scope {
            Scope::InFlight => (
                "in_flight",
                "{max: 3, lease: 5s, id_key: request_id, done_key: request_done}",
                "slots held at once",
            ),
            _ => (
                "reservations",
                "{lease: 5m, id_key: request_id, done_key: request_done}",
                "reservations held at once per counter",
            ),
        };
        let Value::Map(entries) = &node.value else {
            self.err(
                node.line,
                path,
                format!(
                    "`{name}` must be a mapping like {example}, not a {}",
                    kind(node)
                ),
            );
            return None;
        };
        let errors_before = self.errors.len();
        let (mut max, mut lease, mut id_key, mut done_key) = (None, None, None, None);
        let mut min_estimate = None;
        for (key, _, v) in self.entries(entries, path, scope) {
            let p = join(path, key);
            match key {
                "max" => max = self.slots(v, &p, max_means),
                "min_estimate" => min_estimate = self.min_estimate(v, &p),
                "lease" => lease = self.lease_period(v, &p, scope),
                "id_key" => id_key = self.entry_name(v, &p, key),
                "done_key" => done_key = self.entry_name(v, &p, key),
                _ => {}
            }
        }
        let has = (max.is_some(), lease.is_some());
        self.lease_keys(
            node,
            path,
            (scope, name),
            has,
            (&id_key, &done_key),
            errors_before,
        );
        if self.errors.len() > errors_before {
            return None;
        }
        Some(LeaseBlock {
            max,
            min_estimate,
            lease: lease?,
            keys: LeaseKeys {
                id_key: id_key?,
                done_key: done_key?,
            },
        })
    }

    /// `lease`: a duration; 0 is refused (it would end every slot or reservation at once).
    fn lease_period(&mut self, v: &Node, p: &str, scope: Scope) -> Option<Period> {
        let expected = "a duration such as 500ms, 10s or 5m";
        let text = self.text(v, p, "lease", expected)?;
        match parse_period(&text) {
            Ok(period) => Some(period),
            Err(e) => {
                let what = if scope == Scope::InFlight {
                    "slot"
                } else {
                    "reservation"
                };
                let why = format!("`lease` {e}; a lease of 0 would end every {what} at once");
                self.err(v.line, p, why);
                None
            }
        }
    }

    /// Every key the block needs is there (if nothing else was wrong with it), and `id_key`
    /// and `done_key` differ. `has`: whether `max` and `lease` were given.
    fn lease_keys(
        &mut self,
        node: &Node,
        path: &str,
        (scope, name): (Scope, &str),
        (has_max, has_lease): (bool, bool),
        (id_key, done_key): (&Option<String>, &Option<String>),
        errors_before: usize,
    ) {
        let required: &[(&str, bool)] = if scope == Scope::InFlight {
            &[
                ("max", !has_max),
                ("lease", !has_lease),
                ("id_key", id_key.is_none()),
                ("done_key", done_key.is_none()),
            ]
        } else {
            &[
                ("lease", !has_lease),
                ("id_key", id_key.is_none()),
                ("done_key", done_key.is_none()),
            ]
        };
        let all = if scope == Scope::InFlight {
            "max, lease, id_key and done_key"
        } else {
            "lease, id_key and done_key"
        };
        for &(key, missing) in required {
            if missing && self.errors.len() == errors_before {
                self.err(node.line, path, format!("`{name}` needs `{key}` ({all})"));
            }
        }
        if let (Some(id), Some(done)) = (id_key, done_key) {
            if id == done {
                self.err(
                    node.line,
                    &join(path, "done_key"),
                    format!(
                        "`id_key` and `done_key` are both '{id}': the request-time call and the \
                         stream-done call could not be told apart"
                    ),
                );
            }
        }
    }

    /// `min_estimate`: 1 to 2^32 - 1 (0 would let a caller's estimate of 0 reserve nothing).
    fn min_estimate(&mut self, node: &Node, path: &str) -> Option<u32> {
        if let Some(n) = positive_u32(node) {
            return Some(n);
        }
        self.err(
            node.line,
            path,
            "`min_estimate` must be a whole number from 1 to 4294967295: the least a \
             reservation reserves, whatever the caller's estimate (0 would turn the budget into \
             a check)"
                .to_string(),
        );
        None
    }

    /// `max`: 1 to [`MAX_IN_FLIGHT`].
    fn slots(&mut self, node: &Node, path: &str, means: &str) -> Option<u32> {
        if let Value::Scalar(s) = &node.value {
            if let Resolved::Int(n) = s.resolve() {
                if let Ok(n) = u32::try_from(n) {
                    if (1..=MAX_IN_FLIGHT).contains(&n) {
                        return Some(n);
                    }
                }
            }
        }
        self.err(
            node.line,
            path,
            format!(
                "`max` must be an integer from 1 to {MAX_IN_FLIGHT} ({means}), got {}",
                describe(node)
            ),
        );
        None
    }

    /// `id_key` / `done_key`: a descriptor entry's key, not empty.
    fn entry_name(&mut self, node: &Node, path: &str, name: &str) -> Option<String> {
        let s = self.string(node, path, name)?;
        if s.is_empty() {
            self.err(
                node.line,
                path,
                format!(
                    "`{name}` is empty; it names the descriptor entry that carries the request id"
                ),
            );
            return None;
        }
        Some(s)
    }
}

/// A whole number from 1 to 2^32 - 1, if `node` is one.
pub(super) fn positive_u32(node: &Node) -> Option<u32> {
    let Value::Scalar(s) = &node.value else {
        return None;
    };
    let Resolved::Int(n) = s.resolve() else {
        return None;
    };
    u32::try_from(n).ok().filter(|&n| n >= 1)
}
