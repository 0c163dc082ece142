//! Replies and Cluster: parsing a script's reply into outcomes, and the per-slot calls of a
//! Cluster request with the exact undo of what the other slots charged when one denies.

use super::batch::run;
use super::codec::{self, Call};
use super::conn::Conn;
use super::{ScriptTime, UNDO_ATTEMPTS};
use crate::store::StoreError;
use redis::Script;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Runs every slot's call concurrently; if the request is not admitted (a slot denies or fails,
/// or every quota-mode limit denied), undoes exactly what the admitting slots charged: the same
/// window, the same sorted-set entry, only the checks that were written. `quota` says, per call
/// and limit, which limits are quota-mode (empty: none). Returns each call's result, per call
/// whether an undo was done, and whether the request was admitted.
pub(super) async fn charge_or_undo(
    script: Script,
    conn: Conn,
    time: ScriptTime,
    calls: Vec<Call>,
    quota: Vec<Vec<bool>>,
    timeout: Duration,
    failures: Arc<AtomicU64>,
) -> (Vec<Result<Vec<i64>, StoreError>>, Vec<bool>, bool) {
    let now = time.arg();
    let results = futures_util::future::join_all(
        calls
            .iter()
            .map(|c| run(&script, conn.clone(), &now, c, timeout)),
    )
    .await;
    let admitted = results
        .iter()
        .all(|r| r.as_ref().is_ok_and(|v| v.first() == Some(&1)))
        && codec::quota_rule_holds(&calls, &results, &quota);
    let mut undone = vec![false; calls.len()];
    // STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT: each slot applied the rule to its own keys; if a
    // key is over in any slot, the slots with none over (which charged every key) are undone,
    // whether or not the request is admitted (a shadow limit over its limit admits it).
    let stop = calls.iter().any(codec::is_stop);
    let over: Vec<bool> = calls
        .iter()
        .zip(&results)
        .map(|(c, r)| r.as_ref().is_ok_and(|v| codec::any_denied(c, v)))
        .collect();
    let undo_all_of_slot = |i: usize, values: &[i64]| {
        if stop {
            over.contains(&true) && !over[i]
        } else {
            !admitted && values.first() == Some(&1)
        }
    };
    if admitted && !(stop && over.contains(&true)) {
        return (results, undone, true);
    }
    for (i, ((call, r), undone)) in calls.iter().zip(&results).zip(&mut undone).enumerate() {
        let Ok(values) = r else { continue };
        if !undo_all_of_slot(i, values) {
            continue;
        }
        let undo = codec::encode_undo(call, values);
        if undo.keys.is_empty() {
            continue;
        }
        match run_undo(&script, &conn, &time, &undo, timeout).await {
            Ok(()) => *undone = true,
            Err(e) => {
                failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, keys = undo.keys.len(), "could not undo the charge of a request denied in another slot");
            }
        }
    }
    (results, undone, admitted)
}

/// Runs an undo, retrying a failed call up to [`UNDO_ATTEMPTS`] times; an undo the script
/// refuses (the charge moved too far) is not retried.
async fn run_undo(
    script: &Script,
    conn: &Conn,
    time: &ScriptTime,
    undo: &Call,
    timeout: Duration,
) -> Result<(), StoreError> {
    let mut last = None;
    for _ in 0..UNDO_ATTEMPTS {
        // Read the clock again: an undo decides nothing, it only needs "now" to clamp a
        // token bucket, and a test clock may have moved past a window edge meanwhile.
        let now = time.arg();
        match run(script, conn.clone(), &now, undo, timeout).await {
            Ok(v) if codec::undo_done(&v) => return Ok(()),
            Ok(_) => {
                return Err(StoreError::Permanent(
                    "the charge moved too far to be taken back within bounded work".into(),
                ))
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| StoreError::Permanent("no undo attempt was made".into())))
}
