//! The one place that knows `decide.lua`'s KEYS, ARGV and reply layout (documented at the top
//! of the script, next to which this file is kept in step): the script's text (its TTL jitter and
//! test-only time line), the time argument, encoding a whole request, one slot of a request, an
//! undo, and a batch of requests (the general and the packed layouts), and decoding the
//! replies; a home store's fair grant (the "s" mode) extends it in `fair.rs`. The rest of the
//! Redis store speaks in `LimitCheck`s and `Outcome`s.

use super::lease_arg::{lease_arg, Layout, LeaseArg};
use crate::config::Algorithm;
use crate::store::{CounterKey, LeaseEffect, LimitCheck, Outcome, StoreError};
use redis::{Script, ScriptInvocation};
use std::collections::HashMap;
use std::time::Duration;
#[cfg(any(test, feature = "test-util"))]
use {crate::clock::Clock, std::sync::Arc};

/// The decision script, `decide.lua`, joined from its six files; KEYS/ARGV are documented at
/// the top of the first.
pub(super) const DECIDE_LUA: &str = concat!(
    include_str!("decide/head.lua"),
    include_str!("decide/window.lua"),
    include_str!("decide/log.lua"),
    include_str!("decide/bucket.lua"),
    include_str!("decide/lease.lua"),
    include_str!("decide/call.lua"),
);

/// `decide.lua` with its TTL jitter set (the script's `JITTER_MS` line).
pub(super) fn decide_script(jitter: Duration) -> String {
    let ms = u64::try_from(jitter.as_millis()).unwrap_or(u64::MAX);
    let script = DECIDE_LUA.replacen(
        "local JITTER_MS = 0\n",
        &format!("local JITTER_MS = {ms}\n"),
        1,
    );
    // Outside `test-util` builds the script has no time override: it always decides on the
    // server's clock, whatever ARGV[1] holds.
    #[cfg(not(any(test, feature = "test-util")))]
    let script = script.replacen(TIME_OVERRIDE_LUA, "", 1);
    script
}

/// decide.lua's test-only time override (ARGV[1]), one line so builds without `test-util` can
/// drop it.
#[cfg_attr(any(test, feature = "test-util"), allow(dead_code))]
const TIME_OVERRIDE_LUA: &str =
    "if ARGV[1] ~= '' then now = tonumber(ARGV[1]); slack = 3600000 end -- test-util\n";

/// The time the script decides on: Redis `TIME`, always, outside `test-util` builds; a test's
/// manual clock with it.
#[derive(Debug, Clone, Default)]
pub(super) struct ScriptTime {
    #[cfg(any(test, feature = "test-util"))]
    pub(super) clock: Option<Arc<dyn Clock>>,
}

impl ScriptTime {
    /// ARGV[1]: "" (the script reads Redis `TIME`), or the test clock's time.
    pub(super) fn arg(&self) -> String {
        #[cfg(any(test, feature = "test-util"))]
        if let Some(c) = &self.clock {
            return c.now().as_micros().to_string();
        }
        String::new()
    }

    /// Now on the clock the quota service's demand boards use: the test clock in tests, the
    /// process clock otherwise (replicas' clocks agree far closer than a posting's lifetime).
    pub(super) fn now(&self) -> std::time::Duration {
        #[cfg(any(test, feature = "test-util"))]
        if let Some(c) = &self.clock {
            return c.now();
        }
        crate::clock::Clock::now(&crate::clock::SystemClock)
    }
}

/// Script arguments per limit (see the top of `decide.lua`); an undo call adds the token.
pub(super) const ARGS_PER_KEY: usize = 4;
pub(super) use super::meta::{meta, COUNTING_META, FLAG_RECORD, UNDO};

pub(super) use super::reply::Reply;

/// One script call: its keys and the numeric arguments after ARGV[2].
#[derive(Debug, Clone)]
pub(super) struct Call {
    pub(super) keys: Vec<String>,
    pub(super) args: Vec<u64>,
    /// What the script returns (ARGV[2]).
    pub(super) reply: Reply,
    /// Fixed windows only, no flags but one counting for all: the call may go in the packed
    /// layout (see [`Packed`]).
    pub(super) plain: bool,
    /// A plain call's counting `m` (decide.lua): 0 all or nothing, 1 record, 3 record + stop.
    pub(super) counting: u64,
    /// A call with a lease limit (`in_flight`, `reservations`): per limit, its op, request id,
    /// lease and cap (decide.lua's layout with K = 8); empty for every other call.
    pub(super) lease: Vec<LeaseArg>,
}

impl Call {
    /// Whether the call records usage that must reach Redis even if its caller gave up.
    pub(super) fn records(&self) -> bool {
        self.args
            .chunks(self.per_key())
            .any(|a| a.get(3).is_some_and(|m| m & (FLAG_RECORD << 2) != 0))
    }

    /// Values per limit in the reply (a lease request's carry two more: its lease effect).
    pub(super) fn width(&self) -> usize {
        if self.is_undo() || self.reply == Reply::Unlease {
            1
        } else if matches!(
            self.reply,
            Reply::Answer | Reply::Guarded { .. } | Reply::Fenced { .. } | Reply::Fair { .. }
        ) {
            3 + self.lease_width()
        } else {
            5 + self.lease_width()
        }
    }

    fn lease_width(&self) -> usize {
        if self.lease.is_empty() {
            0
        } else {
            2
        }
    }

    /// How to read the call's reply.
    pub(super) fn layout(&self) -> Layout {
        Layout {
            width: self.width(),
            lease: !self.lease.is_empty(),
        }
    }

    pub(super) fn per_key(&self) -> usize {
        if self.is_undo() {
            ARGS_PER_KEY + 1
        } else {
            ARGS_PER_KEY
        }
    }

    pub(super) fn is_undo(&self) -> bool {
        self.args.get(3).is_some_and(|meta| meta & UNDO != 0)
    }

    /// The same call asking for `reply`.
    pub(super) fn with_reply(&self, reply: Reply) -> Call {
        Call {
            reply,
            ..self.clone()
        }
    }
}

/// The script call deciding `idx` of `checks`, owned so it can run on a spawned task; `key_of`
/// names each counter's Redis key. `whole`: the call decides the whole request, so the script
/// applies the quota-mode rule; otherwise (one slot of several) quota limits go as shadow, the
/// caller applies [`crate::store::Admission`] across the slots, and the reply carries what an
/// undo needs ([`Reply::Tokens`]).
pub(super) fn encode(
    checks: &[LimitCheck],
    idx: &[usize],
    whole: bool,
    key_of: impl Fn(&CounterKey) -> String,
) -> Call {
    let meta = |c: &LimitCheck| meta(c, whole);
    // A plain request (fixed windows, no flags but one counting for all) may go in the packed
    // layout. A slot of a request spanning slots goes in the general one (it wants undo
    // tokens).
    let counting = idx.first().map_or(0, |&i| meta(&checks[i]) & COUNTING_META);
    let plain = whole
        && idx.iter().all(|&i| {
            meta(&checks[i]) & !COUNTING_META == 0 && meta(&checks[i]) & COUNTING_META == counting
        });
    let in_flight = idx.iter().any(|&i| {
        checks[i].key.limit.algorithm == Algorithm::InFlight || checks[i].lease.is_some()
    });
    let mut keys = Vec::with_capacity(idx.len());
    let mut args = Vec::with_capacity(idx.len() * ARGS_PER_KEY);
    let mut lease = Vec::new();
    for &i in idx {
        let c = &checks[i];
        let p = c.params();
        keys.push(key_of(&c.key));
        args.extend([u64::from(p.limit), p.period_us, c.hits, meta(c)]);
        if in_flight {
            lease.push(lease_arg(c));
        }
    }
    Call {
        keys,
        args,
        reply: if whole { Reply::Answer } else { Reply::Tokens },
        plain: plain && !in_flight,
        counting: if plain && !in_flight {
            counting >> 6
        } else {
            0
        },
        lease,
    }
}

/// The call that takes back the charges of `call` that `undo` selects (by position), each by
/// its token from the decoded reply: the same window, the same sorted-set entry.
pub(super) fn encode_undo(call: &Call, slot: &SlotReply, undo: &[bool]) -> Call {
    let mut out = Call {
        keys: Vec::new(),
        args: Vec::new(),
        reply: Reply::Answer,
        plain: false,
        counting: 0,
        lease: Vec::new(),
    };
    for (n, (key, args)) in call
        .keys
        .iter()
        .zip(call.args.chunks(call.per_key()))
        .enumerate()
    {
        let token = slot.tokens.get(n).copied().unwrap_or(0);
        if !undo.get(n).copied().unwrap_or(false) || token == 0 {
            continue;
        }
        let (Some(&limit), Some(&period), Some(&hits)) = (args.first(), args.get(1), args.get(2))
        else {
            continue;
        };
        let meta = args.get(3).copied().unwrap_or(0);
        out.keys.push(key.clone());
        out.args.extend([
            limit,
            period,
            hits,
            meta | UNDO,
            u64::try_from(token).unwrap_or(0),
        ]);
    }
    out
}

/// The write-back of `checks` (one counter's usage decided locally) applied at most once per
/// `guard` key (which must share the counters' slot), kept for `ttl_ms`.
pub(super) fn encode_guarded(
    checks: &[LimitCheck],
    guard: String,
    ttl_ms: u64,
    key_of: impl Fn(&CounterKey) -> String,
) -> Call {
    let all: Vec<usize> = (0..checks.len()).collect();
    let mut call = encode(checks, &all, true, key_of);
    call.plain = false;
    call.counting = 0;
    call.reply = Reply::Guarded { ttl_ms };
    // Not a limit: the script reads its guard from the end of KEYS and decides by ARGV, which
    // counts only the limits.
    call.keys.push(guard);
    call
}

/// A home store's refund (`check` gives units back), refused by the script if a reset fenced
/// the counter's window past `cleared` ([`Reply::Fenced`]).
pub(super) fn encode_fenced(
    check: &LimitCheck,
    cleared: u64,
    key_of: impl Fn(&CounterKey) -> String,
) -> Call {
    let mut call = encode(std::slice::from_ref(check), &[0], true, key_of);
    call.plain = false;
    call.counting = 0;
    call.reply = Reply::Fenced { cleared };
    call
}

/// Whether a guarded call's reply says its guard was already set (applied before), or a
/// fenced one that it was refused.
pub(super) fn already_applied(values: &[i64]) -> bool {
    values == [-1]
}

/// One slot's decoded reply ([`Reply::Tokens`] and the like): besides the outcomes (folded
/// into the request's), per limit of the slot its undo token (0: nothing written to undo) and
/// what its counter had left before the request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct SlotReply {
    pub(super) admitted: bool,
    pub(super) tokens: Vec<i64>,
    pub(super) before: Vec<u32>,
}

/// What a decoded reply is folded into: each check's outcome and, on a lease request, its
/// lease effect (`leases` is filled to one per check when the call has any).
pub(super) struct Fold<'a> {
    pub(super) outcomes: &'a mut [Outcome],
    pub(super) leases: &'a mut Vec<LeaseEffect>,
}

/// Folds one call's reply into `outcomes` (at `idx`); returns whether the call admitted.
pub(super) fn decode(
    values: &[i64],
    layout: Layout,
    idx: &[usize],
    into: Fold<'_>,
) -> Result<bool, StoreError> {
    decode_slot(values, layout, idx, into).map(|s| s.admitted)
}

/// Folds `call`'s reply into `into` (at `idx`); the reply is checked whole before anything is
/// read from it.
pub(super) fn decode_slot(
    values: &[i64],
    layout: Layout,
    idx: &[usize],
    into: Fold<'_>,
) -> Result<SlotReply, StoreError> {
    let (width, outcomes) = (layout.width, into.outcomes);
    let extra = if layout.lease { 2 } else { 0 };
    if values.len() != 1 + width * idx.len() || width < 3 {
        return Err(StoreError::Permanent(format!(
            "decide.lua returned {} values for {} limits",
            values.len(),
            idx.len()
        )));
    }
    let mut slot = SlotReply {
        admitted: values[0] == 1,
        tokens: Vec::with_capacity(idx.len()),
        before: Vec::with_capacity(idx.len()),
    };
    for (v, &i) in values[1..].chunks_exact(width).zip(idx) {
        outcomes[i] = Outcome {
            allowed: v[0] & 1 == 1,
            remaining: remaining(v[0] >> 1),
            reset: micros(v[1]),
            retry_after: if v[2] < 0 {
                Duration::MAX
            } else {
                micros(v[2])
            },
        };
        if width - extra >= 5 {
            slot.tokens.push(v[3]);
            slot.before.push(remaining(v[4]));
        }
        if layout.lease {
            if into.leases.is_empty() {
                into.leases.resize(outcomes.len(), LeaseEffect::default());
            }
            if let Some(e) = into.leases.get_mut(i) {
                e.merge(LeaseEffect::from_script(v[width - 2], v[width - 1]));
            }
        }
    }
    Ok(slot)
}

fn remaining(v: i64) -> u32 {
    u32::try_from(v.max(0)).unwrap_or(u32::MAX)
}

/// A batch of calls for ONE `EVALSHA`: the packed layout when every call fits it, else the
/// general one (each request after the other, each decided by the charging rule in order).
pub(super) enum Batch<'a> {
    Packed(Packed<'a>),
    General(&'a [&'a Call]),
}

impl<'a> Batch<'a> {
    /// All calls must agree on `reply`.
    pub(super) fn new(calls: &'a [&'a Call]) -> Self {
        match Packed::new(calls) {
            Some(p) => Batch::Packed(p),
            None => Batch::General(calls),
        }
    }

    /// The script invocation: KEYS and ARGV (ARGV[1] is `now`, the time override or "").
    pub(super) fn invocation(&self, script: &'a Script, now: &str) -> ScriptInvocation<'a> {
        let mut inv = script.prepare_invoke();
        match self {
            Batch::Packed(packed) => {
                inv.arg(now).arg("p");
                for &(key, _, _) in &packed.counters {
                    inv.key(key);
                }
                for a in packed.args() {
                    inv.arg(a);
                }
            }
            Batch::General(calls) => {
                let reply = calls.first().map_or(Reply::Answer, |c| c.reply.clone());
                inv.arg(now).arg(reply.arg()).arg(calls.len());
                for call in calls.iter() {
                    let limits = call.args.len() / call.per_key();
                    if call.lease.is_empty() {
                        inv.arg(limits);
                    } else {
                        // The lease layout: -n, then K = 8 per limit.
                        inv.arg(-i64::try_from(limits).unwrap_or(i64::MAX));
                    }
                    for (n, (key, args)) in call
                        .keys
                        .iter()
                        .zip(call.args.chunks(call.per_key()))
                        .enumerate()
                    {
                        inv.key(key.as_str());
                        for a in args {
                            inv.arg(*a);
                        }
                        if let Some(l) = call.lease.get(n) {
                            inv.arg(l.op).arg(&*l.id).arg(l.lease_us).arg(l.cap);
                        }
                    }
                    // A guarded call's guard: a key after its limits' keys, not a limit.
                    for key in call.keys.iter().skip(limits) {
                        inv.key(key.as_str());
                    }
                }
            }
        }
        inv
    }

    /// The script's reply split per call, each in the general layout (`admitted`, then per
    /// limit state, reset, retry and, with tokens, the undo token).
    pub(super) fn replies(&self, values: &[i64]) -> Result<Vec<Vec<i64>>, StoreError> {
        let calls = match self {
            Batch::Packed(packed) => return packed.answers(values),
            Batch::General(calls) => calls,
        };
        let expected: usize = calls.iter().map(|c| 1 + c.width() * c.keys.len()).sum();
        if values.len() != expected {
            return Err(StoreError::Permanent(format!(
                "decide.lua returned {} values for {} requests of {} limits",
                values.len(),
                calls.len(),
                calls.iter().map(|c| c.keys.len()).sum::<usize>()
            )));
        }
        let mut rest = values;
        Ok(calls
            .iter()
            .map(|c| {
                let (one, tail) = rest.split_at(1 + c.width() * c.keys.len());
                rest = tail;
                one.to_vec()
            })
            .collect())
    }
}

/// Whether an undo call's reply says every charge was taken back.
pub(super) fn undo_done(values: &[i64]) -> bool {
    values
        .get(1..)
        .unwrap_or_default()
        .iter()
        .all(|&done| done == 1)
}

fn micros(v: i64) -> Duration {
    Duration::from_micros(u64::try_from(v).unwrap_or(0))
}

// ---- the packed layout (ARGV[2] = "p"): a batch of plain requests with every distinct counter
// sent, keyed, read and written once. Under load most requests of a batch share their resource
// counter and each adds one consumer counter, so the script's work per request shrinks to a few
// additions and comparisons: this is what keeps Redis CPU per decision below a minimal
// check-and-charge script's (docs/performance.md). The script decides every request and
// returns each limit's state; the verdict follows from them, reset and retry from the clock.

/// Distinct counters one packed call may hold: the key index lives in the low 6 bits of a code.
const MAX_KEYS: usize = 64;
/// Largest `hits` packed into a code (`hits * 64 + index` stays an exact Lua number).
const MAX_HITS: u64 = 1 << 40;

/// A batch of plain calls in the packed layout.
pub(super) struct Packed<'a> {
    /// Distinct counters: key, limit, period in microseconds.
    pub(super) counters: Vec<(&'a str, u64, u64)>,
    /// Per call, per limit: the counter's index and the hits.
    pub(super) limits: Vec<Vec<(usize, u64)>>,
    /// Per call, its counting `m` (decide.lua): 0 all or nothing, 1 record, 3 record + stop.
    pub(super) counting: Vec<u64>,
}

impl<'a> Packed<'a> {
    /// The packed form of `calls`, or `None` when they do not fit it (a non-plain call, undo
    /// tokens wanted, a key named twice by one request, more than 64 counters, huge hits, or one
    /// key with two different limits during a reload).
    pub(super) fn new(calls: &[&'a Call]) -> Option<Self> {
        let mut index: HashMap<&str, usize> = HashMap::with_capacity(MAX_KEYS);
        let mut counters: Vec<(&str, u64, u64)> = Vec::with_capacity(MAX_KEYS);
        let mut limits = Vec::with_capacity(calls.len());
        let counting = calls.iter().map(|c| c.counting).collect();
        for call in calls {
            if !call.plain || call.reply != Reply::Answer {
                return None;
            }
            let mut mine: Vec<(usize, u64)> = Vec::with_capacity(call.keys.len());
            for (key, a) in call.keys.iter().zip(call.args.chunks(ARGS_PER_KEY)) {
                let [limit, period, hits, _meta] = *a else {
                    return None;
                };
                if hits > MAX_HITS {
                    return None;
                }
                let u = *index.entry(key.as_str()).or_insert_with(|| {
                    counters.push((key.as_str(), limit, period));
                    counters.len() - 1
                });
                if counters[u].1 != limit
                    || counters[u].2 != period
                    || mine.iter().any(|m| m.0 == u)
                {
                    return None;
                }
                mine.push((u, hits));
            }
            limits.push(mine);
        }
        (counters.len() <= MAX_KEYS).then_some(Packed {
            counters,
            limits,
            counting,
        })
    }

    /// The script arguments after ARGV[2], keys aside: U, the counters' limit and period, R, and
    /// each request's codes.
    pub(super) fn args(&self) -> Vec<u64> {
        let n: usize = self.limits.iter().map(|l| 1 + l.len()).sum();
        let mut out = Vec::with_capacity(2 + 2 * self.counters.len() + n);
        out.push(self.counters.len() as u64);
        for &(_, limit, period) in &self.counters {
            out.extend([limit, period]);
        }
        out.push(self.limits.len() as u64);
        for (l, m) in self.limits.iter().zip(&self.counting) {
            out.push(4 * l.len() as u64 + m);
            out.extend(l.iter().map(|&(u, hits)| hits * MAX_KEYS as u64 + u as u64));
        }
        out
    }

    /// Each call's answer in the general layout (`1 + 3 * n` values: admitted, then state,
    /// reset, retry per limit), from the script's reply: it decided every request and returns
    /// `now`, then per request each limit's state; a request is admitted when every limit of it
    /// is allowed (the rule of either counting), and what is left follows from `now` alone (a
    /// fixed window resets at its end, a denial retries then, or never when its hits exceed the
    /// limit). The reply is checked whole before anything is read from it.
    pub(super) fn answers(&self, reply: &[i64]) -> Result<Vec<Vec<i64>>, StoreError> {
        let expected = 1 + self.limits.iter().map(Vec::len).sum::<usize>();
        if reply.len() != expected {
            return Err(StoreError::Permanent(format!(
                "decide.lua returned {} values for {} packed requests ({expected} expected)",
                reply.len(),
                self.limits.len()
            )));
        }
        let now = reply[0];
        let mut rest = &reply[1..];
        let mut answers = Vec::with_capacity(self.limits.len());
        for limits in &self.limits {
            let (mine, tail) = rest.split_at(limits.len());
            rest = tail;
            let mut a = Vec::with_capacity(1 + 3 * limits.len());
            a.push(i64::from(mine.iter().all(|state| state & 1 == 1)));
            for (&(u, hits), &state) in limits.iter().zip(mine) {
                let (_, limit, period) = self.counters[u];
                let period = i64::try_from(period).unwrap_or(i64::MAX).max(1);
                let reset = period - now.rem_euclid(period);
                let retry = if state & 1 == 1 {
                    0
                } else if hits.max(1) > limit {
                    -1
                } else {
                    reset
                };
                a.extend([state, reset, retry]);
            }
            answers.push(a);
        }
        Ok(answers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot_call() -> Call {
        Call {
            keys: vec!["a".into(), "b".into()],
            args: vec![5, 1_000_000, 1, 0, 5, 1_000_000, 1, 0],
            reply: Reply::Tokens,
            plain: false,
            counting: 0,
            lease: Vec::new(),
        }
    }

    #[test]
    fn a_short_or_malformed_slot_reply_is_an_error_not_a_panic() {
        let call = slot_call();
        let idx = [0, 1];
        let mut outcomes = vec![
            Outcome {
                allowed: false,
                remaining: 0,
                reset: Duration::ZERO,
                retry_after: Duration::ZERO,
            };
            2
        ];
        let mut leases = Vec::new();
        let mut decode = |reply: &[i64]| {
            let into = Fold {
                outcomes: &mut outcomes,
                leases: &mut leases,
            };
            decode_slot(reply, call.layout(), &idx, into)
        };
        // Empty, short by one value, one limit short, and a reply of the answer-only width.
        for reply in [
            vec![],
            vec![1],
            vec![1, 3, 0, 0, 5],
            vec![1, 3, 0, 0, 9, 4, 3, 0, 0, 9],
        ] {
            assert!(decode(&reply).is_err(), "{reply:?} was taken");
        }
        // An undo built from what a failed reply left (nothing) undoes nothing.
        let undo = encode_undo(&call, &SlotReply::default(), &[true, true]);
        assert!(undo.keys.is_empty() && undo.args.is_empty());
        // A whole reply: each written charge is undone by its own token, only where asked.
        let slot = decode(&[1, 3, 0, 0, 77, 4, 3, 0, 0, 0, 4]).expect("whole");
        assert_eq!(
            (slot.tokens.clone(), slot.before.clone()),
            (vec![77, 0], vec![4, 4])
        );
        let undo = encode_undo(&call, &slot, &[true, true]);
        assert_eq!(undo.keys, vec!["a".to_string()], "b wrote nothing");
        assert_eq!(undo.args, vec![5, 1_000_000, 1, UNDO, 77]);
    }

    #[test]
    fn a_packed_request_is_admitted_when_every_limit_of_it_is_allowed() {
        let plain = |keys: &[&str], hits: u64| Call {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            args: keys.iter().flat_map(|_| [5, 1_000_000, hits, 0]).collect(),
            reply: Reply::Answer,
            plain: true,
            counting: 0,
            lease: Vec::new(),
        };
        let (a, b) = (plain(&["r", "c1"], 1), plain(&["r", "c2"], 1));
        let packed = Packed::new(&[&a, &b]).expect("both plain");
        // now = 2.5 s into a 1 s window: 0.5 s to its reset. `a` allowed on both limits (4
        // and 3 left); `b` allowed on `r`, denied on c2 (spent): retry at the reset.
        let reply = [2_500_000, 1 + 2 * 4, 1 + 2 * 3, 1 + 2 * 4, 0];
        let answers = packed.answers(&reply).expect("whole");
        assert_eq!(answers[0], vec![1, 9, 500_000, 0, 7, 500_000, 0]);
        assert_eq!(answers[1], vec![0, 9, 500_000, 0, 0, 500_000, 500_000]);
        // A reply one value short or long (the layout before this one carried a verdict per
        // request) is an error, never read.
        assert!(packed.answers(&reply[..4]).is_err());
        assert!(packed.answers(&[2_500_000, 1, 9, 7, 1, 9, 0]).is_err());
    }

    #[test]
    fn the_time_override_is_one_line_a_release_build_removes() {
        assert_eq!(DECIDE_LUA.matches(TIME_OVERRIDE_LUA).count(), 1);
        let without = DECIDE_LUA.replacen(TIME_OVERRIDE_LUA, "", 1);
        let reads = without
            .lines()
            .filter(|l| !l.trim_start().starts_with("--"))
            .filter(|l| l.contains("ARGV[1]"))
            .count();
        assert_eq!(reads, 0, "no other line reads the override");
        assert!(without.contains("redis.call('TIME')"));
    }
}
