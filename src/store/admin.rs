//! What the admin API asks of the place the counters live, beside deciding: reset the counters
//! at or below a descriptor prefix, and keep the overrides every replica applies. Why here and
//! not in the admin module: a reset must know the store's key layout (Redis) or its counter
//! identities (memory), and overrides must live where every replica sharing the counters reads
//! them (Redis), so each backend implements [`CounterAdmin`] next to its counters.
//!
//! Every write (a reset, an override set or removed) bumps a *generation* the replicas poll
//! (one cheap read each); a replica that sees it change reloads the overrides and drops its
//! local deny cache, so a reset or a raised limit is not answered from a stale denial.

use super::{BoxFuture, StoreError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Live overrides the store keeps at most (`SetOverride` past it is refused).
pub const MAX_OVERRIDES: usize = 1000;
/// Longest override: an override is for an incident, a launch, a deal; a permanent change
/// belongs in the config.
pub const MAX_OVERRIDE_TTL_SECS: u64 = 90 * 24 * 3600;

/// What an override sets a limit to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OverrideLimit {
    /// This many per the limit's own period.
    Requests(u32),
    /// Never denied (still counted).
    Unlimited,
    /// Always denied.
    Deny,
}

impl OverrideLimit {
    /// The limit the algorithms decide with.
    pub fn requests(self) -> u32 {
        match self {
            OverrideLimit::Requests(n) => n,
            OverrideLimit::Unlimited => u32::MAX,
            OverrideLimit::Deny => 0,
        }
    }
}

impl std::fmt::Display for OverrideLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OverrideLimit::Requests(n) => write!(f, "{n}"),
            OverrideLimit::Unlimited => f.write_str("unlimited"),
            OverrideLimit::Deny => f.write_str("deny"),
        }
    }
}

/// Which counters an override applies to: a domain, the entries keying the counters, and
/// optionally one limit's `name` (empty: every limit keyed by those entries).
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct OverrideId {
    pub domain: String,
    pub entries: Vec<(String, String)>,
    pub limit_name: String,
}

impl OverrideId {
    /// The field an override is stored under: JSON of the identity, unambiguous whatever the
    /// values hold.
    pub fn field(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// An override as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoredOverride {
    pub id: OverrideId,
    pub limit: OverrideLimit,
    pub expires_unix_ms: u64,
    pub set_by: String,
    pub set_unix_ms: u64,
    pub reason: String,
}

impl StoredOverride {
    /// Still in force at `now_ms`.
    pub fn live(&self, now_ms: u64) -> bool {
        now_ms < self.expires_unix_ms
    }

    /// The stored value: the expiry first (a script reads it without JSON), then the JSON.
    pub fn encode(&self) -> String {
        format!(
            "{}|{}",
            self.expires_unix_ms,
            serde_json::to_string(self).unwrap_or_default()
        )
    }

    pub fn decode(value: &str) -> Option<Self> {
        let (_, json) = value.split_once('|')?;
        serde_json::from_str(json).ok()
    }
}

/// What a reset did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResetCount {
    /// Counters reset.
    pub counters: u64,
    /// Whether `counters` is a count (the memory store keeps no keys: it resets without
    /// counting).
    pub counted: bool,
}

/// Resets the home store keeps for the regions (the latest; older ones are dropped).
pub const MAX_RESET_RECORDS: usize = 64;

/// A reset as the home store keeps it for every region (`store/global/admin.rs`): a global
/// limit's counter lives at home, its pools in every region, and each region's replicas empty
/// their pools of it when they see the record.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ResetRecord {
    /// Its place in the home store's sequence (the generation it was written at).
    #[serde(skip)]
    pub seq: u64,
    pub domain: String,
    pub prefix: Vec<(String, String)>,
    /// The first of a reset's two records (written before home's reset; the second, after
    /// it, closes it). Records from before this field read as closed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub opens: bool,
}

impl ResetRecord {
    /// The highest record a replica that applied records up to `applied` may stamp the pools
    /// it creates with ([`crate::store::global::RegionPool::stamp`]): below every reset still
    /// under way (a first record with no later second record of the same prefix), whose home
    /// reset may not have fenced its counters yet: a pool stamped past it could refund units
    /// of the count that reset is about to forget.
    pub fn stamp_below_open(records: &[ResetRecord], applied: u64) -> u64 {
        let open = records
            .iter()
            .filter(|r| r.opens)
            .filter(|r| {
                !records.iter().any(|c| {
                    !c.opens && c.seq > r.seq && c.domain == r.domain && c.prefix == r.prefix
                })
            })
            .map(|r| r.seq)
            .min();
        match open {
            Some(seq) => applied.min(seq.saturating_sub(1)),
            None => applied,
        }
    }

    /// The record from which a pool (or slice) cleared for it is left whole by this record's
    /// clear: the record itself, or, for a reset's closing record, its fence (the opening
    /// record's successor, which home's reset fenced the counters at: a refill charged after
    /// home's reset cleared its pool for it as it landed, and its units are on the fresh count).
    pub fn keep_from(&self, records: &[ResetRecord]) -> u64 {
        if self.opens {
            return self.seq;
        }
        // Its opening record: the latest of its prefix before it, with no record between (a
        // reset run beside it may have forgotten what was charged past this one's fence).
        let opening = records
            .iter()
            .filter(|r| r.seq < self.seq && r.domain == self.domain && r.prefix == self.prefix)
            .max_by_key(|r| r.seq)
            .filter(|r| r.opens);
        match opening {
            Some(r) if !records.iter().any(|o| o.seq > r.seq && o.seq < self.seq) => {
                r.seq.saturating_add(1).min(self.seq)
            }
            _ => self.seq,
        }
    }

    /// Whether `domain`'s counter keyed by `entries` is among those this reset reset.
    pub fn covers(&self, domain: &str, entries: &[(String, String)]) -> bool {
        self.domain == domain && entries.starts_with(&self.prefix)
    }
}

/// The admin side of a counter store.
pub trait CounterAdmin: Send + Sync + std::fmt::Debug {
    /// Resets every counter of `domain` whose entries start with `prefix` (at least one entry):
    /// what they counted is gone, what comes after is counted afresh. `domain_tag`: the
    /// domain's counters share one hash tag (`hash_tag: domain`).
    fn reset<'a>(
        &'a self,
        domain: &'a str,
        prefix: &'a [(String, String)],
        domain_tag: bool,
    ) -> BoxFuture<'a, Result<ResetCount, StoreError>>;

    /// The generation (changes with every admin write) and the overrides stored, expired ones
    /// possibly included.
    fn overrides(&self) -> BoxFuture<'_, Result<(u64, Vec<StoredOverride>), StoreError>>;

    /// The generation alone: what every replica polls, one cheap read.
    fn generation(&self) -> BoxFuture<'_, Result<u64, StoreError>>;

    /// Stores `o` in place of the override of the same id (returned), dropping expired ones;
    /// refused when `max` others are live at `now_ms`.
    fn put_override<'a>(
        &'a self,
        o: &'a StoredOverride,
        now_ms: u64,
        max: usize,
    ) -> BoxFuture<'a, Result<Option<StoredOverride>, StoreError>>;

    /// Removes the override `id`, returning it if it was live at `now_ms`.
    fn delete_override<'a>(
        &'a self,
        id: &'a OverrideId,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<Option<StoredOverride>, StoreError>>;

    /// Keeps a record of a reset for the regions (a home store's; others keep none), the
    /// first of its two (`opens`) or the second, and returns its sequence number (0: none).
    fn record_reset<'a>(
        &'a self,
        _domain: &'a str,
        _prefix: &'a [(String, String)],
        _opens: bool,
    ) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(async { Ok(0) })
    }

    /// [`CounterAdmin::reset`] at a home store, leaving beside each counter it resets a fence
    /// at `fence` (kept at its highest, as long as the counter's window): a refund of units a
    /// region's pool drained is refused there unless the pool was cleared for a reset record
    /// at or past the fence ([`CounterStore::refund_fenced`](crate::store::CounterStore)), so
    /// units charged on the count the reset forgot never come off the fresh count, however
    /// late their refund lands (`store/global/admin.rs`). A store that is never a home store
    /// (the embedded one) resets as [`CounterAdmin::reset`] does.
    fn reset_fenced<'a>(
        &'a self,
        domain: &'a str,
        prefix: &'a [(String, String)],
        domain_tag: bool,
        _fence: u64,
    ) -> BoxFuture<'a, Result<ResetCount, StoreError>> {
        self.reset(domain, prefix, domain_tag)
    }

    /// The resets recorded, oldest first (at most [`MAX_RESET_RECORDS`]).
    fn resets(&self) -> BoxFuture<'_, Result<Vec<ResetRecord>, StoreError>> {
        Box::pin(async { Ok(Vec::new()) })
    }
}

/// What holds denials of counters as they were (the local deny cache): dropped when an admin
/// write (a reset, an override) may have given them room.
pub trait Forget: Send + Sync + std::fmt::Debug {
    fn forget_all(&self);
}

/// The refusal of an override past the cap.
pub fn too_many(max: usize) -> StoreError {
    StoreError::Permanent(format!(
        "{max} overrides are live already (the most the store keeps): delete one or wait for \
         one to expire"
    ))
}

/// Overrides and the generation in this process: the memory store's (that replica only), and
/// any store without a shared place for them.
#[derive(Debug, Default)]
pub struct LocalOverrides {
    generation: AtomicU64,
    overrides: Mutex<HashMap<OverrideId, StoredOverride>>,
}

impl LocalOverrides {
    pub fn bump(&self) -> u64 {
        self.generation.fetch_add(1, Ordering::AcqRel) + 1
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    pub fn all(&self) -> (u64, Vec<StoredOverride>) {
        let map = self.overrides.lock().unwrap_or_else(|e| e.into_inner());
        (self.generation(), map.values().cloned().collect())
    }

    pub fn put(
        &self,
        o: &StoredOverride,
        now_ms: u64,
        max: usize,
    ) -> Result<Option<StoredOverride>, StoreError> {
        let mut map = self.overrides.lock().unwrap_or_else(|e| e.into_inner());
        map.retain(|_, v| v.live(now_ms));
        let others = map.keys().filter(|k| **k != o.id).count();
        if others >= max {
            return Err(too_many(max));
        }
        let before = map.insert(o.id.clone(), o.clone());
        drop(map);
        self.bump();
        Ok(before)
    }

    pub fn delete(&self, id: &OverrideId, now_ms: u64) -> Option<StoredOverride> {
        let mut map = self.overrides.lock().unwrap_or_else(|e| e.into_inner());
        let before = map.remove(id).filter(|o| o.live(now_ms));
        drop(map);
        self.bump();
        before
    }
}

/// A stack whose store has no admin side (a test's fake store): resets are refused; overrides
/// are kept in this process.
#[derive(Debug, Default)]
pub struct NoReset(pub LocalOverrides);

impl CounterAdmin for NoReset {
    fn reset<'a>(
        &'a self,
        _domain: &'a str,
        _prefix: &'a [(String, String)],
        _domain_tag: bool,
    ) -> BoxFuture<'a, Result<ResetCount, StoreError>> {
        Box::pin(async {
            Err(StoreError::Permanent(
                "this store cannot reset counters".into(),
            ))
        })
    }

    fn overrides(&self) -> BoxFuture<'_, Result<(u64, Vec<StoredOverride>), StoreError>> {
        Box::pin(async { Ok(self.0.all()) })
    }

    fn generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(async { Ok(self.0.generation()) })
    }

    fn put_override<'a>(
        &'a self,
        o: &'a StoredOverride,
        now_ms: u64,
        max: usize,
    ) -> BoxFuture<'a, Result<Option<StoredOverride>, StoreError>> {
        Box::pin(async move { self.0.put(o, now_ms, max) })
    }

    fn delete_override<'a>(
        &'a self,
        id: &'a OverrideId,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<Option<StoredOverride>, StoreError>> {
        Box::pin(async move { Ok(self.0.delete(id, now_ms)) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o(value: &str, expires: u64) -> StoredOverride {
        StoredOverride {
            id: OverrideId {
                domain: "d".into(),
                entries: vec![("tenant".into(), value.into())],
                limit_name: String::new(),
            },
            limit: OverrideLimit::Requests(50),
            expires_unix_ms: expires,
            set_by: "alice".into(),
            set_unix_ms: 1,
            reason: "a | b".into(),
        }
    }

    #[test]
    fn an_override_round_trips_through_its_stored_value() {
        let a = o("ac|me}", 1000);
        assert_eq!(StoredOverride::decode(&a.encode()), Some(a.clone()));
        assert!(a.encode().starts_with("1000|"));
        assert_eq!(StoredOverride::decode("1000|not json"), None);
    }

    #[test]
    fn an_override_scales_a_burst_and_never_grows_a_log_or_slots_past_their_caps() {
        use crate::config::{Algorithm, Limit, Unit, MAX_IN_FLIGHT, MAX_SLIDING_LOG_LIMIT};
        let check = |algorithm, burst, n| {
            let limit = Limit {
                algorithm,
                burst,
                ..Limit::fixed(10, Unit::Minute)
            };
            let mut c = crate::store::LimitCheck::for_tests("d", "v", limit, 1);
            c.admin_limit = Some(n);
            let p = c.params();
            (p.limit, p.burst)
        };
        assert_eq!(check(Algorithm::FixedWindow, 0, 50), (50, 0));
        assert_eq!(
            check(Algorithm::TokenBucket, 4, 50),
            (50, 20),
            "burst x5 with the rate"
        );
        let unlimited = OverrideLimit::Unlimited.requests();
        assert_eq!(
            check(Algorithm::SlidingLog, 0, unlimited).0,
            MAX_SLIDING_LOG_LIMIT
        );
        assert_eq!(check(Algorithm::InFlight, 0, unlimited).0, MAX_IN_FLIGHT);
        assert_eq!(check(Algorithm::FixedWindow, 0, unlimited).0, u32::MAX);
    }

    #[test]
    fn local_overrides_are_capped_replaced_and_expire() {
        let l = LocalOverrides::default();
        assert_eq!(l.put(&o("a", 100), 0, 2).unwrap(), None);
        assert_eq!(l.put(&o("b", 100), 0, 2).unwrap(), None);
        // A third is refused; replacing one is not.
        assert!(l.put(&o("c", 100), 0, 2).is_err());
        assert_eq!(l.put(&o("a", 200), 0, 2).unwrap(), Some(o("a", 100)));
        // Expired ones make room.
        assert_eq!(l.put(&o("c", 300), 150, 2).unwrap(), None);
        let (generation, all) = l.all();
        assert_eq!(generation, 4);
        assert_eq!(all.len(), 2, "{all:?}");
        assert_eq!(l.delete(&o("a", 0).id, 150), Some(o("a", 200)));
        assert_eq!(l.delete(&o("a", 0).id, 150), None);
    }
}
