//! What global limits report (`sluice_global_*`, `telemetry/global_metrics.rs`): running
//! totals the grants keep, and the spell cut off from home running now.

use crate::store::Tally;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// What global limits report (`sluice_global_*`).
#[derive(Debug, Default)]
pub struct GlobalTallies {
    /// Refills home answered, and the units they brought.
    pub refills: Tally,
    pub refilled: Tally,
    /// Refills that failed (home did not answer in time).
    pub refill_failures: Tally,
    /// Sum of the refills' round trips to home, in microseconds, and the last one.
    pub refill_us: Tally,
    pub last_refill_us: AtomicU64,
    /// Units given back home (idle pools).
    pub returned: Tally,
    /// Of those, units of idle pools given back because another region was short of them.
    pub moved: Tally,
    /// Units left unspent in pools whose window ended.
    pub stranded: Tally,
    /// Units a give-back home returned that home refused: drained from a pool not cleared
    /// since a reset of their counter (`admin.rs`: on the count the reset forgot).
    pub forgiven: Tally,
    /// Units added to this region's pools on credit while cut off from home
    /// (`GLOBAL_UNREACHABLE=share`), and units of credit charged at home once it answered.
    pub shared: Tally,
    pub settled: Tally,
    /// Units this region's pools held at the last operation this replica saw.
    pub pool_held: AtomicU64,
    /// Time cut off from home as this replica's refills saw it, in ms: from a refill home did
    /// not answer to the next one it did (ended spells; the one running is `cut_since_ms`).
    pub cut_off_ms: Tally,
    /// When the spell cut off from home running now began (the clock's ms), 0: none.
    pub cut_since_ms: AtomicU64,
    /// The region this replica serves (`REGION`), the metrics' `region` label.
    pub region: std::sync::OnceLock<String>,
    /// Pools watched at the near-dry tick now (`drain.rs`: capped).
    pub fast_watches: std::sync::atomic::AtomicUsize,
    /// When home last answered this replica (its clock, ms; 0: never).
    pub heard_ms: AtomicU64,
}

impl GlobalTallies {
    /// Time cut off from home up to `now_ms` (the clock's), the running spell included.
    pub fn cut_off_ms_at(&self, now_ms: u64) -> u64 {
        let since = self.cut_since_ms.load(Relaxed);
        let running = if since == 0 {
            0
        } else {
            now_ms.saturating_sub(since)
        };
        self.cut_off_ms.get().saturating_add(running)
    }

    /// A refill home answered (`true`) or did not, at `now_ms`: ends or begins a spell.
    pub(super) fn home_answered(&self, answered: bool, now_ms: u64) {
        if answered {
            self.heard(now_ms);
            let since = self.cut_since_ms.swap(0, Relaxed);
            if since != 0 {
                self.cut_off_ms.add(now_ms.saturating_sub(since));
            }
        } else {
            let _ = self
                .cut_since_ms
                .compare_exchange(0, now_ms.max(1), Relaxed, Relaxed);
        }
    }

    /// Home answered a call of this replica at `now_ms` (a refill, a refund, a report).
    pub(super) fn heard(&self, now_ms: u64) {
        self.heard_ms.fetch_max(now_ms, Relaxed);
    }

    /// Home answered this replica within `ms` of `now_ms`.
    pub(super) fn heard_within(&self, now_ms: u64, ms: u64) -> bool {
        // Not while a spell cut off runs: a refill failed since home last answered.
        let at = self.heard_ms.load(Relaxed);
        self.cut_since_ms.load(Relaxed) == 0 && at != 0 && now_ms.saturating_sub(at) < ms
    }
}
