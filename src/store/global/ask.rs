//! What one refill asks of home, and how much: the region's demand over
//! [`POOL_AHEAD_MS`](super::POOL_AHEAD_MS), at least the slices asked for, at most a quarter of
//! what home had left (so the regions share the window's tail); and, when home has less than
//! asked, what it has left.

use super::{grant_check, Asked, GlobalGrants, Known, PoolState, MIN_REFILL_SLICES, POOL_AHEAD_MS};
use crate::store::LimitCheck;
use std::time::Duration;

impl GlobalGrants {
    /// One refill's grant from home: `want`, or what home has left when less (a second call),
    /// or nothing (home is dry for `ahead`).
    pub(super) async fn ask_home(&self, check: &LimitCheck, want: u64, home_left: u64) -> Asked {
        let mut out = Asked {
            got: 0,
            dry_ms: 0,
            home_left,
            failed: None,
        };
        let mut ask = want;
        for _ in 0..2 {
            let mut grant = grant_check(&check.key, check.window, ask, false);
            // Judged on the admin override in force (`admin.rs`), as the request would be.
            grant.admin_limit = check.admin_limit;
            let o = match self.home.decide(std::slice::from_ref(&grant)).await {
                Ok(d) => match d.outcomes.first() {
                    Some(o) => *o,
                    None => break,
                },
                Err(e) => {
                    out.failed = Some(e);
                    break;
                }
            };
            out.home_left = u64::from(o.remaining);
            if o.allowed {
                out.got = ask;
                break;
            }
            // Home has less than asked: the region takes what is left (a request too large for
            // it is denied, the others go on); only an empty home makes the pool dry.
            let left = u64::from(o.remaining);
            if left == 0 || o.retry_after == Duration::MAX {
                out.dry_ms = check.slice.map_or(100, |t| t.ahead.millis()).max(1);
                break;
            }
            ask = left;
        }
        out
    }

    /// The next refill's size: the region's demand over [`POOL_AHEAD_MS`], at least `need` and
    /// [`MIN_REFILL_SLICES`] slices, at most a quarter of what home had left; and whether that
    /// quarter held it below the region's demand (the region is short: `moved.rs`).
    pub(super) fn want(
        &self,
        check: &LimitCheck,
        k: &Known,
        pool: &PoolState,
        need: u64,
    ) -> (u64, bool) {
        let slice = check.slice.map_or(1, |t| u64::from(t.max_slice));
        let floor = slice.saturating_mul(MIN_REFILL_SLICES);
        let demand = if k.at_ms == 0 || pool.now <= k.at_ms {
            floor.saturating_mul(2)
        } else {
            let taken = pool.taken.saturating_sub(k.taken_at);
            // A rate read over less than a second is noise (a burst of slices taken at once):
            // a refill right after another must not size itself on a millisecond.
            let elapsed = (pool.now - k.at_ms).max(1_000);
            u64::try_from(u128::from(taken) * u128::from(POOL_AHEAD_MS) / u128::from(elapsed))
                .unwrap_or(u64::MAX)
        };
        let quarter = if k.home_left == u64::MAX {
            u64::MAX
        } else {
            k.home_left.div_ceil(4)
        };
        let wanted = demand.max(floor).max(need).max(1);
        let want = wanted.min(quarter).max(need).max(1);
        (want, want < wanted)
    }
}
