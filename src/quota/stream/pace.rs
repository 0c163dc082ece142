//! How often a stream's reports are taken (issue 38: a minimum report interval). A report's
//! store work is a few calls per bucket; a peer sending reports back to back must not multiply
//! it. A report that comes sooner than `RLQS_MIN_REPORT_INTERVAL` after the last one taken waits
//! until then, merged with any others sent meanwhile (usage adds up, nothing is lost: a report
//! carries the requests since the previous one). What waits is bounded: past
//! `RLQS_MAX_USAGES_PER_REPORT` usages, or `RLQS_MAX_REPORT_BYTES` of bucket ids, waiting, the
//! stream reads nothing more until they are taken, and HTTP/2 flow control holds the peer (a
//! count of usages alone let reports of long ids pile up: 2 000 usages of 4 KiB ids per 8 MiB
//! report, 50 such reports before the count stopped the reading).

use crate::proto::envoy::service::rate_limit_quota::v3::RateLimitQuotaUsageReports;
use std::collections::HashMap;
use std::time::Duration;

/// What a waiting usage costs beside its id's keys and values (its own fields, its place in
/// the index), counted against `RLQS_MAX_REPORT_BYTES`.
const USAGE_BYTES: usize = 128;

/// What each entry of a waiting id costs beside its key's and value's bytes: its slot in the
/// id's map and in the index's pairs, four string headers and their allocations' rounding.
const ENTRY_BYTES: usize = 160;

/// Reports waiting for their turn, merged per bucket.
#[derive(Debug, Default)]
pub(super) struct Pending {
    report: Option<RateLimitQuotaUsageReports>,
    /// Each bucket's place in `report` (its pairs, sorted).
    index: HashMap<Vec<(String, String)>, usize>,
    /// The bytes of the bucket ids waiting (keys and values, and [`USAGE_BYTES`] each).
    bytes: usize,
    /// When the last report was taken, on sluice's clock.
    last: Option<Duration>,
}

impl Pending {
    /// `report`, if it may be taken `now` (nothing waits and the interval has passed since the
    /// last one taken); else it waits, merged.
    pub(super) fn offer(
        &mut self,
        report: RateLimitQuotaUsageReports,
        now: Duration,
        every: Duration,
    ) -> Option<RateLimitQuotaUsageReports> {
        let due = self.last.is_none_or(|l| now >= l.saturating_add(every));
        if due && self.report.is_none() {
            self.last = Some(now);
            return Some(report);
        }
        self.merge(report);
        None
    }

    /// When what waits is due, if anything waits.
    pub(super) fn due(&self, every: Duration) -> Option<Duration> {
        self.report
            .as_ref()
            .map(|_| self.last.unwrap_or_default().saturating_add(every))
    }

    /// Whether more reports may be read (what waits is under `max_usages` usages and
    /// `max_bytes` bytes).
    pub(super) fn has_room(&self, max_usages: usize, max_bytes: usize) -> bool {
        self.report
            .as_ref()
            .is_none_or(|r| r.bucket_quota_usages.len() < max_usages && self.bytes < max_bytes)
    }

    /// What waits, taken `now`.
    pub(super) fn take(&mut self, now: Duration) -> Option<RateLimitQuotaUsageReports> {
        self.index.clear();
        self.bytes = 0;
        let r = self.report.take()?;
        self.last = Some(now);
        Some(r)
    }

    fn merge(&mut self, report: RateLimitQuotaUsageReports) {
        let into = self
            .report
            .get_or_insert_with(|| RateLimitQuotaUsageReports {
                domain: report.domain.clone(),
                bucket_quota_usages: Vec::new(),
            });
        for usage in report.bucket_quota_usages {
            let Some(id) = &usage.bucket_id else {
                self.bytes = self.bytes.saturating_add(USAGE_BYTES);
                into.bucket_quota_usages.push(usage);
                continue;
            };
            let mut pairs: Vec<(String, String)> = id
                .bucket
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            pairs.sort();
            match self.index.get(&pairs) {
                Some(&i) => {
                    if let Some(u) = into.bucket_quota_usages.get_mut(i) {
                        u.num_requests_allowed = u
                            .num_requests_allowed
                            .saturating_add(usage.num_requests_allowed);
                        u.num_requests_denied = u
                            .num_requests_denied
                            .saturating_add(usage.num_requests_denied);
                    }
                }
                None => {
                    // Held twice: in the usage's id and in the index.
                    let id_bytes: usize = pairs
                        .iter()
                        .map(|(k, v)| 2 * (k.len() + v.len()) + ENTRY_BYTES)
                        .sum();
                    self.bytes = self
                        .bytes
                        .saturating_add(USAGE_BYTES)
                        .saturating_add(id_bytes);
                    self.index.insert(pairs, into.bucket_quota_usages.len());
                    into.bucket_quota_usages.push(usage);
                }
            }
        }
    }
}

/// `age` scaled by a factor in [0.9, 1.1] drawn from `seed`'s hash, so streams opened together
/// do not all end together (saturating: never a panic, whatever the age).
pub(super) fn jittered(age: Duration, seed: u64) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(seed);
    let unit = (h.finish() >> 11) as f64 / (1u64 << 53) as f64;
    Duration::try_from_secs_f64(age.as_secs_f64() * (0.9 + 0.2 * unit)).unwrap_or(Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
    use crate::proto::envoy::service::rate_limit_quota::v3::BucketId;

    fn report(buckets: &[(&str, u64)]) -> RateLimitQuotaUsageReports {
        RateLimitQuotaUsageReports {
            domain: "d".into(),
            bucket_quota_usages: buckets
                .iter()
                .map(|(v, n)| BucketQuotaUsage {
                    bucket_id: Some(BucketId {
                        bucket: [("k".to_string(), v.to_string())].into_iter().collect(),
                    }),
                    time_elapsed: None,
                    num_requests_allowed: *n,
                    num_requests_denied: 1,
                })
                .collect(),
        }
    }

    #[test]
    fn reports_sooner_than_the_interval_wait_merged_and_lose_nothing() {
        let s = Duration::from_secs(1);
        let mut p = Pending::default();
        assert!(p.offer(report(&[("a", 1)]), Duration::ZERO, s).is_some());
        // 100 reports within the next second: none taken, their usage added up.
        for i in 0..100 {
            let now = Duration::from_millis(i * 5);
            assert!(p.offer(report(&[("a", 2), ("b", 3)]), now, s).is_none());
        }
        assert_eq!(p.due(s), Some(s));
        let r = p.take(s).expect("waiting");
        let got: Vec<(u64, u64)> = r
            .bucket_quota_usages
            .iter()
            .map(|u| (u.num_requests_allowed, u.num_requests_denied))
            .collect();
        assert_eq!(got, vec![(200, 100), (300, 100)]);
        assert_eq!(p.due(s), None);
        // The next one within a second of that take waits too; after it, it is taken at once.
        assert!(p.offer(report(&[("a", 1)]), s + s / 2, s).is_none());
        assert!(p.take(s * 2).is_some());
        assert!(p.offer(report(&[("a", 1)]), s * 3, s).is_some());
    }

    #[test]
    fn an_absurd_age_saturates_instead_of_panicking() {
        assert!(jittered(Duration::MAX, 3) >= Duration::MAX / 2);
        let day = Duration::from_secs(86_400);
        let j = jittered(day, 3);
        assert!(j >= day.mul_f64(0.9) && j <= day.mul_f64(1.1), "{j:?}");
    }

    #[test]
    fn what_waits_is_bounded() {
        let s = Duration::from_secs(1);
        let mut p = Pending::default();
        assert!(p.offer(report(&[("a", 1)]), Duration::ZERO, s).is_some());
        assert!(p.has_room(3, 1 << 20));
        let _ = p.offer(report(&[("a", 1), ("b", 1), ("c", 1)]), Duration::ZERO, s);
        assert!(!p.has_room(3, 1 << 20), "three usages wait: read no more");
        let _ = p.take(s);
        assert!(p.has_room(3, 1 << 20));
        // The bytes of the ids waiting count too: one usage of a 4 KiB value is over 8 KiB
        // (held twice), a second of the same bucket adds nothing; an entry costs its own
        // overhead besides its bytes.
        let long = "v".repeat(4096);
        let _ = p.offer(report(&[(&long, 1)]), Duration::ZERO, s);
        assert!(p.has_room(100, 16 * 1024));
        assert!(!p.has_room(100, 8 * 1024), "{} bytes wait", p.bytes);
        let before = p.bytes;
        let _ = p.offer(report(&[(&long, 1)]), Duration::ZERO, s);
        assert_eq!(p.bytes, before, "merged into the bucket already waiting");
        let _ = p.take(s);
        assert_eq!(p.bytes, 0);
    }
}
