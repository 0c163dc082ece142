//! What a descriptor's counters hold, as the admin API's Inspect shows it: the request as Envoy
//! would send it, planned on the rules in force (matching, resource limits, overrides), then
//! decided by the store with no hits, so nothing is charged and one round trip answers.

use super::{plan::plan, RateLimiter, RequestError};
use crate::config::Limit;
use crate::proto::{rate_limit_descriptor::Entry, RateLimitDescriptor, RateLimitRequest};
use crate::store::admin::StoredOverride;
use crate::store::Outcome;

/// One limit a descriptor matched, and its counter's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inspected {
    pub name: String,
    /// The limit in force (an admin override's when one applies).
    pub limit: Limit,
    /// The entries keying the counter.
    pub counter: Vec<(String, String)>,
    pub outcome: Outcome,
    pub shadow: bool,
    /// From Envoy's per-request `limit` override.
    pub request_override: bool,
    pub admin_override: Option<StoredOverride>,
}

impl Inspected {
    /// Hits counted that the limit has not given back yet: the limit less what remains.
    pub fn usage(&self) -> u64 {
        u64::from(self.limit.requests_per_unit).saturating_sub(u64::from(self.outcome.remaining))
    }
}

impl RateLimiter {
    /// Each limit `entries` of `domain` matches, with its counter's state; charges nothing.
    pub async fn inspect(
        &self,
        domain: &str,
        entries: &[(String, String)],
    ) -> Result<Vec<Inspected>, RequestError> {
        let request = RateLimitRequest {
            domain: domain.to_string(),
            descriptors: vec![RateLimitDescriptor {
                entries: entries
                    .iter()
                    .map(|(k, v)| Entry {
                        key: k.clone(),
                        value: v.clone(),
                    })
                    .collect(),
                ..Default::default()
            }],
            hits_addend: 0,
        };
        super::validate(&request, &self.options.caps)?;
        if self.has_no_config() {
            return Err(RequestError::NoConfig);
        }
        let mut plan = plan(&self.rules(), &request, &self.options)?;
        plan.calendar_windows(|| self.now_us());
        let now_ms = self.now_ms();
        self.overrides.apply(&mut plan, now_ms);
        let mut checks = plan.checks();
        for c in &mut checks {
            // A look, not a request: no hits, no refund, no slot or reservation taken.
            (c.hits, c.refund, c.lease) = (0, false, None);
        }
        if checks.is_empty() {
            return Ok(Vec::new());
        }
        let decision = self.store.decide(&checks).await?;
        Ok(plan
            .limits
            .iter()
            .zip(decision.outcomes)
            .map(|(l, outcome)| Inspected {
                name: l.name.clone(),
                limit: l.shown,
                counter: l.check.key.entries.to_vec(),
                outcome,
                shadow: l.check.shadow,
                request_override: l.check.key.overridden,
                admin_override: self.overrides.find(
                    &l.check.key.domain,
                    &l.check.key.entries,
                    &l.name,
                    now_ms,
                ),
            })
            .collect())
    }
}
