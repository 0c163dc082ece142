//! The packed layout of `decide.lua` (ARGV[2] = "p", documented at the script's top): a batch of
//! plain requests (fixed windows, no flags) with every distinct counter sent, keyed, read and
//! written once. Under load most requests of a batch share their resource counter and each adds
//! one consumer counter, so the script's work per request shrinks to a few additions and
//! comparisons: this is what keeps Redis CPU per decision below a minimal check-and-charge
//! script's (README "Performance").
//!
//! The script returns only the clock and each counter before and after the call; the answers
//! (remaining, reset, retry of every limit) are computed here by replaying the same arithmetic
//! request by request, and the replay must end where the script did.

use super::Call;
use crate::algorithm::MAX_COUNT;
use crate::store::StoreError;
use std::collections::HashMap;

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
            if !call.plain || call.tokens {
                return None;
            }
            let mut mine: Vec<(usize, u64)> = Vec::with_capacity(call.keys.len());
            for (key, a) in call.keys.iter().zip(call.args.chunks(3)) {
                let [limit, period, hits] = *a else {
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

    /// Replays the script's decisions from its reply and answers each call as the general
    /// layout would (`1 + 3 * n` values: admitted, then state, reset, retry per limit).
    pub(super) fn answers(&self, reply: &[i64]) -> Result<Vec<Vec<i64>>, StoreError> {
        let u_len = self.counters.len();
        if reply.len() != 1 + 2 * u_len {
            return Err(StoreError::Permanent(format!(
                "decide.lua returned {} values for {u_len} packed counters",
                reply.len()
            )));
        }
        let now = reply[0];
        let mut count: Vec<i64> = reply[1..=u_len].iter().map(|&c| c.max(0)).collect();
        // Reset of each counter's window: the window is aligned to the epoch, as in the script.
        let reset: Vec<i64> = self
            .counters
            .iter()
            .map(|&(_, _, period)| {
                let p = i64::try_from(period).unwrap_or(i64::MAX).max(1);
                p - now.rem_euclid(p)
            })
            .collect();
        let mut answers = Vec::with_capacity(self.limits.len());
        for (limits, &m) in self.limits.iter().zip(&self.counting) {
            if m != 0 {
                answers.push(self.record(limits, m, &mut count, &reset));
                continue;
            }
            let fits = |&(u, hits): &(usize, u64)| {
                let limit = self.counters[u].1 as i64;
                let hits = hits as i64;
                if hits == 0 {
                    count[u] < limit
                } else {
                    count[u] + hits <= limit
                }
            };
            let admitted = limits.iter().all(fits);
            let mut a = Vec::with_capacity(1 + 3 * limits.len());
            a.push(i64::from(admitted));
            for l @ &(u, hits) in limits {
                let limit = self.counters[u].1 as i64;
                let ok = fits(l);
                let after = if admitted {
                    count[u] + hits as i64
                } else {
                    count[u]
                };
                a.push(i64::from(ok) + 2 * (limit - after).max(0));
                a.push(reset[u]);
                a.push(match ok {
                    true => 0,
                    false if (hits as i64).max(1) > limit => -1,
                    false => reset[u],
                });
            }
            if admitted {
                for &(u, hits) in limits {
                    count[u] += hits as i64;
                }
            }
            answers.push(a);
        }
        if count[..] != reply[1 + u_len..] {
            return Err(StoreError::Permanent(
                "decide.lua's packed counts differ from their replay".into(),
            ));
        }
        Ok(answers)
    }

    /// The replay of one recording request (`m` 1, or 3 with stop): every limit is charged,
    /// saturating, whatever its verdict; with stop, if one exceeds, only those that exceed.
    fn record(
        &self,
        limits: &[(usize, u64)],
        m: u64,
        count: &mut [i64],
        reset: &[i64],
    ) -> Vec<i64> {
        let max_count = MAX_COUNT as i64;
        let limit_of = |u: usize| self.counters[u].1 as i64;
        let after: Vec<i64> = limits
            .iter()
            .map(|&(u, hits)| (count[u] + hits as i64).min(max_count))
            .collect();
        let ok: Vec<bool> = limits
            .iter()
            .zip(&after)
            .map(|(&(u, _), &a)| a <= limit_of(u))
            .collect();
        let over = ok.contains(&false);
        let mut a = Vec::with_capacity(1 + 3 * limits.len());
        a.push(i64::from(!over));
        for (n, &(u, hits)) in limits.iter().enumerate() {
            let charged = m < 2 || !over || !ok[n];
            let left = if charged { after[n] } else { count[u] };
            a.push(i64::from(ok[n]) + 2 * (limit_of(u) - left).max(0));
            a.push(reset[u]);
            a.push(match ok[n] {
                true => 0,
                false if (hits as i64).max(1) > limit_of(u) => -1,
                false => reset[u],
            });
        }
        for (n, &(u, _)) in limits.iter().enumerate() {
            if m < 2 || !over || !ok[n] {
                count[u] = after[n];
            }
        }
        a
    }
}
