//! Replies and Cluster: parsing a script's reply into outcomes, and the per-slot calls of a
//! Cluster request with the exact undo of what the other slots charged when one denies.

use super::*;

/// Folds one call's reply into `outcomes` (at `idx`); returns whether the call admitted.
pub(super) fn parse(
    values: &[i64],
    idx: &[usize],
    tokens: bool,
    outcomes: &mut [Outcome],
) -> Result<bool, StoreError> {
    let width = if tokens { 4 } else { 3 };
    if values.len() != 1 + width * idx.len() {
        return Err(StoreError::Permanent(format!(
            "decide.lua returned {} values for {} limits",
            values.len(),
            idx.len()
        )));
    }
    for (v, &i) in values[1..].chunks(width).zip(idx) {
        outcomes[i] = Outcome {
            allowed: v[0] & 1 == 1,
            remaining: u32::try_from((v[0] >> 1).max(0)).unwrap_or(u32::MAX),
            reset: micros(v[1]),
            retry_after: if v[2] < 0 {
                Duration::MAX
            } else {
                micros(v[2])
            },
        };
    }
    Ok(values[0] == 1)
}

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
        && quota_rule_holds(&calls, &results, &quota);
    let mut undone = vec![false; calls.len()];
    if admitted {
        return (results, undone, true);
    }
    for ((call, r), undone) in calls.iter().zip(&results).zip(&mut undone) {
        let Ok(values) = r else { continue };
        if values.first() != Some(&1) {
            continue;
        }
        let undo = undo_call(call, values);
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
    (results, undone, false)
}

/// The call that takes back what `call` charged, given its reply `values`: the same window,
/// the same sorted-set entry, only the limits that were written.
fn undo_call(call: &Call, values: &[i64]) -> Call {
    let mut undo = Call {
        keys: Vec::new(),
        args: Vec::new(),
        tokens: false,
        plain: false,
        counting: 0,
    };
    for ((key, args), v) in call
        .keys
        .iter()
        .zip(call.args.chunks(call.per_key()))
        .zip(values[1..].chunks(call.width()))
    {
        let (hits, meta) = (args[2], args.get(3).copied().unwrap_or(0));
        // Written: allowed, hits to charge, not a refund. A shadow denial wrote nothing; a
        // recorded charge stands whatever the other slots say, unless the request stops
        // charging when a key is over (then a slot with no key over, which charged all its
        // keys, is taken back when another slot has one).
        let recorded = call.plain && call.counting & 1 == 1 || meta & (FLAG_RECORD << 2) != 0;
        let stop = call.plain && call.counting == 3 || meta & (FLAG_STOP << 2) != 0;
        if v[0] & 1 == 1 && hits > 0 && meta & (FLAG_REFUND << 2) == 0 && (!recorded || stop) {
            undo.keys.push(key.clone());
            undo.args.extend([
                args[0],
                args[1],
                hits,
                meta | UNDO,
                u64::try_from(v[3]).unwrap_or(0),
            ]);
            // (A plain call's limits are fixed windows with no flags: meta 0.)
        }
    }
    undo
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
            Ok(v) if v[1..].iter().all(|&done| done == 1) => return Ok(()),
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

/// The quota-mode half of [`crate::store::Admission`] across slots: with quota limits, at
/// least one of them allowed the request (their calls sent them as shadow, so each call's
/// `admitted` covers only the enforced limits).
pub(super) fn quota_rule_holds(
    calls: &[Call],
    results: &[Result<Vec<i64>, StoreError>],
    quota: &[Vec<bool>],
) -> bool {
    if quota.iter().all(|q| !q.contains(&true)) {
        return true;
    }
    calls.iter().zip(results).zip(quota).any(|((call, r), q)| {
        let Ok(values) = r else { return false };
        values
            .get(1..)
            .unwrap_or_default()
            .chunks(call.width())
            .zip(q)
            .any(|(v, &is_quota)| is_quota && v.first().is_some_and(|s| s & 1 == 1))
    })
}
