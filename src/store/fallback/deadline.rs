//! Deadlines are the caller's, suspicion is the store's: when a request stops waiting on the
//! store and is decided locally. A caller cannot push a healthy store's requests local by being
//! impatient (its own request waits on the store instead), nor hold one past the store's budget
//! by being patient.

use super::{Instant, Shared};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// The store always gets at least this long before a request is decided locally: a caller whose
/// deadline leaves less (after the margin) waits on the store alone, so no caller can push a
/// healthy store's requests local by being impatient.
const MIN_STORE_WAIT: Duration = Duration::from_millis(2);

impl Shared {
    /// When to stop waiting for the store and decide locally: the caller's deadline less the
    /// margin, never later than the store's budget (`REDIS_TIMEOUT`) from `now`. A caller whose
    /// deadline leaves the store less than [`MIN_STORE_WAIT`] is treated as one without a
    /// deadline: it waits on the store (up to its budget, or until the caller gives up), so an
    /// impatient caller gets the store's answer and changes nothing for anyone else.
    pub(super) fn give_up_at(&self, deadline: Option<Instant>, now: Instant) -> Instant {
        let budget = now + self.settings.budget;
        let Some(d) = deadline else {
            return budget;
        };
        match d.checked_sub(self.settings.margin) {
            Some(at) if at >= now + MIN_STORE_WAIT.min(self.settings.budget) => at.min(budget),
            _ => {
                self.tell_short_deadline(d.saturating_duration_since(now));
                budget
            }
        }
    }

    /// Logs once that callers send deadlines too short to decide locally before them.
    fn tell_short_deadline(&self, left: Duration) {
        if !self.told_short_deadline.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                deadline_ms = left.as_secs_f64() * 1e3,
                margin_ms = self.settings.margin.as_secs_f64() * 1e3,
                min_store_wait_ms = MIN_STORE_WAIT.as_secs_f64() * 1e3,
                "a caller's deadline is shorter than LOCAL_DEADLINE_MARGIN plus the store's \
                 minimum wait: such requests wait on the store alone and are never decided \
                 locally (FAILURE_MODE=local cannot answer them in time); raise the rate-limit \
                 timeout in Envoy or lower LOCAL_DEADLINE_MARGIN (logged once)"
            );
        }
    }
}
