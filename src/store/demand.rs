//! Demand boards: where the quota service's streams post what they want of one counter, so
//! streams served by different replicas share a limit fairly. A replica sees only its own RLQS
//! streams, but every replica posts on the board of the counter in the store the counters live
//! in (this process for the memory store, Redis for the Redis store), and reads everyone's
//! posting back in the same call: each stream's demand (requests per second, measured on
//! sluice's clock) and the tokens reserved for it on the counter and not yet reconciled.
//!
//! A posting lives for the freshness the poster gives it (a few report periods): a stream that
//! dies without withdrawing drops off by itself. Boards are bounded: [`MAX_POSTINGS_PER_BOARD`]
//! streams per counter, and the memory board [`DEFAULT_MAX_POSTINGS`] postings overall; a
//! posting that finds no room is not kept (the caller sees its own posting missing and counts
//! it), so no client can grow a board without limit.

use super::{BoxFuture, CounterKey, StoreError};
use crate::clock::{Clock, SystemClock};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Streams one counter's board holds (Envoys sharing one key; past it a stream shares the
/// limit as if it did not exist: its demand is not counted, its reservation still is).
pub const MAX_POSTINGS_PER_BOARD: usize = 1_000;

/// Postings the memory board holds across all counters.
pub const DEFAULT_MAX_POSTINGS: usize = 100_000;

/// One stream's line on a counter's board.
#[derive(Debug, Clone, PartialEq)]
pub struct Posting {
    /// Unique across replicas (a per-process nonce and the stream's number).
    pub stream: Arc<str>,
    /// Requests per second it measured; `None` until a second report measured it.
    pub rate: Option<f64>,
    /// Tokens reserved for it on the counter and not yet reconciled with its reports.
    pub reserved: u64,
}

/// Where a stream posts its demand on a counter and reads everyone else's.
pub trait DemandBoard: Send + Sync + std::fmt::Debug {
    /// Posts `mine` on `key`'s board for `fresh`, drops postings past their time, and returns
    /// every live posting (`mine` among them unless the board had no room for it).
    fn post<'a>(
        &'a self,
        key: &'a CounterKey,
        mine: &'a Posting,
        fresh: Duration,
    ) -> BoxFuture<'a, Result<Vec<Posting>, StoreError>>;

    /// Takes `stream`'s posting off `key`'s board (its bucket was abandoned or its stream ended).
    fn withdraw<'a>(
        &'a self,
        key: &'a CounterKey,
        stream: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
}

/// A posting and when it expires (on the board's clock).
#[derive(Debug, Clone)]
struct Line {
    rate: Option<f64>,
    reserved: u64,
    expires: Duration,
}

/// The board in this process: correct for one replica (the memory store's counters are per
/// process too).
#[derive(Debug)]
pub struct MemoryBoard {
    clock: Arc<dyn Clock>,
    max_postings: usize,
    boards: Mutex<Boards>,
}

#[derive(Debug, Default)]
struct Boards {
    by_counter: HashMap<CounterKey, HashMap<Arc<str>, Line>>,
    postings: usize,
}

impl Boards {
    /// Drops every expired posting (only when the board is full: amortised over the inserts).
    fn sweep(&mut self, now: Duration) {
        let mut postings = 0;
        self.by_counter.retain(|_, lines| {
            lines.retain(|_, l| l.expires > now);
            postings += lines.len();
            !lines.is_empty()
        });
        self.postings = postings;
    }
}

impl MemoryBoard {
    pub fn new(clock: Arc<dyn Clock>, max_postings: usize) -> Self {
        Self {
            clock,
            max_postings,
            boards: Mutex::new(Boards::default()),
        }
    }

    fn post_now(&self, key: &CounterKey, mine: &Posting, fresh: Duration) -> Vec<Posting> {
        let now = self.clock.now();
        let mut b = self.boards.lock().unwrap_or_else(|e| e.into_inner());
        let known = b
            .by_counter
            .get(key)
            .is_some_and(|l| l.contains_key(&mine.stream));
        if !known && b.postings >= self.max_postings {
            b.sweep(now);
        }
        let room = b.postings < self.max_postings;
        let Boards {
            by_counter,
            postings,
        } = &mut *b;
        let lines = by_counter.entry(key.clone()).or_default();
        let before = lines.len();
        lines.retain(|_, l| l.expires > now);
        let fits = known || (room && lines.len() < MAX_POSTINGS_PER_BOARD);
        if fits {
            lines.insert(
                Arc::clone(&mine.stream),
                Line {
                    rate: mine.rate,
                    reserved: mine.reserved,
                    expires: now + fresh,
                },
            );
        }
        *postings = (*postings + lines.len()).saturating_sub(before);
        let out = lines
            .iter()
            .map(|(stream, l)| Posting {
                stream: Arc::clone(stream),
                rate: l.rate,
                reserved: l.reserved,
            })
            .collect();
        if lines.is_empty() {
            by_counter.remove(key);
        }
        out
    }
}

impl Default for MemoryBoard {
    fn default() -> Self {
        Self::new(Arc::new(SystemClock), DEFAULT_MAX_POSTINGS)
    }
}

impl DemandBoard for MemoryBoard {
    fn post<'a>(
        &'a self,
        key: &'a CounterKey,
        mine: &'a Posting,
        fresh: Duration,
    ) -> BoxFuture<'a, Result<Vec<Posting>, StoreError>> {
        let out = self.post_now(key, mine, fresh);
        Box::pin(async move { Ok(out) })
    }

    fn withdraw<'a>(
        &'a self,
        key: &'a CounterKey,
        stream: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let mut b = self.boards.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(lines) = b.by_counter.get_mut(key) {
            if lines.remove(stream).is_some() {
                let empty = lines.is_empty();
                b.postings = b.postings.saturating_sub(1);
                if empty {
                    b.by_counter.remove(key);
                }
            }
        }
        Box::pin(async { Ok(()) })
    }
}
