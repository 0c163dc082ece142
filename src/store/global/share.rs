//! A region cut off from home (`GLOBAL_UNREACHABLE`). By default it spends what its pool and
//! slices hold and then denies: never over the limit. With `share`, once its pool is spent and
//! home does not answer a refill, the pool gets the region's stated share of the limit for the
//! window **on credit** ([`PoolOp::Credit`]): at most that share per window and region,
//! whatever its replicas do, so across regions what is admitted in a window is at most the
//! limit plus the shares of the regions cut off during it (`docs/semantics.md`).
//!
//! The credit is owed home. Once home answers again, the replica that holds the pool's refill
//! lease charges it there, before any refill and before the pool may go back home: a recording
//! charge, which never refuses, so home's counter holds what was admitted (over the limit if
//! the partition made it so), and later refills see it. A pool that owes is never drained:
//! credit refunded before it was charged would leave home short, under what was admitted.

use super::{grant_check, rand_token, GlobalGrants, PoolOp, REFILL_LEASE_MS};
use crate::store::{CounterKey, CounterStore, StoreError};

/// A part of every global limit, in millionths: above 0, at most the whole limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share(u32);

const WHOLE: u32 = 1_000_000;

impl Share {
    /// ⌊`limit` × share⌋: the units a region cut off may admit on credit per window.
    pub fn of(self, limit: u32) -> u64 {
        u64::from(limit) * u64::from(self.0) / u64::from(WHOLE)
    }
}

impl std::str::FromStr for Share {
    type Err = String;

    /// A decimal above 0 and at most 1, with at most six decimals (`0.33`, `1`).
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "expected the part of each global limit a region cut off from home may admit per \
                 window: a decimal above 0 and at most 1 with at most six decimals (0.33 for one \
                 of three regions), got {s:?}"
            )
        };
        let t = s.trim();
        let (whole, frac) = t.split_once('.').unwrap_or((t, ""));
        if whole.is_empty() && frac.is_empty()
            || frac.len() > 6
            || !whole
                .bytes()
                .chain(frac.bytes())
                .all(|b| b.is_ascii_digit())
            || whole.len() > 1
        {
            return Err(bad());
        }
        let whole: u32 = if whole.is_empty() {
            0
        } else {
            whole.parse().map_err(|_| bad())?
        };
        let part = (frac.bytes().chain(std::iter::repeat(b'0')))
            .take(6)
            .fold(0u32, |p, b| p * 10 + u32::from(b - b'0'));
        let millionths = whole.saturating_mul(WHOLE).saturating_add(part);
        if millionths == 0 || millionths > WHOLE {
            return Err(bad());
        }
        Ok(Share(millionths))
    }
}

impl GlobalGrants {
    /// `GLOBAL_UNREACHABLE=share`: a region cut off from home admits `share` of each global
    /// limit per window on credit, once its pool is spent. Set once, before serving.
    pub fn share_when_cut_off(&self, share: Share) {
        let _ = self.share.set(share);
    }

    /// What a refill home did not answer leaves in the pool: nothing (deny), or what is left of
    /// the window's share on credit; either way the lease is released and the pool is dry. A
    /// window that had not begun when the refill started (its pool filled ahead) gets no
    /// credit: it is not cut off yet, and its credit, settled only once home answers, could be
    /// spent after the link healed. Nor a token bucket (no window): a recording charge on a
    /// bucket is capped at its burst, so credit above it could never be charged home whole.
    pub(super) fn cut_off_fill(
        &self,
        key: &CounterKey,
        (window, begun): (Option<(u64, u64)>, bool),
        token: u64,
        dry_ms: u64,
    ) -> PoolOp {
        let windowed = window.is_some_and(|(_, end)| end != u64::MAX);
        match self.share.get().filter(|_| begun && windowed) {
            Some(s) => PoolOp::Credit {
                share: s.of(key.limit.requests_per_unit),
                token,
                dry_ms,
            },
            None => PoolOp::Fill {
                units: 0,
                token,
                dry_ms,
                fence: 0,
            },
        }
    }

    /// Whether `window` has begun (a token bucket's, with none, always has).
    pub(super) fn begun(&self, window: Option<(u64, u64)>) -> bool {
        window.is_none_or(|(start, _)| start / 1000 <= self.now_ms())
    }

    /// Whether a region cut off admits on credit.
    pub(super) fn shares(&self) -> bool {
        self.share.get().is_some()
    }

    /// Charges home the `owed` units of credit of `key`'s pool, whose refill lease the caller
    /// holds. If the pool's own call then fails, it still owes them and a later settlement
    /// charges them again: home over-counted, never under (never over the limit).
    pub(super) async fn settle(
        &self,
        key: &CounterKey,
        (window, window_ms): (Option<(u64, u64)>, u64),
        ttl: u64,
        owed: u64,
    ) -> Result<(), StoreError> {
        if owed == 0 {
            return Ok(());
        }
        let mut charge = grant_check(key, window, owed, false);
        charge.record = true;
        self.home.decide(std::slice::from_ref(&charge)).await?;
        self.tallies.settled.add(owed);
        self.tallies.home_answered(true, self.now_ms());
        let st = self
            .pool
            .run(key, window_ms, PoolOp::Settle(owed), ttl)
            .await?;
        self.seen(&st);
        Ok(())
    }

    /// Settles what `key`'s pool owes home, under its refill lease (taken here, released after):
    /// before the pool is drained home. `false`: something is still owed (home or the pool did
    /// not answer, or another replica holds the lease: its refill settles first).
    pub(super) async fn settle_owed(
        &self,
        key: &CounterKey,
        (window, window_ms): (Option<(u64, u64)>, u64),
        ttl: u64,
    ) -> bool {
        let look = PoolOp::Take(0);
        match self.pool.run(key, window_ms, look, ttl).await {
            Ok(st) if st.owed == 0 => return true,
            Ok(_) => {}
            Err(_) => return false,
        }
        let token = rand_token();
        let lock = PoolOp::Lock {
            token,
            lease_ms: REFILL_LEASE_MS,
        };
        let held = match self.pool.run(key, window_ms, lock, ttl).await {
            Ok(st) if st.ok == 1 => st,
            _ => return false,
        };
        let done = self
            .settle(key, (window, window_ms), ttl, held.owed)
            .await
            .is_ok();
        let release = PoolOp::Fill {
            units: 0,
            token,
            dry_ms: 0,
            fence: 0,
        };
        let _ = self.pool.run(key, window_ms, release, ttl).await;
        done
    }
}
