//! How a stream ends on sluice's side (the server drains, or the stream reaches the
//! connection's age): nothing Envoy reported is lost and its buckets stay limited until it has
//! reconnected (to this replica or another).

use super::{Action, BucketAction, Outbox, Pairs, QuotaStream, RateLimitQuotaResponse, Reserve};
use super::{Slot, RECONNECT_TTL};
use crate::quota::allocate::{token_rate, ttl};

impl QuotaStream {
    /// The stream ends on sluice's side (a drain, or its age): what waits is taken first (its
    /// usage is charged), then every assignment goes again with a TTL that covers the
    /// reconnect (`farewell`).
    pub(super) async fn leave(&mut self, tx: &Outbox) {
        let waiting = match self.pending.take(self.now()) {
            Some(report) => self.on_report(report).await,
            None => Vec::new(),
        };
        for actions in [waiting, self.farewell().await] {
            if !actions.is_empty() {
                let response = RateLimitQuotaResponse {
                    bucket_action: actions,
                };
                let _ = tx.send(Ok(response)).await;
            }
        }
    }

    /// When sluice drains: every bucket's reservation given back and its assignment sent
    /// again, a token bucket's TTL stretched to [`RECONNECT_TTL`] (a DENY_ALL keeps its TTL:
    /// the window's end). The Envoy reports what it uses meanwhile to the replica it
    /// reconnects to.
    async fn farewell(&mut self) -> Vec<BucketAction> {
        let now = self.now();
        let all: Vec<Pairs> = self.buckets.keys().cloned().collect();
        let mut slots = Vec::new();
        for pairs in all {
            let held = self
                .buckets
                .get(&pairs)
                .and_then(|b| b.reserved)
                .filter(|(_, end)| now < *end)
                .map_or(0, |(t, _)| i64::try_from(t).unwrap_or(0));
            slots.extend(self.step(&pairs, -held, Reserve::No).map(Slot::Work));
        }
        let mut actions = self.answer(slots).await;
        for action in &mut actions {
            if let Some(Action::QuotaAssignmentAction(a)) = &mut action.bucket_action {
                let tokens = a
                    .rate_limit_strategy
                    .as_ref()
                    .is_some_and(|s| token_rate(s) > 0.0);
                if tokens {
                    a.assignment_time_to_live = Some(ttl(RECONNECT_TTL));
                }
            }
        }
        actions
    }
}
