//! What a replica owes the store after deciding alone: per counter, the hits it charged locally
//! less what the store turned out to have charged itself (a call that answered after its caller
//! was answered locally), for windows still open. A write-back takes an entry's amount under a
//! token; until the store confirms it, the same amount goes again under the same token (the
//! script applies a token once), so a retry never charges twice, and hits charged meanwhile
//! wait for the next write-back.

use crate::store::CounterKey;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// One counter's debt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Owed {
    /// Hits owed and not yet sent (negative: hits to give back).
    amount: i64,
    /// When the window these hits count in closes (microseconds since the epoch): past it they
    /// no longer matter and are dropped.
    until_us: u64,
    /// A pinned window's `[start, end)` (a calendar's, a leased limit's: `LimitCheck::window`),
    /// the one the entry's hits are written back into; `None`: the epoch-aligned window. A
    /// write-back without it would charge another counter than the one the hits were decided
    /// on (a calendar day in New York is not the epoch's day).
    window: Option<(u64, u64)>,
    /// A write-back sent and not yet confirmed: its amount, its token, whether an attempt is
    /// under way now, and when the window of its hits closed at its first attempt. Retries go
    /// under the same token until then only: the store's guard of the token lives at least
    /// that long (review A6), and past it those hits count in no window any more.
    sending: Option<(i64, u64, bool, u64)>,
}

/// A write-back to send: the counter, the hits (negative: give back), the token that makes it
/// apply once, when its window closes, and its pinned window if it has one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Send {
    pub key: CounterKey,
    pub amount: i64,
    pub token: u64,
    pub until_us: u64,
    pub window: Option<(u64, u64)>,
}

/// Why a counter cannot go to the store now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Busy {
    /// Another request is writing this counter back: wait for it (`attempt_ended`).
    Sending,
}

/// The debts, bounded: a full ledger makes room by evicting a smaller debt (a sample of them), or
/// records no new counter; what is lost is counted as dropped.
#[derive(Debug)]
pub struct Ledger {
    owed: Mutex<HashMap<CounterKey, Owed>>,
    len: AtomicUsize,
    max: usize,
    next_token: std::sync::atomic::AtomicU64,
    /// Hits not recorded because the ledger was full.
    pub dropped: std::sync::atomic::AtomicU64,
    /// Woken whenever an attempt ends (confirmed or failed): a request on a counter being
    /// written back waits for it rather than deciding locally (review B4).
    pub attempt_ended: tokio::sync::Notify,
}

impl Ledger {
    pub fn new(max: usize) -> Self {
        Self {
            owed: Mutex::new(HashMap::new()),
            len: AtomicUsize::new(0),
            max,
            next_token: std::sync::atomic::AtomicU64::new(1),
            dropped: std::sync::atomic::AtomicU64::new(0),
            attempt_ended: tokio::sync::Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<CounterKey, Owed>> {
        // Plain data always left consistent: a panic elsewhere does not make it unusable.
        self.owed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether anything is owed (one atomic load: the healthy path's only cost).
    pub fn is_empty(&self) -> bool {
        self.len.load(Ordering::Acquire) == 0
    }

    pub fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    /// Adds `hits` (negative: taken off) to what `key` owes for the window closing at
    /// `until_us` (`window`: that window when it is pinned). A debt of a window that closed is
    /// forgotten first; hits of a window that closed join the open one (never fewer charged).
    pub fn add(
        &self,
        key: &CounterKey,
        hits: i64,
        until_us: u64,
        window: Option<(u64, u64)>,
        now_us: u64,
    ) {
        if hits == 0 {
            return;
        }
        let mut owed = self.lock();
        if let Some(o) = owed.get_mut(key) {
            if o.until_us <= now_us {
                *o = Owed {
                    window,
                    ..Owed::default()
                };
            }
            o.amount = o.amount.saturating_add(hits);
            o.until_us = o.until_us.max(until_us);
            return;
        }
        if owed.len() >= self.max {
            // What is lost: the smaller debt evicted, or this one.
            let lost = Self::evict_smaller(&mut owed, hits, now_us);
            self.dropped
                .fetch_add(lost.unwrap_or(hits.unsigned_abs()), Ordering::Relaxed);
            if lost.is_none() {
                return;
            }
        }
        owed.insert(
            key.clone(),
            Owed {
                amount: hits,
                until_us,
                window,
                sending: None,
            },
        );
        self.len.store(owed.len(), Ordering::Release);
    }

    /// A full ledger makes room for a debt of `hits` (review B6: a client sending many distinct
    /// values during an outage must not push real tenants' usage out): among a few entries (a
    /// sample, O(1)), one whose window closed, else the smallest debt not being sent, if it is
    /// smaller than `hits`; returns the hits it owed (0 for a closed window), `None` if none is.
    fn evict_smaller(owed: &mut HashMap<CounterKey, Owed>, hits: i64, now_us: u64) -> Option<u64> {
        const SAMPLE: usize = 8;
        let victim = owed
            .iter()
            .take(SAMPLE)
            .filter(|(_, o)| o.sending.is_none())
            .min_by_key(|(_, o)| (o.until_us > now_us, o.amount.unsigned_abs()))
            .filter(|(_, o)| o.until_us <= now_us || o.amount.unsigned_abs() < hits.unsigned_abs())
            .map(|(k, _)| k.clone());
        let o = owed.remove(&victim?)?;
        Some(if o.until_us <= now_us {
            0
        } else {
            o.amount.unsigned_abs()
        })
    }

    /// Takes what `key` owes for sending, if anything: `Ok(None)` when nothing is owed (the
    /// counter may go to the store), `Err(Busy)` while another attempt is under way. A
    /// write-back the store did not confirm goes again, with its token and amount.
    pub fn take(&self, key: &CounterKey, now_us: u64) -> Result<Option<Send>, Busy> {
        let mut owed = self.lock();
        let Some(o) = owed.get_mut(key) else {
            return Ok(None);
        };
        if o.until_us <= now_us {
            owed.remove(key);
            self.len.store(owed.len(), Ordering::Release);
            return Ok(None);
        }
        if o.sending
            .is_some_and(|(_, _, busy, until)| !busy && until <= now_us)
        {
            // Its hits count in no window any more: whether or not the store applied them,
            // nothing is owed for them (and a retry now could outlive its guard).
            o.sending = None;
        }
        let (amount, token, until_us) = match o.sending {
            Some((_, _, true, _)) => return Err(Busy::Sending),
            Some((amount, token, false, until)) => (amount, token, until),
            None if o.amount == 0 => {
                owed.remove(key);
                self.len.store(owed.len(), Ordering::Release);
                return Ok(None);
            }
            None => {
                let token = self.next_token.fetch_add(1, Ordering::Relaxed);
                // At most what one script call takes (2^40 hits); the rest stays owed for the
                // next write-back.
                let most = i64::try_from(crate::algorithm::MAX_HITS).unwrap_or(i64::MAX);
                let amount = o.amount.clamp(-most, most);
                o.amount -= amount;
                (amount, token, o.until_us)
            }
        };
        o.sending = Some((amount, token, true, until_us));
        Ok(Some(Send {
            key: key.clone(),
            amount,
            token,
            until_us,
            window: o.window,
        }))
    }

    /// The store confirmed `send`: the debt is paid (hits charged since stay owed).
    pub fn confirm(&self, send: &Send) {
        let mut owed = self.lock();
        if let Some(o) = owed.get_mut(&send.key) {
            if o.sending.is_some_and(|(_, t, _, _)| t == send.token) {
                o.sending = None;
            }
            if o.sending.is_none() && o.amount == 0 {
                owed.remove(&send.key);
            }
        }
        self.len.store(owed.len(), Ordering::Release);
        drop(owed);
        self.attempt_ended.notify_waiters();
    }

    /// `send` got no confirmation (an error, or no answer in time): it stays owed under its
    /// token, for the next attempt, which the script applies at most once.
    pub fn fail(&self, send: &Send) {
        let mut owed = self.lock();
        if let Some(o) = owed.get_mut(&send.key) {
            if let Some((a, t, _, u)) = o.sending {
                if t == send.token {
                    o.sending = Some((a, t, false, u));
                }
            }
        }
        drop(owed);
        self.attempt_ended.notify_waiters();
    }

    /// `send` is under way: the attempt ends as failed unless it is confirmed or failed first.
    pub fn attempt<'a>(&'a self, send: &'a Send) -> Attempt<'a> {
        Attempt {
            ledger: self,
            send: Some(send),
        }
    }

    /// Counters owing something (at most `max`): what the background write-back walks.
    pub fn keys(&self, max: usize) -> Vec<CounterKey> {
        self.lock().keys().take(max).cloned().collect()
    }
}

/// A write-back under way. Its caller may be cancelled at any await (tonic drops a request's
/// handler at the caller's `grpc-timeout` or on RST_STREAM: Envoy gives up at 20 ms on a busy
/// machine): dropped unended, the attempt ends as failed, so the next request or the background
/// pass sends it again under its token (the script applies it once) instead of every request
/// on the counter waiting for an attempt that will never end and deciding locally until the
/// window closes (seen through Envoy: a replica stayed local for 37 s after a Cluster failover,
/// and Redis admitted its share a second time).
pub struct Attempt<'a> {
    ledger: &'a Ledger,
    send: Option<&'a Send>,
}

impl Attempt<'_> {
    /// The store confirmed it: the debt is paid.
    pub fn confirm(mut self) {
        if let Some(s) = self.send.take() {
            self.ledger.confirm(s);
        }
    }

    /// No confirmation: it stays owed under its token.
    pub fn fail(mut self) {
        if let Some(s) = self.send.take() {
            self.ledger.fail(s);
        }
    }
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.send.take() {
            self.ledger.fail(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review B6: a ledger filled with one-hit debts (a client sending distinct values) still
    /// records a real tenant's larger debt, losing one of the small ones; a debt no larger than
    /// any sampled is the one dropped.
    #[test]
    fn a_full_ledger_keeps_the_larger_debt() {
        let l = Ledger::new(4);
        for i in 0..4 {
            l.add(&key(&format!("junk{i}")), 1, 100, None, 0);
        }
        l.add(&key("tenant"), 50, 100, None, 0);
        assert_eq!(l.len(), 4);
        assert_eq!(l.dropped.load(Ordering::Relaxed), 1, "one junk hit lost");
        assert!(matches!(l.take(&key("tenant"), 1), Ok(Some(s)) if s.amount == 50));
        l.add(&key("more-junk"), 1, 100, None, 0);
        assert_eq!(
            l.dropped.load(Ordering::Relaxed),
            2,
            "no smaller debt: this one"
        );
    }
    use crate::config::{Limit, Unit};
    use crate::store::LimitCheck;

    fn key(v: &str) -> CounterKey {
        LimitCheck::for_tests("d", v, Limit::fixed(10, Unit::Minute), 1).key
    }

    #[test]
    fn a_retry_reuses_the_token_and_new_hits_wait_for_the_next_write_back() {
        let l = Ledger::new(10);
        let k = key("a");
        l.add(&k, 3, 100, None, 0);
        let s = l.take(&k, 1).unwrap().unwrap();
        assert_eq!(s.amount, 3);
        // While it is under way the counter stays local and new hits are kept apart.
        assert_eq!(l.take(&k, 1), Err(Busy::Sending));
        l.add(&k, 2, 100, None, 1);
        l.fail(&s);
        let again = l.take(&k, 2).unwrap().unwrap();
        assert_eq!((again.amount, again.token), (3, s.token));
        l.confirm(&again);
        let next = l.take(&k, 3).unwrap().unwrap();
        assert_eq!(next.amount, 2);
        assert_ne!(next.token, s.token);
        l.confirm(&next);
        assert!(l.is_empty());
    }

    #[test]
    fn a_retry_never_outlives_the_window_its_hits_count_in() {
        // Review A6: a sliding window's entry lives on while local decisions add to it; a
        // write-back whose reply was lost must not be resent under its token after the guard
        // (set for the first attempt's window, plus a minute) may be gone.
        let l = Ledger::new(10);
        let k = key("a");
        l.add(&k, 3, 100, None, 0);
        let first = l.take(&k, 1).unwrap().unwrap();
        assert_eq!(first.until_us, 100);
        l.fail(&first);
        // The partition goes on; hits decided locally keep the entry alive past 100.
        l.add(&k, 2, 250, None, 90);
        let again = l.take(&k, 160).unwrap().unwrap();
        assert_ne!(
            again.token, first.token,
            "the first token's window closed at 100"
        );
        assert_eq!((again.amount, again.until_us), (2, 250));
        // Within its window a retry keeps its token and its window (the guard's lifetime).
        l.fail(&again);
        l.add(&k, 1, 300, None, 170);
        let retry = l.take(&k, 180).unwrap().unwrap();
        assert_eq!(
            (retry.token, retry.amount, retry.until_us),
            (again.token, 2, 250)
        );
    }

    #[test]
    fn a_write_back_sends_at_most_what_one_script_call_takes() {
        let l = Ledger::new(10);
        let k = key("a");
        let max = crate::algorithm::MAX_HITS as i64;
        // A caller's hits_addend of u32::MAX, 300 times in one local window.
        for _ in 0..300 {
            l.add(&k, i64::from(u32::MAX), 100, None, 0);
        }
        let owed = 300 * i64::from(u32::MAX);
        let s = l.take(&k, 1).unwrap().unwrap();
        assert_eq!(s.amount, max, "one write-back carries at most 2^40");
        l.confirm(&s);
        let s = l.take(&k, 1).unwrap().unwrap();
        assert_eq!(s.amount, owed - max, "the rest goes next");
        l.confirm(&s);
        assert!(l.is_empty());
    }

    #[test]
    fn a_closed_window_is_forgotten_and_the_ledger_is_bounded() {
        let l = Ledger::new(2);
        l.add(&key("a"), 1, 100, None, 0);
        l.add(&key("b"), 1, 100, None, 0);
        l.add(&key("c"), 5, 100, None, 0);
        assert_eq!(l.len(), 2);
        assert_eq!(
            l.dropped.load(Ordering::Relaxed),
            1,
            "a smaller debt made room"
        );
        l.add(&key("d"), 1, 100, None, 0);
        assert_eq!(
            l.dropped.load(Ordering::Relaxed),
            2,
            "bounded: no room for d"
        );
        assert_eq!(l.take(&key("c"), 100), Ok(None));
        assert_eq!(l.len(), 1);
    }
}
