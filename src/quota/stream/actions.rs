//! The actions a stream answers with, as Envoy's messages.

use crate::proto::envoy::r#type::v3::RateLimitStrategy;
use crate::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action, QuotaAssignmentAction,
};
use crate::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use crate::proto::envoy::service::rate_limit_quota::v3::BucketId;
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
