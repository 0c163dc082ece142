//! Script calls: how a call is laid out ([`Call`]), run with its timeout, and how concurrent
//! standalone decisions are batched into one EVALSHA by the batcher task.

use super::classify;
use super::codec::{self, Call, ScriptTime};
use super::conn::{Conn, Manager};
use crate::store::StoreError;
use redis::Script;
use std::sync::Arc;
use std::time::Duration;

/// One EVALSHA (plus SCRIPT LOAD after NOSCRIPT), bounded by `timeout`.
pub(super) async fn run(
    script: &Script,
    conn: Conn,
    now: &str,
    call: &Call,
    timeout: Duration,
) -> Result<Vec<i64>, StoreError> {
    let mut replies = run_batch(script, conn, now, &[call], timeout).await?;
    replies
        .pop()
        .ok_or_else(|| StoreError::Permanent("decide.lua returned no reply".into()))
}

/// ONE EVALSHA deciding every call of `calls` in turn (each all or nothing); the replies, split
/// per call. All calls must agree on `tokens`.
pub(super) async fn run_batch(
    script: &Script,
    mut conn: Conn,
    now: &str,
    calls: &[&Call],
    timeout: Duration,
) -> Result<Vec<Vec<i64>>, StoreError> {
    let batch = codec::Batch::new(calls);
    let values = invoke(&mut conn, &batch.invocation(script, now), timeout).await?;
    batch.replies(&values)
}

/// One EVALSHA (plus SCRIPT LOAD after NOSCRIPT), bounded by `timeout`.
pub(super) async fn invoke(
    conn: &mut Conn,
    inv: &redis::ScriptInvocation<'_>,
    timeout: Duration,
) -> Result<Vec<i64>, StoreError> {
    let fut = conn.query(async |c| inv.invoke_async::<Vec<i64>>(c).await);
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(StoreError::Transient(format!(
            "Redis did not answer within {timeout:?}"
        ))),
    }
}

/// Decisions waiting for the batcher at most; a caller past it waits for room (bounded memory),
/// within its `REDIS_TIMEOUT`.
pub(super) const BATCH_QUEUE: usize = 16_384;

/// Most limits one batched call decides: a batch stays far below Redis's 1 ms budget even when
/// every limit is a sliding_log (a request with more limits goes alone).
pub(super) const MAX_BATCH_KEYS: usize = 64;

/// A decision waiting for the batcher: a request's call and, when candidate limits
/// (`CANDIDATE_CONFIG`) ride with it, theirs beside it, decided as a request of its own in the
/// same EVALSHA.
pub(super) struct Job {
    pub(super) call: Call,
    pub(super) beside: Option<Call>,
    /// `call` holds candidate checks alone (a call the service made apart from an answer).
    pub(super) candidates_only: bool,
    pub(super) reply: tokio::sync::oneshot::Sender<Result<Replies, StoreError>>,
}

/// A job's replies: its call's, and its candidates' call's if it has one.
pub(super) type Replies = (Vec<i64>, Option<Vec<i64>>);

impl Job {
    /// Whether to send it: a caller that gave up while queued (Envoy's deadline) is not
    /// decided, its request would be charged with nobody told. Usage it records is: Envoy
    /// reports the tokens a response used and cancels the call at its timeout, but the tokens
    /// are spent. Its candidates never are: nobody would count what they decided.
    fn still_wanted(&mut self) -> bool {
        if !self.reply.is_closed() {
            return true;
        }
        self.beside = None;
        !self.candidates_only && self.call.records()
    }

    fn keys(&self) -> usize {
        self.call.keys.len() + self.beside.as_ref().map_or(0, |b| b.keys.len())
    }
}

/// Standalone Redis: sends concurrent decisions together. It keeps at most `in_flight` script
/// calls outstanding (`REDIS_POOL_SIZE`, one per connection); while they run, new decisions queue and the next call takes all of them
/// (up to [`MAX_BATCH_KEYS`] limits). One decision alone goes at once: batching adds no wait,
/// it only forms under load, where it saves Redis the per-call cost of EVALSHA (argument
/// tables, `TIME`, helper closures, the reply) and sluice the per-command encoding.
pub(super) async fn batcher(
    mut rx: tokio::sync::mpsc::Receiver<Job>,
    pool: bb8::Pool<Manager>,
    script: Arc<Script>,
    time: ScriptTime,
    timeout: Duration,
    in_flight: usize,
) {
    let permits = Arc::new(tokio::sync::Semaphore::new(in_flight.max(1)));
    let mut carried: Option<Job> = None;
    loop {
        let first = match carried.take() {
            Some(j) => j,
            None => match rx.recv().await {
                Some(j) => j,
                None => return,
            },
        };
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let mut keys = first.keys();
        let mut jobs = vec![first];
        while keys < MAX_BATCH_KEYS {
            match rx.try_recv() {
                Ok(j) if keys + j.keys() <= MAX_BATCH_KEYS => {
                    keys += j.keys();
                    jobs.push(j);
                }
                Ok(j) => {
                    carried = Some(j);
                    break;
                }
                Err(_) => break,
            }
        }
        jobs.retain_mut(Job::still_wanted);
        if jobs.is_empty() {
            continue;
        }
        let (pool, script, now) = (pool.clone(), Arc::clone(&script), time.arg());
        tokio::spawn(async move {
            let result = match single_connection(&pool).await {
                Ok(conn) => {
                    let calls: Vec<&Call> = jobs
                        .iter()
                        .flat_map(|j| std::iter::once(&j.call).chain(j.beside.as_ref()))
                        .collect();
                    run_batch(&script, conn, &now, &calls, timeout).await
                }
                Err(e) => Err(e),
            };
            match result {
                Ok(replies) => {
                    let mut replies = replies.into_iter();
                    for job in jobs {
                        let own = replies.next().unwrap_or_default();
                        let beside = job
                            .beside
                            .as_ref()
                            .map(|_| replies.next().unwrap_or_default());
                        let _ = job.reply.send(Ok((own, beside)));
                    }
                }
                Err(e) => {
                    for job in jobs {
                        let _ = job.reply.send(Err(e.clone()));
                    }
                }
            }
            drop(permit);
        });
    }
}

/// A clone of a pooled multiplexed connection (checked out only for the clone).
pub(super) async fn single_connection(pool: &bb8::Pool<Manager>) -> Result<Conn, StoreError> {
    let pooled = pool.get().await.map_err(|e| match e {
        bb8::RunError::User(e) => classify(e),
        bb8::RunError::TimedOut => StoreError::Transient("timed out connecting to Redis".into()),
    })?;
    Ok(Conn::Single(pooled.conn.clone(), pooled.broken.clone()))
}
