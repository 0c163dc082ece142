//! Time limits on what a stream holds (issue 38, reviews A1 and A2). A bucket its Envoy stops
//! reporting is abandoned after `RLQS_BUCKET_TIMEOUT`, so no peer holds places under the bucket
//! caps without reporting them (a dead peer's buckets, or junk held to keep newcomers out). A
//! stream that sends no first report within `RLQS_FIRST_REPORT_TIMEOUT` is ended: the domain,
//! and with it every check, comes with the first report, so a silent stream only holds a slot
//! under `RLQS_MAX_STREAMS`. A stream that holds no tracked bucket (none of its buckets names
//! a limit, or all were abandoned) for `RLQS_IDLE_STREAM_TIMEOUT` is ended too (issue 50,
//! review 5a: one report with no usages held a place for the connection's whole life, 24 h);
//! an Envoy that still needs it opens a new one with its next report.

use super::{Pairs, QuotaStream, Slot};
use crate::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use std::sync::Arc;
use std::time::Duration;
use tonic::Status;

impl QuotaStream {
    /// When, on sluice's clock, the first report is due, the stream holding no bucket times
    /// out, or the next bucket times out.
    pub(super) fn next_expiry(&self) -> Option<Duration> {
        let s = &self.shared.settings;
        if self.domain.is_none() {
            return Some(self.opened.saturating_add(s.first_report_timeout));
        }
        if let Some(since) = self.empty_since {
            return Some(since.saturating_add(s.idle_stream_timeout));
        }
        self.buckets
            .values()
            .filter_map(|b| b.last_report)
            .min()
            .map(|t| t.saturating_add(s.bucket_timeout))
    }

    /// Abandons the buckets not reported within the timeout and returns their abandons, to
    /// send; the status to end the stream with when it missed its first-report deadline or
    /// held no bucket for too long.
    pub(super) async fn expire(&mut self) -> Result<Vec<BucketAction>, Status> {
        let now = self.now();
        let s = &self.shared.settings;
        if self.domain.is_none() {
            let due = self.opened.saturating_add(s.first_report_timeout);
            if now < due {
                return Ok(Vec::new());
            }
            let why = "no first usage report in time (RLQS_FIRST_REPORT_TIMEOUT)";
            return Err(Status::deadline_exceeded(why));
        }
        if let Some(since) = self.empty_since {
            let timeout = s.idle_stream_timeout;
            if now.saturating_sub(since) < timeout {
                return Ok(Vec::new());
            }
            self.refuse("idle_stream");
            return Err(Status::deadline_exceeded(format!(
                "the stream held no limited bucket for {} (RLQS_IDLE_STREAM_TIMEOUT)",
                crate::duration::format_go(timeout)
            )));
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
            return Ok(Vec::new());
        }
        let slots: Vec<Slot> = stale
            .iter()
            .map(|p| {
                self.refuse("bucket_timeout");
                self.abandon(p, 0)
            })
            .collect();
        Ok(self.answer(slots).await)
    }
}
