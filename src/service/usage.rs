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
        let decision = self.store().decide(&checks).await?;
        Ok(checks
            .iter()
            .zip(decision.outcomes)
            .filter(|(c, _)| !c.shadow)
            .map(|(c, outcome)| Recorded {
                key: c.key.clone(),
                outcome,
            })
            .collect())
    }
}
