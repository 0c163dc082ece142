//! `decide.lua`'s `meta` argument: a limit's algorithm, its flags and, above them, a token
//! bucket's burst or a pinned fixed window's start (see the top of the script).

use crate::config::Algorithm;
use crate::store::LimitCheck;

/// The flags of `meta` (shifted left by 2 into it), and where the burst starts.
pub(super) const FLAG_SHADOW: u64 = 1;
pub(super) const FLAG_REFUND: u64 = 2;
pub(super) const FLAG_QUOTA: u64 = 8;
pub(super) const FLAG_RECORD: u64 = 16;
pub(super) const FLAG_STOP: u64 = 32;
pub(super) const META_BURST_SHIFT: u32 = 8;
/// The counting flags as placed in `meta`: what a plain request may carry (one value for all
/// its limits), sent as its counting `m` instead.
pub(super) const COUNTING_META: u64 = (FLAG_RECORD | FLAG_STOP) << 2;
/// The undo flag, as placed in `meta`.
pub(super) const UNDO: u64 = 4 << 2;

/// `c`'s `meta`. `whole`: the call decides the whole request (quota limits as quota; one slot
/// of several sends them as shadow and the caller applies the rule).
pub(super) fn meta(c: &LimitCheck, whole: bool) -> u64 {
    let quota = if whole { FLAG_QUOTA } else { FLAG_SHADOW };
    let flags = if c.shadow { FLAG_SHADOW } else { 0 }
        | if c.refund { FLAG_REFUND } else { 0 }
        | if c.quota { quota } else { 0 }
        | if c.record { FLAG_RECORD } else { 0 }
        | if c.stop_over && c.record {
            FLAG_STOP
        } else {
            0
        };
    // Above the flags: the burst (an admin override scales it), or a pinned fixed window's
    // start in milliseconds, doubled, + 1 for a calendar window (`pinned_of` in window.lua):
    // a leased window of 1500ms starts on half seconds, and keeps its plain key.
    let p = c.params();
    let high = match p.window_start {
        Some(start) if p.algorithm == Algorithm::FixedWindow => {
            let calendar = u64::from(c.key.limit.period.calendar().is_some());
            (start / 1000) * 2 + calendar
        }
        _ => u64::from(p.burst),
    };
    u64::from(c.key.limit.algorithm.code()) | flags << 2 | high << META_BURST_SHIFT
}
