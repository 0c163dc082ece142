//! How every replica learns of admin writes: it polls the store's admin generation (one `GET`
//! on Redis) every [`POLL_INTERVAL`]; when it moved, it reloads the overrides and drops its deny
//! cache (a reset or a raised limit must not be answered from a denial cached before it). At
//! most one interval after a write, every replica applies it (with a home store, the generation
//! and the overrides are home's: every region applies them). Expired overrides leave the
//! table at the next poll even when nothing was written.

use crate::service::RateLimiter;
use std::sync::Arc;
use std::time::Duration;

/// How often a replica polls: half a second, so every replica applies a write within one.
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// Loads the overrides now, whatever the generation, and drops the deny cache; with a home
/// store, applies the resets of global limits recorded there (`service/resets.rs`).
pub async fn reload(limiter: &Arc<RateLimiter>) {
    match limiter.counter_admin().overrides().await {
        Ok((generation, all)) => apply(limiter, generation, all),
        Err(e) => tracing::warn!(error = %e, "cannot load the admin overrides"),
    }
    if !limiter.apply_resets().await {
        // Read again at the next poll, whatever the generation says then: a reset whose
        // record went unread would leave the region's pools spending on the fresh count.
        limiter.overrides().unknown_generation();
    }
}

fn apply(
    limiter: &Arc<RateLimiter>,
    generation: u64,
    all: Vec<crate::store::admin::StoredOverride>,
) {
    let changed = limiter.overrides().generation() != Some(generation);
    let now = limiter.now_ms();
    // Every override held, those expired since the last poll too (gone now: moved).
    let before = limiter.overrides().list(0);
    let moved = moved(&before, &all, now);
    limiter.overrides().replace(generation, all, now);
    if !moved.is_empty() {
        limiter.overrides_moved(moved);
    }
    let live = limiter.overrides().list(limiter.now_ms()).len();
    limiter
        .telemetry()
        .metrics
        .admin
        .overrides_live
        .set(i64::try_from(live).unwrap_or(i64::MAX));
    if changed {
        limiter.forget_denials();
    }
}

/// The counters (domain, entries) whose override was set, changed, removed or expired between
/// `before` (every override held) and `after` (those live at `now_ms`).
fn moved(
    before: &[crate::store::admin::StoredOverride],
    after: &[crate::store::admin::StoredOverride],
    now_ms: u64,
) -> Vec<(String, Vec<(String, String)>)> {
    let limits = |all: &[crate::store::admin::StoredOverride], at: u64| {
        all.iter()
            .filter(|o| o.live(at))
            .map(|o| (o.id.clone(), o.limit))
            .collect::<std::collections::HashMap<_, _>>()
    };
    let (was, is) = (limits(before, 0), limits(after, now_ms));
    let mut out: Vec<_> = was
        .keys()
        .chain(is.keys())
        .filter(|id| was.get(*id) != is.get(*id))
        .map(|id| (id.domain.clone(), id.entries.clone()))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// One poll: reloads when the generation moved, or when a live override may have expired.
pub async fn poll_once(limiter: &Arc<RateLimiter>) {
    let generation = match limiter.counter_admin().generation().await {
        Ok(g) => g,
        Err(e) => {
            tracing::debug!(error = %e, "cannot poll the admin generation");
            return;
        }
    };
    if limiter.overrides().generation() != Some(generation) {
        reload(limiter).await;
    } else if limiter.overrides().is_active() {
        // Nothing written: drop what expired (the request path skips it already), so the
        // gauge and the request path's fast path follow.
        let now = limiter.now_ms();
        // Expired ones moved their counters back to the config's limit.
        let expired: Vec<_> = (limiter.overrides().list(0).into_iter())
            .filter(|o| !o.live(now))
            .map(|o| (o.id.domain, o.id.entries))
            .collect();
        let live = limiter.overrides().prune(now);
        if !expired.is_empty() {
            limiter.overrides_moved(expired);
        }
        limiter
            .telemetry()
            .metrics
            .admin
            .overrides_live
            .set(i64::try_from(live).unwrap_or(i64::MAX));
    }
}

/// Polls until the task is aborted (the server's background tasks are, at shutdown).
pub async fn watch(limiter: Arc<RateLimiter>) {
    let mut tick = tokio::time::interval(POLL_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        poll_once(&limiter).await;
    }
}
