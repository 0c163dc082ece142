//! Units a region's pool drained go back home: a give-back that home takes, refuses (its
//! counter reset since the pool was cleared: `admin.rs`, the fence), or does not answer.

use super::{grant_check, GlobalGrants};
use crate::store::{CounterKey, CounterStore};

/// How a give-back home ended ([`GlobalGrants::refund`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refund {
    /// Home took the units back.
    Back,
    /// Home refused them: its counter was reset since the pool was cleared (they were on the
    /// count the reset forgot).
    Forgiven,
    /// Home did not answer: counted stranded (it may have taken them).
    Failed,
}

impl GlobalGrants {
    /// Units drained from a pool go back home, unless home reset the counter since the pool
    /// was last cleared (`cleared`, the pool's last reset record: the units were on the count
    /// the reset forgot, and are forgiven, checked at home in the refund's own call). A refund
    /// that fails may still have been applied (its reply lost): its units are counted
    /// stranded, the most it can have lost, and never put back in the pool (home may have them
    /// again: that would be over the limit).
    pub(super) async fn refund(
        &self,
        key: &CounterKey,
        window: Option<(u64, u64)>,
        (units, cleared): (u64, u64),
    ) -> Refund {
        let back = grant_check(key, window, units, true);
        match self.home.refund_fenced(&back, cleared).await {
            Ok(true) => {
                self.tallies.returned.add(units);
                self.tallies.home_answered(true, self.now_ms());
                Refund::Back
            }
            Ok(false) => {
                self.tallies.forgiven.add(units);
                self.tallies.home_answered(true, self.now_ms());
                tracing::debug!(
                    domain = %key.domain,
                    units,
                    cleared,
                    "a give-back home refused: home reset the counter since the pool was cleared"
                );
                Refund::Forgiven
            }
            Err(_) => {
                self.tallies.stranded.add(units);
                Refund::Failed
            }
        }
    }
}
