//! Giving the store back what was decided without it: the debt of a request's counters
//! written back before the store decides them again, the background pass for counters nobody
//! asks about again, late store answers taken off the debt, and the probe that tells when the
//! store is back. Each write-back is applied at most once (its token guards it in the store).

use super::{ledger, Shared};
use crate::store::{charged, Decision, LimitCheck};
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::time::Instant;

/// Counters the background task writes back per tick.
const WRITE_BACK_PER_TICK: usize = 1024;

impl Shared {
    /// A store call that answered after its caller was answered locally: what it charged is
    /// already in the store, so it is taken off the debt of the window it was asked in
    /// (`asked_us`: a window that has closed since owes nothing any more, and the next one
    /// must not be refunded hits it never had, review B7).
    pub(super) fn reconcile(&self, checks: &[LimitCheck], d: &Decision, asked_us: u64) {
        let allowed: Vec<bool> = d.outcomes.iter().map(|o| o.allowed).collect();
        self.reconcile_charged(checks, &charged(checks, &allowed, d.admitted), asked_us);
    }

    /// [`Shared::reconcile`] for the checks `was` marks as charged in the store.
    pub(super) fn reconcile_charged(&self, checks: &[LimitCheck], was: &[bool], asked_us: u64) {
        let now_us = self.now_us();
        for (c, &was) in checks.iter().zip(was) {
            if was && super::local::owes(c) {
                let hits = i64::try_from(c.hits).unwrap_or(i64::MAX);
                let hits = if c.refund { hits } else { -hits };
                let until = Self::until_us(c, asked_us);
                if until > now_us {
                    self.ledger.add(&c.key, hits, until, c.window, now_us);
                }
            }
        }
        // Not learned from: it predates the local decisions made meanwhile, and a share of
        // what it says was left would admit them a second time.
    }

    /// Writes back what the request's counters owe before the store decides them; false if it
    /// could not (the request is then decided locally).
    pub(super) async fn settle(&self, checks: &[LimitCheck], give_up: Instant) -> bool {
        for (i, c) in checks.iter().enumerate() {
            if checks[..i].iter().any(|p| p.key == c.key) {
                continue;
            }
            loop {
                // Registered before the look, so an attempt that ends in between still wakes it.
                let ended = self.ledger.attempt_ended.notified();
                tokio::pin!(ended);
                ended.as_mut().enable();
                match self.ledger.take(&c.key, self.now_us()) {
                    Ok(None) => break,
                    Ok(Some(send)) => {
                        if !self.send(send, give_up).await {
                            return false;
                        }
                        break;
                    }
                    // Another request is writing it back: wait for that, within our time
                    // (review B4: deciding locally would only owe more on a hot key).
                    Err(ledger::Busy::Sending) => {
                        if tokio::time::timeout_at(give_up, ended).await.is_err() {
                            return false;
                        }
                    }
                }
            }
        }
        true
    }

    /// One write-back: the counter records (or gives back) the owed hits, once per token.
    async fn send(&self, send: ledger::Send, give_up: Instant) -> bool {
        let check = LimitCheck {
            key: send.key.clone(),
            hits: send.amount.unsigned_abs(),
            refund: send.amount < 0,
            shadow: false,
            quota: false,
            record: true,
            stop_over: false,
            admin_limit: None,
            // The window the hits were decided in: a calendar's (or a leased limit's) counter
            // is keyed by it, and without it they would land on the epoch-aligned window's.
            window: send.window,
            lease: None,
            leased: false,
            slice: None,
            candidate: false,
        };
        let token = format!("{}-{}", self.id, send.token);
        let now_us = self.now_us();
        // The guard outlives every retry: the window, and a minute for clocks that disagree.
        let ttl =
            Duration::from_micros(send.until_us.saturating_sub(now_us)) + Duration::from_secs(60);
        let checks = [check];
        let started = Instant::now();
        let attempt = self.ledger.attempt(&send);
        let r = tokio::time::timeout_at(give_up, self.inner.write_back(&checks, &token, ttl)).await;
        match r {
            Ok(Ok(())) => {
                attempt.confirm();
                self.tallies.write_backs.add(1);
                true
            }
            Ok(Err(e)) => {
                attempt.fail();
                self.tallies.write_back_failures.add(1);
                if e.is_transient() {
                    self.suspect_now(&checks);
                }
                false
            }
            Err(_) => {
                attempt.fail();
                self.tallies.write_back_failures.add(1);
                // A write-back cut short by its caller's deadline says nothing about the store;
                // one that ran the store's whole budget does.
                if started.elapsed() >= self.settings.budget {
                    self.suspect_now(&checks);
                }
                false
            }
        }
    }

    /// While the store is down, asks it (a PING through the breaker, which it also closes)
    /// once `retry_every` has passed since it last failed; requests use it again once it
    /// answers.
    pub(super) async fn probe(&self) {
        if !self.suspect() || self.mono_us() < self.suspect_until_us.load(Ordering::Relaxed) {
            return;
        }
        let answered = tokio::time::timeout(self.settings.budget, self.inner.probe()).await;
        if answered == Ok(true) {
            self.down.store(false, Ordering::Relaxed);
        }
    }

    /// The background write-back: counters nobody asks about again are written back too.
    pub(super) async fn write_back_all(&self) {
        if self.ledger.is_empty() || self.suspect() {
            return;
        }
        for key in self.ledger.keys(WRITE_BACK_PER_TICK) {
            let now_us = self.now_us();
            let like = LimitCheck {
                key,
                hits: 0,
                refund: false,
                shadow: false,
                quota: false,
                record: true,
                stop_over: false,
                admin_limit: None,
                window: None,
                lease: None,
                leased: false,
                slice: None,
                candidate: false,
            };
            if self.skip_store(std::slice::from_ref(&like)) {
                continue;
            }
            let Ok(Some(send)) = self.ledger.take(&like.key, now_us) else {
                continue;
            };
            let give_up = Instant::now() + self.settings.budget;
            // One store down: the rest waits for the next tick. One slot down: the others go on.
            if !self.send(send, give_up).await && self.settings.whole_store {
                return;
            }
        }
        if self.settled() && !self.suspect() {
            self.end_episode();
        }
    }
}
