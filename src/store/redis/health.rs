//! The store's one health signal (`sluice_store_up`, readiness, the "unreachable" / "reachable
//! again" log lines) from its calls' answers.
//!
//! One Redis answers for itself: its last answer says. A Cluster can be partly out: one master
//! hung or gone, its slots' calls fail while the other masters answer. Taking the last answer
//! there flips the signal, and logs a line, on every other request of a partial outage (review
//! A11). So on a Cluster the store is unreachable while any slot's last call failed, and
//! reachable again once each such slot has answered since. A slot nobody calls any more would
//! hold the store down forever: its failure counts for [`STALE`] (each new failure renews it).
//! A failure that names no slot (no connection at all, a PING) is cleared by any answer.
//!
//! The healthy path takes no lock: while nothing is failing, an answer changes nothing.

use crate::store::StoreError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// How long a slot's failure holds the store down without a new one.
pub(super) const STALE: Duration = Duration::from_secs(30);

/// Failing slots (`None`: a failure naming no slot) and when each last failed.
#[derive(Debug)]
pub(super) struct Health {
    per_slot: bool,
    failing: Mutex<HashMap<Option<u16>, Instant>>,
    /// Whether `failing` is non-empty (read without the lock).
    any: AtomicBool,
}

impl Health {
    /// Per slot on a Cluster (`per_slot`); otherwise every answer is the store's.
    pub(super) fn new(per_slot: bool) -> Self {
        Self {
            per_slot,
            failing: Mutex::new(HashMap::new()),
            any: AtomicBool::new(false),
        }
    }

    /// Takes the answer `r` of a call on `slot`, and hands `report` the store's health if the
    /// answer says anything (an error reply proves Redis up and says nothing). `report` runs
    /// under the lock, so reports keep the order of the states they report.
    pub(super) fn record<T>(
        &self,
        slot: Option<u16>,
        r: &Result<T, StoreError>,
        report: impl FnOnce(bool),
    ) {
        let slot = slot.filter(|_| self.per_slot);
        let failed = match r {
            Ok(_) => false,
            Err(e) if e.is_transient() => true,
            Err(_) => return,
        };
        if !failed && !self.any.load(Ordering::Acquire) {
            return;
        }
        let mut m = self.failing.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if failed {
            m.insert(slot, now);
        } else {
            m.remove(&slot);
            m.remove(&None);
        }
        m.retain(|_, at| now.duration_since(*at) < STALE);
        self.any.store(!m.is_empty(), Ordering::Release);
        report(m.is_empty());
    }
}

#[cfg(test)]
mod tests {
    use super::{Health, STALE};
    use crate::store::StoreError;
    use std::time::Duration;

    fn ok() -> Result<(), StoreError> {
        Ok(())
    }

    fn down() -> Result<(), StoreError> {
        Err(StoreError::Transient("did not answer".into()))
    }

    /// The states reported by each answer of `answers` (slot, up), in order.
    fn reports(h: &Health, answers: &[(Option<u16>, bool)]) -> Vec<Option<bool>> {
        answers
            .iter()
            .map(|&(slot, up)| {
                let mut said = None;
                let r = if up { ok() } else { down() };
                h.record(slot, &r, |s| said = Some(s));
                said
            })
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_slot_holds_a_cluster_down_whatever_the_other_slots_answer() {
        let h = Health::new(true);
        let said = reports(
            &h,
            &[
                (Some(1), true),
                (Some(7), false),
                (Some(1), true),
                (Some(7), false),
                (Some(2), true),
                (None, true),
            ],
        );
        assert_eq!(
            said,
            [
                None,
                Some(false),
                Some(false),
                Some(false),
                Some(false),
                Some(false)
            ],
            "down from the first failure on, never up while slot 7 fails"
        );
        assert_eq!(reports(&h, &[(Some(7), true)]), [Some(true)], "slot 7 back");
        assert_eq!(reports(&h, &[(Some(3), true)]), [None], "nothing to say");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_naming_no_slot_is_cleared_by_any_answer() {
        let h = Health::new(true);
        assert_eq!(
            reports(&h, &[(None, false), (Some(9), true)]),
            [Some(false), Some(true)]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn one_redis_is_as_its_last_answer_says() {
        let h = Health::new(false);
        assert_eq!(
            reports(&h, &[(Some(7), false), (Some(1), true), (Some(7), false)]),
            [Some(false), Some(true), Some(false)]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_slot_nobody_calls_again_stops_holding_the_store_down() {
        let h = Health::new(true);
        reports(&h, &[(Some(7), false)]);
        tokio::time::advance(STALE - Duration::from_millis(1)).await;
        assert_eq!(reports(&h, &[(Some(1), true)]), [Some(false)]);
        reports(&h, &[(Some(7), false)]);
        tokio::time::advance(STALE - Duration::from_millis(1)).await;
        assert_eq!(
            reports(&h, &[(Some(1), true)]),
            [Some(false)],
            "a new failure renews it"
        );
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(reports(&h, &[(Some(1), true)]), [Some(true)]);
    }

    #[tokio::test(start_paused = true)]
    async fn an_error_reply_says_nothing() {
        let h = Health::new(true);
        let mut said = None;
        let r: Result<(), StoreError> = Err(StoreError::Permanent("NOSCRIPT".into()));
        h.record(Some(1), &r, |s| said = Some(s));
        assert_eq!(said, None);
    }
}
