//! Taking a request's hits from its slice: decided from the units held, or waiting (within the
//! request's deadline) for the one refill in flight, and the refill itself (a grant from the
//! store, or for a global limit from the region's pool: `store/global`).

use super::{grant_check, slice_window, Entry, Refill, Slice, Slices, Take, UNPINNED};
use crate::store::{CounterKey, CounterStore, LimitCheck};
use std::sync::Arc;
use std::time::Duration;

/// Refill attempts one request waits for before it is decided as an ordinary check.
const MAX_WAITS: usize = 3;

/// Settles a slice's refill when its task ends, however it ends: a refill cancelled or
/// panicking must not leave its waiters, and the give-back at shutdown, waiting for a refill
/// that never lands (it then counts as failed).
struct Settles {
    /// `None` once settled.
    entry: Option<Arc<Entry>>,
    /// The window the refill is for.
    window: (u64, u64),
}

impl Settles {
    fn settle(&mut self, ok: bool, window: (u64, u64)) {
        let Some(entry) = self.entry.take() else {
            return;
        };
        {
            let mut s = entry.slice.lock().unwrap_or_else(|p| p.into_inner());
            // A refill of a window that has passed settles nothing of the next one's: its own
            // refill (if one runs) clears these when it lands.
            if s.window == window {
                s.refill = if ok { Refill::Idle } else { Refill::Failed };
            }
        }
        entry.done.send_modify(|v| *v = v.wrapping_add(1));
    }
}

impl Drop for Settles {
    fn drop(&mut self) {
        self.settle(false, self.window);
    }
}

impl Slices {
    /// Takes `check.hits` from its slice, waiting for a refill (by `deadline`) when short.
    /// `now`: the request's time (read again after a wait). A `deny` override denies at once.
    pub(super) async fn take(
        self: &Arc<Self>,
        check: &LimitCheck,
        deadline: Option<tokio::time::Instant>,
        now: u64,
    ) -> Take {
        if check.admin_limit == Some(0) {
            // An admin override denies this counter: not a unit of a slice is spent.
            let window = slice_window(check).unwrap_or(UNPINNED);
            let entry = self.entry(check, window, now);
            let s = entry.slice.lock().unwrap_or_else(|p| p.into_inner());
            let mut denied = s.taken(&entry, false);
            denied.remaining = 0; // nothing is left to this counter under `deny`
            return Take::Done(denied);
        }
        let taken = self.take_or_down(check, deadline, now).await;
        match taken {
            // A global limit has no regional counter to go down to (that one would be a limit
            // of its own, per region): what its slices cannot admit is denied.
            Take::Down if check.slice.is_some_and(|t| t.global) => {
                let window = slice_window(check).unwrap_or(UNPINNED);
                let entry = self.entry(check, window, self.now_us());
                let s = entry.slice.lock().unwrap_or_else(|p| p.into_inner());
                Take::Done(s.taken(&entry, false))
            }
            t => t,
        }
    }

    async fn take_or_down(
        self: &Arc<Self>,
        check: &LimitCheck,
        deadline: Option<tokio::time::Instant>,
        now: u64,
    ) -> Take {
        let (Some(window), Some(terms)) = (slice_window(check), check.slice) else {
            return Take::Down;
        };
        for wait in 0..MAX_WAITS {
            let now = if wait == 0 { now } else { self.now_us() };
            let entry = self.entry(check, window, now);
            let (rx, start) = {
                let mut s = entry.slice.lock().unwrap_or_else(|p| p.into_inner());
                if s.window != window {
                    if s.window.0 > window.0 {
                        return Take::Down; // an older window than the slice's: the store decides
                    }
                    self.tallies.stranded.add(s.left);
                    *s = Slice::fresh(window, now);
                }
                s.touched_us = now;
                if s.left >= check.hits {
                    s.left -= check.hits;
                    s.spent += check.hits;
                    let ahead = s.refill != Refill::Running
                        && s.left < s.last_grant / 2
                        && now >= s.dry_until_us;
                    let next = s.next_window_due(&entry, now);
                    let taken = s.taken(&entry, true);
                    if ahead {
                        s.refill = Refill::Running;
                    }
                    drop(s);
                    if ahead {
                        self.refill_in_background(&entry, check, terms, 1);
                    }
                    self.next_window_ahead(check, next);
                    return Take::Done(taken);
                }
                // Dry: the store had less than these hits at the last grant (a request that
                // fits what it had left still asks).
                let had = s.left.saturating_add(s.store_left);
                if now < s.dry_until_us && check.hits > had {
                    return Take::Done(s.dry_taken(&entry));
                }
                if s.refill == Refill::Failed {
                    s.refill = Refill::Idle;
                    drop(s);
                    return self.unreachable(&entry);
                }
                let start = s.refill == Refill::Idle;
                s.refill = Refill::Running;
                (entry.done.subscribe(), start)
            };
            if wait == 0 && terms.global {
                // Demand the slice could not meet: a global limit's refill is sized on it
                // while its region's pool is dry (`store/global`).
                if let Some(g) = &self.global {
                    g.wanted(check);
                }
            }
            if start {
                self.refill_in_background(&entry, check, terms, check.hits);
            }
            self.tallies.waited.add(1);
            if !settled(&entry, rx, window, deadline).await {
                return self.unreachable(&entry);
            }
        }
        Take::Down
    }

    /// A global limit's slice spent from in its window's last seconds: the region's pool of
    /// the next window is filled ahead now, whether or not this replica's slice needs a grant
    /// before the window ends (a large slice can last the window: with only the grants' own
    /// trigger, every window's first requests waited a refill's round trip to home, 300 ms at
    /// 150 ms, a p99 of 229 ms in each 8 s bench round that crossed a minute).
    fn next_window_ahead(&self, check: &LimitCheck, due: bool) {
        if let (true, Some(g)) = (due, &self.global) {
            g.ahead_of_window(check);
        }
    }

    /// Starts the slice's refill (the caller set it `Running`): a task of its own, so a request
    /// that stops waiting (its deadline) never loses what the store granted.
    fn refill_in_background(
        self: &Arc<Self>,
        entry: &Arc<Entry>,
        check: &LimitCheck,
        terms: crate::config::Leasing,
        need: u64,
    ) {
        let (me, entry, key) = (Arc::clone(self), Arc::clone(entry), check.key.clone());
        let admin = check.admin_limit;
        let window = entry.slice.lock().unwrap_or_else(|p| p.into_inner()).window;
        let mut settles = Settles {
            entry: Some(Arc::clone(&entry)),
            window,
        };
        // On the slices' own runtime: a serving thread's would cancel it at shutdown, losing
        // what the store granted and leaving the give-back waiting for it.
        self.background.spawn(async move {
            let (ok, window) = me.refill(&entry, (&key, admin), terms, need).await;
            settles.settle(ok, window);
        });
    }

    /// One grant: the replica's demand, what is left when less (a second call), or nothing
    /// (the slice is dry until `ahead` has passed: other replicas may give units back).
    /// Returns whether the store answered, and the window the refill was for.
    async fn refill(
        &self,
        entry: &Entry,
        (key, admin): (&CounterKey, Option<u32>),
        terms: crate::config::Leasing,
        need: u64,
    ) -> (bool, (u64, u64)) {
        let now = self.now_us();
        let (want, window) = {
            let s = entry.slice.lock().unwrap_or_else(|p| p.into_inner());
            (s.want(need, now, terms), s.window)
        };
        let mut ask = want;
        for _ in 0..2 {
            let mut check = grant_check(key, window, ask, false);
            // Granted on the admin override in force, if any (global limits only: a leased
            // limit's overridden checks are decided on the store).
            check.admin_limit = admin;
            if entry.global {
                // The region's pool sizes its refills from home on the limit's terms.
                check.slice = Some(terms);
            }
            let Some(grants) = self.grants(entry.global) else {
                return (false, window); // a global limit with no pool: denied, never regional
            };
            let Ok(d) = grants.decide(std::slice::from_ref(&check)).await else {
                return (false, window);
            };
            self.tallies.grants.add(1);
            let Some(o) = d.outcomes.first() else {
                return (false, window);
            };
            let mut s = entry.slice.lock().unwrap_or_else(|p| p.into_inner());
            if s.window != window {
                return (true, window); // the window moved on while the grant was out: stranded
            }
            s.store_left = u64::from(o.remaining);
            let reset_us = u64::try_from(o.reset.as_micros()).unwrap_or(u64::MAX);
            s.full_at_us = now.saturating_add(reset_us);
            s.cut_off = !o.allowed && d.at == crate::store::DecidedAt::Fallback;
            if o.allowed {
                self.tallies.granted.add(ask);
                let cleared = grants.cleared(&check);
                if cleared > s.cleared {
                    // The pool was cleared for a reset since the slice's last grant: what the
                    // slice held is on the count home forgot (dropped, as the reset's clear
                    // would), and what it holds from now on is kept by that clear.
                    s.left = 0;
                    s.cleared = cleared;
                }
                s.left += ask;
                s.last_grant = ask;
                s.spent = 0;
                s.since_us = self.now_us();
                return (true, window);
            }
            let left = u64::from(o.remaining);
            if left == 0 || left < need.saturating_sub(s.left) || o.retry_after == Duration::MAX {
                let ahead_us = terms.ahead.millis().saturating_mul(1000);
                s.dry_until_us = window.1.min(now.saturating_add(ahead_us));
                return (true, window);
            }
            ask = left;
        }
        (true, window)
    }
}

/// Woken when this window's refill is done (judged by the slice's state, which a refill
/// settles under the lock before it signals: a stale refill of an older window landing
/// meanwhile neither wakes it early nor hides the wake-up); false past `deadline`.
async fn settled(
    entry: &Entry,
    mut rx: tokio::sync::watch::Receiver<u64>,
    window: (u64, u64),
    deadline: Option<tokio::time::Instant>,
) -> bool {
    let changed = async {
        loop {
            rx.changed().await?;
            if entry.settled_for(window) {
                return Ok::<(), tokio::sync::watch::error::RecvError>(());
            }
        }
    };
    let got = match deadline {
        Some(d) => tokio::time::timeout_at(d, changed).await.ok(),
        None => Some(changed.await),
    };
    matches!(got, Some(Ok(())))
}
