//! How big the offenders view may grow, and the bound on its memory that follows from the
//! settings (checked by the tests against a counting allocator).

use super::{Bucket, DomainSlot, Entry};
use std::time::Duration;

/// Bytes added per heap allocation in [`OffenderSettings::memory_bound_bytes`]: the bound is
/// meant to hold against what the allocator really hands out, not just the requested sizes.
const ALLOCATION_SLACK: usize = 16;

/// Bytes added per lock in [`OffenderSettings::memory_bound_bytes`]: std locks need no heap on
/// Linux, but on some targets they box their OS primitive.
const LOCK_SLACK: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffenderSettings {
    /// Entries kept per domain per bucket (Space-Saving capacity K).
    pub capacity: usize,
    /// Length of one time bucket.
    pub bucket: Duration,
    /// Buckets kept: the view covers the last `buckets * bucket`.
    pub buckets: usize,
    /// Longest descriptor string kept, in bytes; longer ones are truncated at a char boundary
    /// and end with [`TRUNCATION_MARKER`] (which counts towards the limit), so one huge value
    /// cannot blow the bound. Domain names are cut the same way.
    pub max_descriptor_bytes: usize,
    /// Most domains tracked at once; denials in further domains are not recorded (see
    /// [`Offenders::dropped`]). A domain with no denials left in the window frees its slot.
    pub max_domains: usize,
}

impl Default for OffenderSettings {
    fn default() -> Self {
        Self {
            capacity: 64,
            bucket: Duration::from_secs(60),
            buckets: 5,
            max_descriptor_bytes: 256,
            max_domains: 64,
        }
    }
}

impl OffenderSettings {
    /// The settings as [`Offenders`] uses them: a zero `capacity` or `buckets` becomes 1 and a
    /// zero `bucket` becomes one second, because none of them can mean "off" without dividing by
    /// zero or evicting from an empty summary (`max_domains: 0` is the way to record nothing).
    pub fn normalized(self) -> Self {
        Self {
            capacity: self.capacity.max(1),
            bucket: if self.bucket.is_zero() {
                Duration::from_secs(1)
            } else {
                self.bucket
            },
            buckets: self.buckets.max(1),
            ..self
        }
    }

    /// The documented upper bound on heap bytes the whole tracker can hold with these settings
    /// (all domains, all buckets, all entries at max length, map/vec overheads counted generously).
    ///
    /// With `D = max_domains`, `B = buckets`, `K = capacity`, `L = max_descriptor_bytes`:
    ///
    /// ```text
    /// D * size_of(DomainSlot)                      the domain table
    /// + D * (L                                     each domain's name
    ///        + B * size_of(Bucket)                 its ring
    ///        + B * K * (size_of(Entry) + L))       every entry, string at full length
    /// + (1 + D * (2 + B + B * K)) * 16             per-allocation allocator slack
    /// + (1 + D) * 64                               per-lock slack
    /// ```
    ///
    /// Every container is sized exactly (no doubling past these capacities), so the structure's
    /// own accounting ([`Offenders::heap_bytes`]) never exceeds the terms without slack.
    pub fn memory_bound_bytes(&self) -> usize {
        let s = self.normalized();
        let (d, b, k, l) = (s.max_domains, s.buckets, s.capacity, s.max_descriptor_bytes);
        let per_domain = l
            .saturating_add(b.saturating_mul(size_of::<Bucket>()))
            .saturating_add(
                b.saturating_mul(k)
                    .saturating_mul(size_of::<Entry>().saturating_add(l)),
            );
        let allocations = d
            .saturating_mul(b.saturating_mul(k).saturating_add(b).saturating_add(2))
            .saturating_add(1);
        d.saturating_mul(size_of::<DomainSlot>())
            .saturating_add(d.saturating_mul(per_domain))
            .saturating_add(allocations.saturating_mul(ALLOCATION_SLACK))
            .saturating_add(d.saturating_add(1).saturating_mul(LOCK_SLACK))
    }

    /// Seconds the view covers (`buckets * bucket`).
    pub fn window_seconds(&self) -> u64 {
        let s = self.normalized();
        let nanos = s.bucket.as_nanos().saturating_mul(s.buckets as u128);
        u64::try_from(nanos / 1_000_000_000).unwrap_or(u64::MAX)
    }
}
