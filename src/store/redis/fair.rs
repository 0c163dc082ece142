//! A home store's grant of a global limit's refill capped at the region's max-min share in
//! the same script call (`decide.lua`'s "s" mode, `store/global/fair.rs`): its encoding and its
//! reply, beside the codec they extend (kept apart: the codec is the request path's).

use super::codec::{self, decode, Call, Fold, Reply};
use crate::store::{CounterKey, LimitCheck, Outcome, StoreError};
use std::time::Duration;

/// A home store's grant of a global limit's refill (`check`), capped at the region's share as
/// the regions' reports in `regions` (a key in the counter's slot) have them ([`Reply::Fair`]).
pub(super) fn encode(
    check: &LimitCheck,
    ask: &crate::store::global::FairAsk,
    regions: String,
    key_of: impl Fn(&CounterKey) -> String,
) -> Call {
    let mut call = codec::encode(std::slice::from_ref(check), &[0], true, key_of);
    call.plain = false;
    call.counting = 0;
    call.reply = Reply::Fair {
        mine: ask.mine,
        end_ms: ask.end_ms,
        fresh_ms: crate::store::global::FRESH_MS,
        ahead_ms: crate::store::global::POOL_AHEAD_MS,
        max_regions: crate::store::global::MAX_REGIONS,
        region: ask.region.as_str().into(),
    };
    // Not a limit: the script reads the reports from the end of KEYS.
    call.keys.push(regions);
    call
}

/// A fair grant's reply ([`encode`]): the answer, then the hits charged (or, denied, asked;
/// 0: the region's share was spent, and the answer is a check's: what home has left), then the
/// charged window's reset fence.
pub(super) fn decode_reply(
    values: &[i64],
    call: &Call,
) -> Result<crate::store::global::FairGrant, StoreError> {
    use crate::store::global::FairGrant;
    let bad = || StoreError::Permanent(format!("unexpected fair grant reply {values:?}"));
    let (fence, rest) = values.split_last().ok_or_else(bad)?;
    let (hits, answer) = rest.split_last().ok_or_else(bad)?;
    let hits = u64::try_from(*hits).map_err(|_| bad())?;
    let fence = u64::try_from(*fence).map_err(|_| bad())?;
    let (mut outcomes, mut leases) = (vec![DENIED_OUTCOME], Vec::new());
    let into = Fold {
        outcomes: &mut outcomes,
        leases: &mut leases,
    };
    decode(answer, call.layout(), &[0], into)?;
    Ok(FairGrant {
        hits,
        outcome: outcomes.first().copied(),
        fence,
    })
}

const DENIED_OUTCOME: Outcome = Outcome {
    allowed: false,
    remaining: 0,
    reset: Duration::ZERO,
    retry_after: Duration::ZERO,
};
