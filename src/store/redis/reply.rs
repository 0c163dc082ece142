//! What a script call asks `decide.lua` to return (its ARGV[2]): one enum, so the codec, the
//! batcher and the Cluster path name the same modes.

/// What a call asks the script to return (ARGV[2], see the top of `decide.lua`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Reply {
    /// "0": each limit's outcome.
    Answer,
    /// "1": the outcome, what an undo of the charge needs, and what the counter had left
    /// before the request (one slot of a Cluster request spanning slots).
    Tokens,
    /// "d": as `Tokens`, deciding without writing anything.
    Dry,
    /// "x<a><o>": as `Tokens`, with the verdict of the request's other slots folded in.
    Verdict { admitted: bool, over: bool },
    /// "g<ttl_ms>": as `Answer`, applied at most once: the call's last key is its guard (a
    /// write-back of usage decided locally, `FAILURE_MODE=local`, retried without charging
    /// twice). The script returns `{-1}` when the guard was already set.
    Guarded { ttl_ms: u64 },
    /// "f<cleared>": as `Answer`, for a home store's refund of units a region's pool drained
    /// (one limit): refused, `{-1}`, if a reset fenced the counter's window past `cleared`.
    Fenced { cleared: u64 },
    /// "s<mine>:<end_ms>:<fresh_ms>:<ahead_ms>:<max_regions>:<region>": as `Answer`, for a
    /// home store's grant of a global limit's refill (one limit), its hits capped at the
    /// region's max-min share as the regions' reports (the call's last key) have them; the
    /// reply is followed by the hits charged or asked (0: the share was spent, a check only).
    Fair {
        mine: u64,
        end_ms: u64,
        fresh_ms: u64,
        ahead_ms: u64,
        max_regions: usize,
        region: std::sync::Arc<str>,
    },
    /// "u": takes back what a committed Cluster slot's `in_flight` takes and reservations
    /// changed (a request another slot then denied); one value per limit, 1 if taken back.
    Unlease,
}

impl Reply {
    /// ARGV[2].
    pub(super) fn arg(&self) -> String {
        match self {
            Reply::Answer => "0".into(),
            Reply::Tokens => "1".into(),
            Reply::Dry => "d".into(),
            Reply::Verdict { admitted, over } => {
                format!("x{}{}", u8::from(*admitted), u8::from(*over))
            }
            Reply::Guarded { ttl_ms } => format!("g{}", (*ttl_ms).max(1)),
            Reply::Fenced { cleared } => format!("f{cleared}"),
            Reply::Fair {
                mine,
                end_ms,
                fresh_ms,
                ahead_ms,
                max_regions,
                region,
            } => format!("s{mine}:{end_ms}:{fresh_ms}:{ahead_ms}:{max_regions}:{region}"),
            Reply::Unlease => "u".into(),
        }
    }
}
