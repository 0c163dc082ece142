//! The admin API's messages to and from the service's and the store's types, with the checks a
//! request's fields get (a clear INVALID_ARGUMENT naming the field).

use crate::proto::sluice::admin::v1 as pb;
use crate::service::{Inspected, RequestCaps};
use crate::store::admin::{OverrideId, OverrideLimit, StoredOverride, MAX_OVERRIDE_TTL_SECS};
use tonic::Status;

/// Bytes a write's `reason` or `limit_name` may have: they go into the audit lines and the
/// stored override, so a caller cannot make either carry megabytes.
pub const MAX_TEXT_BYTES: usize = 1024;

/// INVALID_ARGUMENT naming `field` when `value` is longer than [`MAX_TEXT_BYTES`].
pub fn capped(field: &str, value: &str) -> Result<(), Status> {
    if value.len() > MAX_TEXT_BYTES {
        return Err(Status::invalid_argument(format!(
            "{field}: {} bytes, at most {MAX_TEXT_BYTES}",
            value.len()
        )));
    }
    Ok(())
}

/// Entries from the request, within the RLS caps; at least one.
pub fn entries(
    list: &[pb::Entry],
    caps: &RequestCaps,
    what: &str,
) -> Result<Vec<(String, String)>, Status> {
    if list.is_empty() {
        return Err(Status::invalid_argument(format!(
            "{what}: at least one entry"
        )));
    }
    if list.len() > caps.entries as usize {
        return Err(Status::invalid_argument(format!(
            "{what}: {} entries, more than MAX_ENTRIES_PER_DESCRIPTOR ({})",
            list.len(),
            caps.entries
        )));
    }
    list.iter()
        .map(|e| {
            if e.key.is_empty() {
                return Err(Status::invalid_argument(format!(
                    "{what}: an entry has an empty key"
                )));
            }
            if e.key.len() > caps.key_bytes as usize || e.value.len() > caps.value_bytes as usize {
                return Err(Status::invalid_argument(format!(
                    "{what}: entry {:?} is longer than the descriptor caps",
                    e.key
                )));
            }
            Ok((e.key.clone(), e.value.clone()))
        })
        .collect()
}

pub fn pb_entries(entries: &[(String, String)]) -> Vec<pb::Entry> {
    entries
        .iter()
        .map(|(k, v)| pb::Entry {
            key: k.clone(),
            value: v.clone(),
        })
        .collect()
}

pub fn limit_state(l: &Inspected) -> pb::LimitState {
    pb::LimitState {
        name: l.name.clone(),
        algorithm: l.limit.algorithm.name().to_string(),
        requests_per_unit: l.limit.requests_per_unit,
        period: l.limit.period.to_string(),
        counter: pb_entries(&l.counter),
        usage: l.usage(),
        remaining: l.outcome.remaining,
        reset_after_ms: u64::try_from(l.outcome.reset.as_millis()).unwrap_or(u64::MAX),
        shadow: l.shadow,
        request_override: l.request_override,
        admin_override: l.admin_override.as_ref().map(to_pb),
        regions: l
            .regions
            .iter()
            .map(|r| pb::RegionPool {
                region: r.region.clone(),
                pool: r.pool,
                taken: r.taken,
                owed: r.owed,
                reported_unix_ms: r.at_unix_ms,
            })
            .collect(),
    }
}

fn pb_limit(l: OverrideLimit) -> pb::r#override::Limit {
    match l {
        OverrideLimit::Requests(n) => pb::r#override::Limit::RequestsPerUnit(n),
        OverrideLimit::Unlimited => pb::r#override::Limit::Unlimited(true),
        OverrideLimit::Deny => pb::r#override::Limit::Deny(true),
    }
}

pub fn to_pb(o: &StoredOverride) -> pb::Override {
    pb::Override {
        domain: o.id.domain.clone(),
        entries: pb_entries(&o.id.entries),
        limit_name: o.id.limit_name.clone(),
        limit: Some(pb_limit(o.limit)),
        expires_unix_ms: o.expires_unix_ms,
        set_by: o.set_by.clone(),
        set_unix_ms: o.set_unix_ms,
        reason: o.reason.clone(),
    }
}

/// The override a `SetOverride` asks for, set by `caller` at `now_ms`.
pub fn override_of(
    r: &pb::SetOverrideRequest,
    caps: &RequestCaps,
    caller: &str,
    now_ms: u64,
) -> Result<StoredOverride, Status> {
    let limit = match r.limit {
        Some(pb::set_override_request::Limit::RequestsPerUnit(n)) => OverrideLimit::Requests(n),
        Some(pb::set_override_request::Limit::Unlimited(true)) => OverrideLimit::Unlimited,
        Some(pb::set_override_request::Limit::Deny(true)) => OverrideLimit::Deny,
        _ => {
            return Err(Status::invalid_argument(
                "limit: one of requests_per_unit, unlimited: true or deny: true",
            ))
        }
    };
    if r.ttl_seconds == 0 || r.ttl_seconds > MAX_OVERRIDE_TTL_SECS {
        return Err(Status::invalid_argument(format!(
            "ttl_seconds: from 1 to {MAX_OVERRIDE_TTL_SECS} (90 days); a lasting change belongs \
             in the config"
        )));
    }
    capped("reason", &r.reason)?;
    capped("limit_name", &r.limit_name)?;
    Ok(StoredOverride {
        id: OverrideId {
            domain: r.domain.clone(),
            entries: entries(&r.entries, caps, "entries")?,
            limit_name: r.limit_name.clone(),
        },
        limit,
        expires_unix_ms: now_ms.saturating_add(r.ttl_seconds.saturating_mul(1000)),
        set_by: caller.to_string(),
        set_unix_ms: now_ms,
        reason: r.reason.clone(),
    })
}

/// An override as the audit line writes it.
pub fn override_text(o: Option<&StoredOverride>) -> String {
    match o {
        None => "none".into(),
        Some(o) => format!(
            "{}{} until {} (set by {})",
            o.limit,
            if o.id.limit_name.is_empty() {
                String::new()
            } else {
                format!(" on {}", o.id.limit_name)
            },
            o.expires_unix_ms,
            o.set_by
        ),
    }
}
