//! Script calls: how a call is laid out ([`Call`]), run with its timeout, and how concurrent
//! standalone decisions are batched into one EVALSHA by the batcher task.

use super::*;

/// One script call: its keys and the numeric arguments after ARGV[2].
#[derive(Debug, Clone)]
pub(super) struct Call {
    pub(super) keys: Vec<String>,
    pub(super) args: Vec<u64>,
    /// Ask for undo tokens (ARGV[2]).
    pub(super) tokens: bool,
    /// Fixed windows only, no flags: 3 arguments per limit, the script's fast path.
    pub(super) plain: bool,
    /// A plain call's counting `m` (decide.lua): 0 all or nothing, 1 record, 3 record + stop.
    pub(super) counting: u64,
}

impl Call {
    /// Whether the call records usage that must reach Redis even if its caller gave up.
    pub(super) fn records(&self) -> bool {
        if self.plain {
            self.counting & 1 == 1
        } else {
            self.args
                .chunks(self.per_key())
                .any(|a| a.get(3).is_some_and(|m| m & (FLAG_RECORD << 2) != 0))
        }
    }
}

impl Call {
    /// Values per limit in the reply.
    pub(super) fn width(&self) -> usize {
        if self.is_undo() {
            1
        } else if self.tokens {
            4
        } else {
            3
        }
    }

    pub(super) fn per_key(&self) -> usize {
        if self.plain {
            ARGS_PER_KEY - 1
        } else if self.is_undo() {
            ARGS_PER_KEY + 1
        } else {
            ARGS_PER_KEY
        }
    }

    pub(super) fn is_undo(&self) -> bool {
        !self.plain && self.args.get(3).is_some_and(|meta| meta & UNDO != 0)
    }
}

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
    if let Some(packed) = packed::Packed::new(calls) {
        let mut inv = script.prepare_invoke();
        inv.arg(now).arg("p");
        for &(key, _, _) in &packed.counters {
            inv.key(key);
        }
        for a in packed.args() {
            inv.arg(a);
        }
        let reply = invoke(&mut conn, &inv, timeout).await?;
        return packed.answers(&reply);
    }
    let tokens = calls.first().is_some_and(|c| c.tokens);
    let mut inv = script.prepare_invoke();
    inv.arg(now)
        .arg(if tokens { "1" } else { "0" })
        .arg(calls.len());
    for call in calls {
        let n = i64::try_from(call.keys.len()).unwrap_or(i64::MAX / 8);
        inv.arg(if call.plain {
            -(4 * n + call.counting as i64)
        } else {
            n
        });
        for (key, args) in call.keys.iter().zip(call.args.chunks(call.per_key())) {
            inv.key(key.as_str());
            for a in args {
                inv.arg(*a);
            }
        }
    }
    let values = invoke(&mut conn, &inv, timeout).await?;
    let expected: usize = calls.iter().map(|c| 1 + c.width() * c.keys.len()).sum();
    if values.len() != expected {
        return Err(StoreError::Permanent(format!(
            "decide.lua returned {} values for {} requests of {} limits",
            values.len(),
            calls.len(),
            calls.iter().map(|c| c.keys.len()).sum::<usize>()
        )));
    }
    let mut rest = values.as_slice();
    Ok(calls
        .iter()
        .map(|c| {
            let (one, tail) = rest.split_at(1 + c.width() * c.keys.len());
            rest = tail;
            one.to_vec()
        })
        .collect())
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

/// A decision waiting for the batcher.
pub(super) struct Job {
    pub(super) call: Call,
    pub(super) reply: tokio::sync::oneshot::Sender<Result<Vec<i64>, StoreError>>,
}

/// Standalone Redis: sends concurrent decisions together. It keeps at most `in_flight` script
/// calls outstanding (`REDIS_POOL_SIZE`, one per connection); while they run, new decisions queue and the next call takes all of them
/// (up to [`MAX_BATCH_KEYS`] limits). One decision alone goes at once: batching adds no wait,
/// it only forms under load, where it saves Redis the per-call cost of EVALSHA (argument
/// tables, `TIME`, helper closures, the reply) and sluice the per-command encoding.
pub(super) async fn batcher(
    mut rx: tokio::sync::mpsc::Receiver<Job>,
    pool: bb8::Pool<Manager>,
    script: Script,
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
        let mut keys = first.call.keys.len();
        let mut jobs = vec![first];
        while keys < MAX_BATCH_KEYS {
            match rx.try_recv() {
                Ok(j) if keys + j.call.keys.len() <= MAX_BATCH_KEYS => {
                    keys += j.call.keys.len();
                    jobs.push(j);
                }
                Ok(j) => {
                    carried = Some(j);
                    break;
                }
                Err(_) => break,
            }
        }
        // A caller that gave up while queued (Envoy's deadline) is not decided: its request
        // would be charged with nobody told. Usage it records is: Envoy reports the tokens a
        // response used and cancels the call at its timeout, but the tokens are spent.
        jobs.retain(|j| !j.reply.is_closed() || j.call.records());
        if jobs.is_empty() {
            continue;
        }
        let (pool, script, now) = (pool.clone(), script.clone(), time.arg());
        tokio::spawn(async move {
            let result = match single_connection(&pool).await {
                Ok(conn) => {
                    let calls: Vec<&Call> = jobs.iter().map(|j| &j.call).collect();
                    run_batch(&script, conn, &now, &calls, timeout).await
                }
                Err(e) => Err(e),
            };
            match result {
                Ok(replies) => {
                    for (job, reply) in jobs.into_iter().zip(replies) {
                        let _ = job.reply.send(Ok(reply));
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
