//! How admin writes on global limits reach every region's slices and pools.
//!
//! A reset: the home store keeps a record of each
//! reset (`store/global/admin.rs`); each replica reads the records whenever the admin
//! generation moves (its poll, or its own write) and, for each it has not applied, empties its
//! slices and the pools it knows of the counters the reset covers, in the background (a pool
//! whose refill is under way is emptied once that refill's lease has run out).

use super::RateLimiter;
use std::sync::Arc;

impl RateLimiter {
    /// Applies the home store's reset records this replica has not applied yet; false when
    /// they could not be read (the caller reads them again at the next poll).
    pub async fn apply_resets(self: &Arc<Self>) -> bool {
        let Some(global) = &self.global else {
            return true;
        };
        let records = match self.admin.resets().await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the home store's reset records");
                return false;
            }
        };
        let all = records.clone();
        let fresh = global.unseen_resets(records);
        if fresh.is_empty() {
            return true;
        }
        let (global, slices) = (Arc::clone(global), self.slices.clone());
        tokio::spawn(async move {
            for reset in &fresh {
                let keep_from = reset.keep_from(&all);
                let sliced = slices.as_ref().map_or(0, |s| s.forget(reset, keep_from));
                let pooled = global.forget(reset, keep_from).await;
                tracing::info!(
                    domain = %reset.domain,
                    prefix = ?reset.prefix,
                    sliced,
                    pooled,
                    "a reset at home: this replica's slices and its region's pools emptied"
                );
                global.resets_applied(reset.seq);
            }
        });
        true
    }

    /// Overrides of these counters were set, changed or removed: this replica's slices of the
    /// global ones go back to the pool and the pools it knows back home, in the background
    /// (`store/global/admin.rs`), so what is spent next is granted on the limit in force.
    pub fn overrides_moved(self: &Arc<Self>, counters: Vec<(String, Vec<(String, String)>)>) {
        let Some(global) = &self.global else {
            return;
        };
        let (global, slices) = (Arc::clone(global), self.slices.clone());
        tokio::spawn(async move {
            for (domain, entries) in &counters {
                let sliced = slices
                    .as_ref()
                    .map_or(0, |s| s.give_back_overridden(domain, entries));
                let pooled = global.give_back_overridden(domain, entries).await;
                if sliced > 0 || pooled > 0 {
                    tracing::info!(
                        domain = %domain,
                        entries = ?entries,
                        sliced,
                        pooled,
                        "an override moved: this replica's slices and its region's pools given back"
                    );
                }
            }
        });
    }
}
