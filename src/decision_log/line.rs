//! One line of the decision log: a decided request, as JSON on one line, and back. The same
//! type is written by the service (`DECISION_LOG`) and read by `sluice replay`, so what a log
//! holds is exactly what a replay can feed the decision engine again: the domain, each
//! descriptor's entries with its own `limit` override and `hits_addend`, the request's
//! `hits_addend`, when it was decided, and the answer given then (overall and per
//! descriptor).
//!
//! Field names are short words (people read logs with `jq` too); fields at their default are
//! left out, so a request of one descriptor with two entries is a line of about 100 bytes.

use crate::proto::rate_limit_descriptor::{Entry, RateLimitOverride};
use crate::proto::{RateLimitDescriptor, RateLimitRequest};
use serde::{Deserialize, Serialize};

/// A decided request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Line {
    /// When the store decided it (Unix microseconds; the memory store's own reading, so a
    /// replay on its clock decides at the same instant).
    pub t: u64,
    /// The memory store's count of decisions, which orders decisions of one instant (0: not
    /// known).
    #[serde(default, skip_serializing_if = "is_zero64")]
    pub seq: u64,
    pub domain: String,
    /// The request's `hits_addend` (0: one hit).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub hits: u32,
    pub descriptors: Vec<Descriptor>,
    /// The answer then: admitted (OK) or not (OVER_LIMIT).
    pub ok: bool,
    /// Answered by `FAILURE_MODE` with the store down: not a decision a replay can compare.
    #[serde(default, skip_serializing_if = "is_false")]
    pub fallback: bool,
}

/// One descriptor of a logged request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Descriptor {
    /// `[key, value]` pairs, in the request's order (a value may be a redacted digest).
    pub entries: Vec<(String, String)>,
    /// Envoy's per-descriptor `limit` override: `[requests_per_unit, unit]` (the proto enum).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<(u32, i32)>,
    /// The descriptor's own `hits_addend`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hits: Option<u64>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub negative: bool,
    /// Its status then was OVER_LIMIT.
    #[serde(default, skip_serializing_if = "is_false")]
    pub over: bool,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn is_zero64(n: &u64) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl Line {
    /// The request again, as the service received it (with the logged values).
    pub fn request(&self) -> RateLimitRequest {
        RateLimitRequest {
            domain: self.domain.clone(),
            hits_addend: self.hits,
            descriptors: self
                .descriptors
                .iter()
                .map(|d| RateLimitDescriptor {
                    entries: d
                        .entries
                        .iter()
                        .map(|(key, value)| Entry {
                            key: key.clone(),
                            value: value.clone(),
                        })
                        .collect(),
                    limit: d.limit.map(|(requests_per_unit, unit)| RateLimitOverride {
                        requests_per_unit,
                        unit,
                    }),
                    hits_addend: d.hits,
                    is_negative_hits: d.negative,
                })
                .collect(),
        }
    }

    /// The logged form of `request`, decided at `t` (`over`: each descriptor's status was
    /// OVER_LIMIT).
    pub fn of(request: RateLimitRequest, t: u64, ok: bool, over: &[bool]) -> Self {
        Self {
            t,
            seq: 0,
            domain: request.domain,
            hits: request.hits_addend,
            descriptors: request
                .descriptors
                .into_iter()
                .enumerate()
                .map(|(i, d)| Descriptor {
                    entries: d.entries.into_iter().map(|e| (e.key, e.value)).collect(),
                    limit: d.limit.map(|l| (l.requests_per_unit, l.unit)),
                    hits: d.hits_addend,
                    negative: d.is_negative_hits,
                    over: over.get(i).copied().unwrap_or(false),
                })
                .collect(),
            ok,
            fallback: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_goes_through_a_line_and_back_whole() {
        let request = RateLimitRequest {
            domain: "d".into(),
            hits_addend: 3,
            descriptors: vec![
                RateLimitDescriptor {
                    entries: vec![Entry {
                        key: "user".into(),
                        value: "a \"quoted\"\nvalue".into(),
                    }],
                    limit: Some(RateLimitOverride {
                        requests_per_unit: 5,
                        unit: 2,
                    }),
                    hits_addend: Some(7),
                    is_negative_hits: true,
                },
                RateLimitDescriptor {
                    entries: vec![Entry {
                        key: "path".into(),
                        value: String::new(),
                    }],
                    ..Default::default()
                },
            ],
        };
        let line = Line::of(request.clone(), 42, false, &[false, true]);
        let text = serde_json::to_string(&line).unwrap();
        assert!(!text.contains('\n'), "one line: {text}");
        let back: Line = serde_json::from_str(&text).unwrap();
        assert_eq!(back, line);
        assert_eq!(back.request(), request);
        assert!(back.descriptors[1].over && !back.descriptors[0].over);
    }
}
