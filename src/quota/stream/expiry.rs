//! Time limits on what a stream holds (issue 38, reviews A1 and A2). A bucket its Envoy stops
//! reporting is abandoned after `RLQS_BUCKET_TIMEOUT`, so no peer holds places under the bucket
//! caps without reporting them (a dead peer's buckets, or junk held to keep newcomers out). A
//! stream that sends no first report within `RLQS_FIRST_REPORT_TIMEOUT` is ended: the domain,
//! and with it every check, comes with the first report, so a silent stream only holds a slot
//! under `RLQS_MAX_STREAMS`.

use super::{Pairs, QuotaStream, Slot};
use crate::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use std::sync::Arc;
use std::time::Duration;

impl QuotaStream {
    /// When, on sluice's clock, the first report is due or the next bucket times out.
    pub(super) fn next_expiry(&self) -> Option<Duration> {
        let s = &self.shared.settings;
        if self.domain.is_none() {
            return Some(self.opened.saturating_add(s.first_report_timeout));
        }
        self.buckets
            .values()
            .filter_map(|b| b.last_report)
            .min()
            .map(|t| t.saturating_add(s.bucket_timeout))
    }

    /// Abandons the buckets not reported within the timeout and returns their abandons, to
    /// send; `None` when the stream missed its first-report deadline and must end.
    pub(super) async fn expire(&mut self) -> Option<Vec<BucketAction>> {
        let now = self.now();
        let s = &self.shared.settings;
        if self.domain.is_none() {
            let due = self.opened.saturating_add(s.first_report_timeout);
            return (now < due).then(Vec::new);
        }
        let timeout = s.bucket_timeout;
        let stale: Vec<Pairs> = self
            .buckets
            .iter()
            .filter(|(_, b)| {
                b.last_report
                    .is_some_and(|t| now.saturating_sub(t) >= timeout)
            })
            .map(|(p, _)| Arc::clone(p))
            .collect();
        if stale.is_empty() {
            return Some(Vec::new());
        }
        let slots: Vec<Slot> = stale
            .iter()
            .map(|p| {
                self.refuse("bucket_timeout");
                self.abandon(p, 0)
            })
            .collect();
        Some(self.answer(slots).await)
    }
}
