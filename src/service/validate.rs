//! The first step of a decision: refuse what Envoy's own proto validation forbids and what is
//! over the request caps, before any rule lookup, lock or store call.

use super::{RequestCaps, RequestError};
use crate::proto::RateLimitRequest;

/// The descriptor and entry caps checked on a request's wire form, before it is decoded: an
/// empty descriptor is 2 bytes sent and about 80 decoded, so a 4 MiB request of them would cost
/// some 170 MB before [`validate`] could count them. The same errors as [`validate`] gives (the
/// whole message is scanned, so the counts are exact); a malformed message stops the scan and
/// is left to the decoder. O(wire bytes), no allocation.
pub fn validate_wire(wire: &[u8], caps: &RequestCaps) -> Result<(), RequestError> {
    let over = |what: String, n: usize, cap: u32, setting: &str| {
        RequestError::Invalid(format!("{what} is {n}, over the cap of {cap} ({setting})"))
    };
    let mut descriptors = 0;
    let mut first_over = None;
    for (field, body) in fields(wire) {
        if field != 2 {
            continue;
        }
        let entries = fields(body).filter(|&(f, _)| f == 1).count();
        if entries > caps.entries as usize && first_over.is_none() {
            first_over = Some((descriptors, entries));
        }
        descriptors += 1;
    }
    if descriptors > caps.descriptors as usize {
        return Err(over(
            "the number of descriptors".into(),
            descriptors,
            caps.descriptors,
            "MAX_DESCRIPTORS_PER_REQUEST",
        ));
    }
    if let Some((i, n)) = first_over {
        return Err(over(
            format!("the number of entries of descriptors[{i}]"),
            n,
            caps.entries,
            "MAX_ENTRIES_PER_DESCRIPTOR",
        ));
    }
    Ok(())
}

/// The length-delimited fields of a protobuf message's wire form, as (field number, bytes);
/// other wire types are skipped; a malformed field ends the walk.
fn fields(mut wire: &[u8]) -> impl Iterator<Item = (u64, &[u8])> {
    std::iter::from_fn(move || loop {
        let tag = prost::encoding::decode_varint(&mut wire).ok()?;
        let len = match tag & 7 {
            0 => {
                prost::encoding::decode_varint(&mut wire).ok()?;
                continue;
            }
            1 => 8,
            2 => usize::try_from(prost::encoding::decode_varint(&mut wire).ok()?).ok()?,
            5 => 4,
            _ => return None,
        };
        let body = wire.get(..len)?;
        wire = wire.get(len..)?;
        if tag & 7 == 2 {
            return Some((tag >> 3, body));
        }
    })
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::rate_limit_descriptor::Entry;
    use crate::proto::RateLimitDescriptor;
    use prost::Message;

    fn request(descriptors: usize, entries: usize) -> RateLimitRequest {
        let entry = Entry {
            key: "k".into(),
            value: "v".into(),
        };
        RateLimitRequest {
            domain: "d".into(),
            descriptors: vec![
                RateLimitDescriptor {
                    entries: vec![entry; entries],
                    hits_addend: Some(3),
                    ..Default::default()
                };
                descriptors
            ],
            hits_addend: 1,
        }
    }

    #[test]
    fn the_wire_check_says_what_the_decoded_check_says() {
        let caps = RequestCaps::default();
        let message = |r: Result<(), RequestError>| match r {
            Ok(()) => String::new(),
            Err(e) => e.to_string(),
        };
        for (d, e) in [(1, 1), (64, 16), (65, 1), (3, 17), (2_000, 0), (70, 20)] {
            let r = request(d, e);
            let wire = message(validate_wire(&r.encode_to_vec(), &caps));
            let decoded = message(validate(&r, &caps));
            assert_eq!(wire, decoded, "{d} descriptors of {e} entries");
        }
        // A malformed tail stops the scan: the decoder refuses it.
        assert!(validate_wire(&[0x12, 0xff, 0x01], &caps).is_ok());
    }
}
