//! sliding_log's state: the charges within the period, oldest first, with their running total.
//! The decision math is in the parent module; this is the log's own bookkeeping (trim, push,
//! record, refund, a reservation's give-back, and the walk to a denial's retry time).
//!
//! Each entry has an id, so a reservation can give back on its own entry. A new entry's id is
//! one past the newest entry's (in an empty log, its time: so ids keep rising across periods
//! while a log takes less than one entry per microsecond, and a Redis undo by id never meets
//! an expired entry's); a recorded charge that joins the newest entry keeps its id. decide.lua
//! assigns ids by the same rule, so both stores shrink the same entry.

use super::MAX_COUNT;
use std::collections::VecDeque;

/// sliding_log's admitted charges, oldest first, as (time, hits, id), and their running total.
/// One entry per charge, not per hit, so a `hits_addend` of 60 000 is one entry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Log {
    pub(super) entries: VecDeque<(u64, u64, u64)>,
    pub(super) total: u64,
}

impl Log {
    #[cfg(test)]
    pub fn from_entries(entries: impl IntoIterator<Item = (u64, u64)>) -> Self {
        let mut log = Log::default();
        for (t, h) in entries {
            log.push(t, h);
        }
        log
    }

    /// The newest entry's time.
    pub(super) fn newest(&self) -> Option<u64> {
        self.entries.back().map(|&(t, _, _)| t)
    }

    /// The id of the newest entry: what a reservation charged on this log gives back on.
    pub fn newest_id(&self) -> u64 {
        self.entries.back().map_or(0, |&(_, _, id)| id)
    }

    /// Drops the charges at or before `horizon`: they no longer count.
    pub(super) fn trim(&mut self, horizon: u64) {
        while let Some(&(t, h, _)) = self.entries.front() {
            if t > horizon {
                break;
            }
            self.total -= h;
            self.entries.pop_front();
        }
    }

    pub(super) fn push(&mut self, t: u64, hits: u64) {
        let id = self.entries.back().map_or(t.max(1), |e| e.2 + 1);
        self.entries.push_back((t, hits, id));
        self.total += hits;
    }

    /// A recorded charge (`Mode::Record`), stamped no earlier than the newest entry. Once the
    /// log holds as many entries as the limit (at least one), the charge joins the newest entry
    /// instead, restamped: the count stays exact and the log never grows past the limit,
    /// however many over-limit charges are recorded (those hits then count a little longer).
    pub(super) fn record(&mut self, now: u64, hits: u64, limit: u64) {
        let t = self.newest().map_or(now, |t| t.max(now));
        let room = MAX_COUNT.saturating_sub(self.total);
        let hits = hits.min(room);
        let full = self.entries.len() as u64 >= limit.max(1);
        match self.entries.back_mut() {
            Some(last) if full => {
                last.0 = t;
                last.1 += hits;
                self.total += hits;
            }
            _ => self.push(t, hits),
        }
    }

    /// Gives `hits` back, newest charges first, touching at most `max_entries` entries.
    pub(super) fn refund(&mut self, hits: u64, max_entries: usize) {
        let mut left = hits;
        let mut touched = 0;
        while left > 0 && touched < max_entries {
            let Some(last) = self.entries.back_mut() else {
                break;
            };
            if last.1 <= left {
                left -= last.1;
                self.total -= last.1;
                self.entries.pop_back();
            } else {
                last.1 -= left;
                self.total -= left;
                left = 0;
            }
            touched += 1;
        }
    }

    /// A reservation's give-back: up to `hits` taken off the entry `id` (removed if that empties
    /// it), found among the newest `max_entries` entries; returns the hits given back (0: not
    /// found, and nothing is taken from any other entry). decide.lua rewrites the running total
    /// of every entry after it, hence the bound.
    pub fn give_back(&mut self, id: u64, hits: u64, max_entries: usize) -> u64 {
        let n = self.entries.len();
        let Some(at) = (n.saturating_sub(max_entries)..n)
            .rev()
            .find(|&i| self.entries.get(i).is_some_and(|e| e.2 == id))
        else {
            return 0;
        };
        let Some(e) = self.entries.get_mut(at) else {
            return 0;
        };
        let given = hits.min(e.1);
        e.1 -= given;
        self.total -= given;
        if e.1 == 0 {
            self.entries.remove(at);
        }
        given
    }

    /// When `need` of the oldest hits have left the period (a denial's retry time): the entry
    /// whose hits bring the total that left to `need`.
    pub(super) fn retry_after(&self, need: u64, period_us: u64, now: u64) -> u64 {
        let mut left = 0;
        self.entries
            .iter()
            .find(|&&(_, h, _)| {
                left += h;
                left >= need
            })
            .map_or(0, |&(t, _, _)| (t + period_us).saturating_sub(now))
    }
}
