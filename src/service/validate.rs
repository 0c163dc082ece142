//! The first step of a decision: refuse what Envoy's own proto validation forbids and what is
//! over the request caps, before any rule lookup, lock or store call.

use super::{RequestCaps, RequestError};
use crate::proto::RateLimitRequest;

/// Rejects what Envoy's own proto validation forbids, what no limit could be found for, and
/// what is over the request caps (naming the cap and its setting).
pub(super) fn validate(request: &RateLimitRequest, caps: &RequestCaps) -> Result<(), RequestError> {
    let over = |what: String, n: usize, cap: u32, setting: &str| {
        RequestError::Invalid(format!("{what} is {n}, over the cap of {cap} ({setting})"))
    };
    if request.domain.len() > crate::config::MAX_DOMAIN_BYTES {
        return Err(RequestError::Invalid(format!(
            "the domain is {} bytes; no config names a domain longer than {}",
            request.domain.len(),
            crate::config::MAX_DOMAIN_BYTES
        )));
    }
    if request.descriptors.len() > caps.descriptors as usize {
        return Err(over(
            "the number of descriptors".into(),
            request.descriptors.len(),
            caps.descriptors,
            "MAX_DESCRIPTORS_PER_REQUEST",
        ));
    }
    for (i, d) in request.descriptors.iter().enumerate() {
        if d.entries.len() > caps.entries as usize {
            return Err(over(
                format!("the number of entries of descriptors[{i}]"),
                d.entries.len(),
                caps.entries,
                "MAX_ENTRIES_PER_DESCRIPTOR",
            ));
        }
        for (j, e) in d.entries.iter().enumerate() {
            if e.key.len() > caps.key_bytes as usize {
                return Err(over(
                    format!("the key of descriptors[{i}].entries[{j}] in bytes"),
                    e.key.len(),
                    caps.key_bytes,
                    "MAX_DESCRIPTOR_KEY_BYTES",
                ));
            }
            if e.value.len() > caps.value_bytes as usize {
                return Err(over(
                    format!("the value of descriptors[{i}].entries[{j}] in bytes"),
                    e.value.len(),
                    caps.value_bytes,
                    "MAX_DESCRIPTOR_VALUE_BYTES",
                ));
            }
        }
    }
    if request.domain.is_empty() {
        return Err(RequestError::Invalid(
            "rate limit domain must not be empty".into(),
        ));
    }
    if request.descriptors.is_empty() {
        return Err(RequestError::Invalid(
            "rate limit descriptor list must not be empty".into(),
        ));
    }
    for (i, d) in request.descriptors.iter().enumerate() {
        if d.entries.is_empty() {
            return Err(RequestError::Invalid(format!(
                "descriptors[{i}] has no entries"
            )));
        }
        if let Some(j) = d.entries.iter().position(|e| e.key.is_empty()) {
            return Err(RequestError::Invalid(format!(
                "descriptors[{i}].entries[{j}] has an empty key"
            )));
        }
    }
    Ok(())
}
