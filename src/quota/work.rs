//! The store work of one report: for each bucket, record its reconciled use, post its demand on
//! the tightest counter's board, compute its share and reserve what it may spend. The buckets
//! of a report are independent, so their store calls run concurrently ([`CONCURRENCY`] at a
//! time): a report of 10 000 buckets on Redis costs a few hundred round trips of wall time,
//! not 30 000, and the stream keeps up with Envoy's 5 s period. The stream's own state is read
//! before ([`Step`]) and written after ([`Assigned`]); nothing here touches it.

use super::allocate::{available_rate, blanket, max_min_shares, strategy, token_rate};
use crate::config::Algorithm;
use crate::proto::envoy::r#type::v3::rate_limit_strategy::BlanketRule;
use crate::proto::envoy::r#type::v3::RateLimitStrategy;
use crate::service::{RateLimiter, Recorded};
use crate::store::demand::Posting;
use crate::store::{BoxFuture, CounterKey};
use futures_util::StreamExt;
use std::sync::Arc;
use std::time::Duration;

/// Buckets of one report whose store calls are in flight at once.
pub const CONCURRENCY: usize = 32;

/// How long a posting on a demand board counts: three report periods.
const DEMAND_FRESH: Duration = Duration::from_secs(15);

/// What a reservation covers: Envoy's 5 s report period and the one second of tokens a token
/// bucket holds when it starts full.
const RESERVE_SECONDS: u64 = 6;

/// Whether an assignment reserves the tokens it grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserve {
    Yes,
    /// The last assignment of a draining stream: the bucket's next report goes elsewhere.
    No,
}

/// One bucket's store work, with what it needs from the stream.
#[derive(Debug)]
pub enum Step {
    /// Assign the bucket: record `delta`, post, share, reserve.
    Assign {
        pairs: Arc<[(String, String)]>,
        /// The RLS descriptor; `None` when the bucket names no limit (ALLOW_ALL, no store work).
        descriptor: Option<Arc<[(String, String)]>>,
        demand: Option<f64>,
        /// The stream's last reservation on the counter, posted while the new one is made.
        posted: u64,
        delta: i64,
        reserve: Reserve,
    },
    /// An abandoned bucket: record `delta` (its reservation given back) and take its posting
    /// off the board.
    Forget {
        descriptor: Option<Arc<[(String, String)]>>,
        tightest: Option<CounterKey>,
        delta: i64,
    },
}

/// What the store work found for an assigned bucket.
#[derive(Debug)]
pub enum Assigned {
    /// No limit applies: ALLOW_ALL.
    Unlimited,
    /// The store could not be asked: no action (Envoy keeps its assignment until the TTL).
    Failed,
    Paced {
        tightest: CounterKey,
        remaining: u64,
        /// Until the tightest limit's window ends.
        left: Duration,
        strategy: RateLimitStrategy,
        /// Tokens reserved on the counter (none when the reservation failed or none was due).
        reserved: Option<u64>,
        /// The board had no room for this stream's posting.
        board_full: bool,
    },
}

/// Who does the work: the limiter, the stream's name on the boards, its domain, and the
/// process's bound on RLQS store calls in flight (`RLQS_MAX_STORE_CALLS`).
pub struct Worker {
    pub limiter: Arc<RateLimiter>,
    pub name: Arc<str>,
    pub domain: Option<String>,
    pub calls: Arc<tokio::sync::Semaphore>,
}

impl Worker {
    /// Runs every step, [`CONCURRENCY`] at a time; the results in the steps' order (`None`
    /// for a `Forget`).
    pub fn run<'a>(&'a self, steps: &'a [Step]) -> BoxFuture<'a, Vec<Option<Assigned>>> {
        // Lazily: a call's future exists only while it is one of the CONCURRENCY in flight.
        // (Boxed as `Send` here so the spawned stream task is provably `Send`.)
        Box::pin(
            futures_util::stream::iter(steps.iter().map(|s| self.one(s)))
                .buffered(CONCURRENCY)
                .collect(),
        )
    }

    async fn one(&self, step: &Step) -> Option<Assigned> {
        // Held for the step's store calls; the semaphore is never closed.
        let _permit = self.calls.acquire().await.ok();
        match step {
            Step::Assign {
                descriptor,
                demand,
                posted,
                delta,
                reserve,
                ..
            } => Some(
                self.assign(descriptor.as_deref(), *demand, *posted, *delta, *reserve)
                    .await,
            ),
            Step::Forget {
                descriptor,
                tightest,
                delta,
            } => {
                if let (Some(domain), Some(d)) = (&self.domain, descriptor) {
                    if *delta != 0 {
                        let _ = self.limiter.record_usage(domain, d, *delta).await;
                    }
                }
                if let Some(key) = tightest {
                    let _ = self.limiter.demand_board().withdraw(key, &self.name).await;
                }
                None
            }
        }
    }

    async fn assign(
        &self,
        descriptor: Option<&[(String, String)]>,
        demand: Option<f64>,
        posted: u64,
        delta: i64,
        reserve: Reserve,
    ) -> Assigned {
        let (Some(domain), Some(descriptor)) = (self.domain.as_deref(), descriptor) else {
            return Assigned::Unlimited;
        };
        let Ok(recorded) = self.limiter.record_usage(domain, descriptor, delta).await else {
            return Assigned::Failed;
        };
        // An `in_flight` limit is not a rate and a quota bucket names no request, so it takes
        // no slot: the bucket is denied while every slot is held (until the first lease ends)
        // and otherwise paced by the descriptor's rates alone (allowed, if it has none).
        let (slots, recorded): (Vec<Recorded>, Vec<Recorded>) = recorded
            .into_iter()
            .partition(|r| r.key.limit.algorithm == Algorithm::InFlight);
        if let Some(full) = slots.iter().find(|r| r.outcome.remaining == 0) {
            return Assigned::Paced {
                tightest: full.key.clone(),
                remaining: 0,
                left: full.outcome.retry_after.min(full.outcome.reset),
                strategy: blanket(BlanketRule::DenyAll),
                reserved: None,
                board_full: false,
            };
        }
        if let (true, Some(free)) = (recorded.is_empty(), slots.first()) {
            return Assigned::Paced {
                tightest: free.key.clone(),
                remaining: u64::from(free.outcome.remaining),
                left: free.outcome.reset,
                strategy: blanket(BlanketRule::AllowAll),
                reserved: None,
                board_full: false,
            };
        }
        // The tightest limit: the lowest rate it can still afford.
        let Some(tightest) = recorded.into_iter().min_by(|a, b| {
            let rate =
                |r: &Recorded| available_rate(u64::from(r.outcome.remaining), r.outcome.reset);
            rate(a).total_cmp(&rate(b))
        }) else {
            return Assigned::Unlimited;
        };
        let remaining = u64::from(tightest.outcome.remaining);
        let left = tightest.outcome.reset;
        let (share, board_full) = self
            .share(&tightest.key, demand, posted, remaining, left)
            .await;
        let strategy = strategy(share, remaining);
        let rate = token_rate(&strategy);
        let reserved = if reserve == Reserve::Yes && rate > 0.0 {
            let tokens = ((rate.ceil() as u64) * RESERVE_SECONDS).min(remaining);
            let hits = i64::try_from(tokens).unwrap_or(i64::MAX);
            self.limiter
                .record_usage(domain, descriptor, hits)
                .await
                .ok()
                .map(|_| tokens)
        } else {
            None
        };
        Assigned::Paced {
            tightest: tightest.key,
            remaining,
            left,
            strategy,
            reserved,
            board_full,
        }
    }

    /// This stream's max-min fair share (requests per second) of what `key` can still afford,
    /// after posting its demand (and `posted` tokens it holds reserved) on the key's board, and
    /// whether the board was full. If the board cannot be read, the stream is assumed alone.
    async fn share(
        &self,
        key: &CounterKey,
        demand: Option<f64>,
        posted: u64,
        remaining: u64,
        left: Duration,
    ) -> (f64, bool) {
        let mine = Posting {
            stream: Arc::clone(&self.name),
            rate: demand,
            reserved: posted,
        };
        let board = self
            .limiter
            .demand_board()
            .post(key, &mine, DEMAND_FRESH)
            .await;
        let mut postings = board.unwrap_or_default();
        let mut board_full = false;
        if !postings.iter().any(|p| p.stream == self.name) {
            board_full = !postings.is_empty();
            postings.push(mine);
        }
        // The others' reservations are part of what the window still has: they hold them for
        // the requests of their next report period, this stream for its own.
        let others: u64 = postings
            .iter()
            .filter(|p| p.stream != self.name)
            .map(|p| p.reserved)
            .sum();
        let rates: Vec<Option<f64>> = postings.iter().map(|p| p.rate).collect();
        let shares = max_min_shares(
            &rates,
            available_rate(remaining.saturating_add(others), left),
        );
        let share = postings
            .iter()
            .position(|p| p.stream == self.name)
            .map_or(0.0, |i| shares[i]);
        (share, board_full)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fake::FakeStore;
    use crate::store::{StoreSignals, StoreStack};

    /// `RLQS_MAX_STORE_CALLS` bounds the store calls of all streams together: two streams'
    /// reports of ten buckets each, with a bound of 3, hold 3 calls in the store, not 2 x 10
    /// (each report alone would run up to [`CONCURRENCY`] at once).
    #[tokio::test]
    async fn store_calls_of_all_streams_are_bounded_together() {
        let rules = crate::config::load_sources(&[(
            "t.yaml".into(),
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 600}\n".into(),
        )])
        .unwrap_or_else(|e| panic!("{e}"));
        let clock = Arc::new(crate::clock::ManualClock::default());
        let store = Arc::new(FakeStore::gated(clock.clone()));
        let limiter = Arc::new(RateLimiter::new(
            rules,
            StoreStack::new(store.clone(), StoreSignals::new("test")),
            crate::service::ServiceOptions::default(),
            crate::telemetry::Telemetry::new(clock).unwrap_or_else(|e| panic!("{e}")),
        ));
        let calls = Arc::new(tokio::sync::Semaphore::new(3));
        let report = |stream: &str| -> Vec<Step> {
            (0..10)
                .map(|i| {
                    let pairs: Arc<[(String, String)]> =
                        Arc::from(vec![("k".to_string(), format!("{stream}{i}"))]);
                    Step::Assign {
                        pairs: Arc::clone(&pairs),
                        descriptor: Some(pairs),
                        demand: None,
                        posted: 0,
                        delta: 1,
                        reserve: Reserve::No,
                    }
                })
                .collect()
        };
        let mut tasks = Vec::new();
        for stream in ["a", "b"] {
            let worker = Worker {
                limiter: Arc::clone(&limiter),
                name: Arc::from(stream),
                domain: Some("d".into()),
                calls: Arc::clone(&calls),
            };
            let steps = report(stream);
            tasks.push(tokio::spawn(async move { worker.run(&steps).await.len() }));
        }
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            store.calls(),
            3,
            "three calls in the store at once, the rest wait"
        );
        store.open(usize::MAX >> 4);
        for t in tasks {
            assert_eq!(t.await.expect("task"), 10);
        }
        assert!(
            store.calls() >= 20,
            "every bucket's work done: {}",
            store.calls()
        );
    }
}
