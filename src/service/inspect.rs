//! What a descriptor's counters hold, as the admin API's Inspect shows it: the request as Envoy
//! would send it, planned on the rules in force (matching, resource limits, overrides), then
//! decided by the store with no hits, so nothing is charged and one round trip answers (a
//! global limit's on the home store, with each region's pool: `store/global/regions.rs`).

use super::{plan::plan, RateLimiter, RequestError};
use crate::config::Limit;
use crate::proto::{rate_limit_descriptor::Entry, RateLimitDescriptor, RateLimitRequest};
use crate::store::admin::StoredOverride;
use crate::store::global::RegionReport;
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
    /// A global limit's pools, one per region (`store/global/regions.rs`); empty otherwise.
    pub regions: Vec<RegionReport>,
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
        // A global limit's counter is at home (a regional one would be a limit per region).
        let outcomes = self.record_on_stores(&checks).await?;
        let mut regions = Vec::with_capacity(plan.limits.len());
        for l in &plan.limits {
            // The pools are a view: one that cannot be read is left out, never the answer.
            regions.push(match &self.global {
                Some(g) if l.check.slice.is_some_and(|t| t.global) => {
                    g.regions(&l.check).await.unwrap_or_else(|e| {
                        tracing::warn!(error = %e, "cannot read the regions' pools");
                        Vec::new()
                    })
                }
                _ => Vec::new(),
            });
        }
        Ok(plan
            .limits
            .iter()
            .zip(outcomes)
            .zip(regions)
            .map(|((l, outcome), regions)| Inspected {
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
                regions,
            })
            .collect())
    }
}
