//! Usage reported from elsewhere than a `ShouldRateLimit` call (the quota service's reports):
//! planned on the same rules as a request with the same entries, so it lands on the SAME
//! counters, and always recorded, whatever the domain's counting (the requests were already
//! served; what they used cannot be refused).

use super::plan::plan;
use super::{RateLimiter, RequestError};
use crate::proto::{rate_limit_descriptor::Entry, RateLimitDescriptor, RateLimitRequest};
use crate::store::{CounterKey, Outcome};

/// One limit a usage report landed on, and where its counter stands after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    /// The counter (its limit included).
    pub key: CounterKey,
    pub outcome: Outcome,
}

impl RateLimiter {
    /// Records `checks` where their counters live: a global limit's on the home store (its
    /// regional counter would be a limit per region), the rest on the store. Outcomes in order.
    pub(super) async fn record_on_stores(
        &self,
        checks: &[crate::store::LimitCheck],
    ) -> Result<Vec<Outcome>, RequestError> {
        let global = |c: &crate::store::LimitCheck| c.slice.is_some_and(|t| t.global);
        if !checks.iter().any(global) {
            return Ok(self.store().decide(checks).await?.outcomes);
        }
        let home = self
            .slices
            .as_ref()
            .and_then(|s| s.home().cloned())
            .ok_or_else(|| {
                RequestError::Store(crate::store::StoreError::Permanent(
                    "a global limit with no home store".to_string(),
                ))
            })?;
        let (at_home, here): (Vec<_>, Vec<_>) = checks.iter().cloned().partition(global);
        let mut home_out = home.decide(&at_home).await?.outcomes.into_iter();
        let mut here_out = if here.is_empty() {
            Vec::new().into_iter()
        } else {
            self.store().decide(&here).await?.outcomes.into_iter()
        };
        Ok(checks
            .iter()
            .filter_map(|c| {
                if global(c) {
                    home_out.next()
                } else {
                    here_out.next()
                }
            })
            .collect())
    }

    /// Records `hits` on every enforced limit the descriptor `entries` of `domain` resolves to
    /// (0 hits only reads them; negative hits give back, as Envoy's `is_negative_hits`: the
    /// quota service returning a reservation) and returns each with its outcome; empty when no
    /// counted limit applies. Shadow limits are recorded too but not returned: they never limit
    /// anything.
    pub async fn record_usage(
        &self,
        domain: &str,
        entries: &[(String, String)],
        hits: i64,
    ) -> Result<Vec<Recorded>, RequestError> {
        if self.has_no_config() {
            return Err(RequestError::NoConfig);
        }
        let request = RateLimitRequest {
            domain: domain.to_string(),
            descriptors: vec![RateLimitDescriptor {
                entries: entries
                    .iter()
                    .map(|(key, value)| Entry {
                        key: key.clone(),
                        value: value.clone(),
                    })
                    .collect(),
                hits_addend: Some(hits.unsigned_abs()),
                is_negative_hits: hits < 0,
                ..Default::default()
            }],
            hits_addend: 0,
        };
        let snapshot = self.rules();
        let mut planned = plan(&snapshot, &request, self.options())?;
        planned.calendar_windows(|| self.now_us());
        let mut checks = planned.checks();
        for c in &mut checks {
            c.record = true;
            c.stop_over = false;
        }
        if checks.is_empty() {
            return Ok(Vec::new());
        }
        let outcomes = self.record_on_stores(&checks).await?;
        Ok(checks
            .iter()
            .zip(outcomes)
            .filter(|(c, _)| !c.shadow)
            .map(|(c, outcome)| Recorded {
                key: c.key.clone(),
                outcome,
            })
            .collect())
    }
}
