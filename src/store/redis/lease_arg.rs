//! What a call in decide.lua's lease layout carries besides the limits (K = 8: the op, the
//! request id, a reservation's lease and cap), and how its reply is shaped (two more values per
//! limit: the lease effect). Kept apart from `codec.rs`, whose layouts every call uses.

use crate::config::Algorithm;
use crate::store::LimitCheck;
use std::sync::Arc;

/// decide.lua's `op`, `id`, `lease` and `cap` of one limit of a call with a lease limit.
#[derive(Debug, Clone)]
pub(super) struct LeaseArg {
    /// 0 none, 1 take a slot, 2 free it, 3 check for one, 4 reserve, 5 settle; the request id;
    /// a reservation's lease (µs) and how many its counter holds (0 unless op 4 or 5).
    pub(super) op: u64,
    pub(super) id: Arc<str>,
    pub(super) lease_us: u64,
    pub(super) cap: u64,
}

pub(super) fn lease_arg(c: &LimitCheck) -> LeaseArg {
    let in_flight = c.key.limit.algorithm == Algorithm::InFlight;
    let terms = c.lease.as_ref().and_then(|l| l.terms());
    let (op, id) = match (&c.lease, in_flight) {
        (Some(l), false) if terms.is_some() => (4 + u64::from(l.release), Arc::clone(&l.id)),
        (Some(l), true) => (1 + u64::from(l.release), Arc::clone(&l.id)),
        (None, true) => (3, Arc::from("")),
        _ => (0, Arc::from("")),
    };
    LeaseArg {
        op,
        id,
        lease_us: terms.map_or(0, |t| t.lease_us),
        cap: terms.map_or(0, |t| u64::from(t.max)),
    }
}

/// The shape of a reply: values per limit, and whether the last two are a lease effect.
#[derive(Debug, Clone, Copy)]
pub(super) struct Layout {
    pub(super) width: usize,
    pub(super) lease: bool,
}
