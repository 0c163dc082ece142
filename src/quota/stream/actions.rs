//! The actions a stream answers with, as Envoy's messages.

use crate::proto::envoy::r#type::v3::RateLimitStrategy;
use crate::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action, QuotaAssignmentAction,
};
use crate::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use crate::proto::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaUsageReports};
use crate::quota::allocate::ttl;
use std::time::Duration;

/// The bucket id Envoy knows a bucket by.
pub(super) fn bucket_id(pairs: &[(String, String)]) -> BucketId {
    BucketId {
        bucket: pairs.iter().cloned().collect(),
    }
}

pub(super) fn abandon_action(id: BucketId) -> BucketAction {
    BucketAction {
        bucket_id: Some(id),
        bucket_action: Some(Action::AbandonAction(AbandonAction {})),
    }
}

pub(super) fn assign(id: BucketId, strategy: RateLimitStrategy, ttl_for: Duration) -> BucketAction {
    BucketAction {
        bucket_id: Some(id),
        bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(ttl(ttl_for)),
            rate_limit_strategy: Some(strategy),
        })),
    }
}

/// Why a stream ends on what it received (`None`: its peer closed it): a first report without
/// its domain (the proto requires one: without it no bucket names a limit, and nothing reported
/// could be recorded), or a report refused before decoding (too large, too many usages: logged).
pub(super) fn ending(
    received: Result<Option<RateLimitQuotaUsageReports>, tonic::Status>,
    stream: u64,
) -> Option<tonic::Status> {
    match received {
        Ok(Some(_)) => Some(tonic::Status::invalid_argument(
            "the first usage report of a stream must name its domain",
        )),
        Ok(None) => None,
        Err(status) => {
            if matches!(
                status.code(),
                tonic::Code::InvalidArgument | tonic::Code::OutOfRange
            ) {
                tracing::warn!(stream, error = %status.message(), "RLQS report refused");
            }
            Some(status)
        }
    }
}
