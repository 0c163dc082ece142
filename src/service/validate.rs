//! The first step of a decision: refuse what Envoy's own proto validation forbids and what is
//! over the request caps, before any rule lookup, lock or store call.

use super::{RequestCaps, RequestError};
use crate::proto::RateLimitRequest;

/// The descriptor and entry caps checked on a request's wire form, before it is decoded: an
/// empty descriptor is 2 bytes sent and about 80 decoded, so a 4 MiB request of them would cost
/// some 170 MB before [`validate`] could count them. The same errors as [`validate`] gives (the
/// whole message is walked, so the counts are exact). A message the walk cannot count is
/// refused, never left to the decoder: prost skips a group (wire types 3 and 4) of an unknown
/// field and decodes the rest, so a walk that stopped there would count nothing behind it
/// (issue 50). The request, its descriptors and every message inside them are walked; Envoy
/// sends no group. O(wire bytes), no allocation.
pub fn validate_wire(wire: &[u8], caps: &RequestCaps) -> Result<(), RequestError> {
    let over = |what: String, n: usize, cap: u32, setting: &str| {
        RequestError::Invalid(format!("{what} is {n}, over the cap of {cap} ({setting})"))
    };
    let mut descriptors = 0;
    let mut first_over = None;
    walk(wire, 0, &mut |field, body, at| {
        if field != 2 {
            return Ok(());
        }
        // A descriptor: its entries (1), its limit (2) and its hits_addend (3) are messages.
        let mut entries = 0;
        walk(body, at, &mut |f, b, at| {
            entries += usize::from(f == 1);
            match f {
                1..=3 => walk(b, at, &mut |_, _, _| Ok(())),
                _ => Ok(()),
            }
        })?;
        if entries > caps.entries as usize && first_over.is_none() {
            first_over = Some((descriptors, entries));
        }
        descriptors += 1;
        Ok(())
    })
    .map_err(|e| RequestError::Invalid(e.to_string()))?;
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

/// Why a message's wire form cannot be walked (and so is refused before it is decoded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unwalkable {
    /// The offset of the offending field in the whole message.
    pub at: usize,
    pub what: &'static str,
}

impl std::fmt::Display for Unwalkable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the message cannot be counted before it is decoded: {} at byte {} (Envoy sends \
             proto3 messages, which hold no groups)",
            self.what, self.at
        )
    }
}

/// Walks the fields of a protobuf message's wire form (`wire`, at offset `base` of the whole
/// message), calling `each(field number, bytes, offset of the bytes)` on every
/// length-delimited field; skips varints and fixed-size fields; refuses what prost would refuse
/// or could skip unseen: a group (wire types 3 and 4), wire types 6 and 7, a field number of 0
/// or past 2^29, a truncated or overlong varint, a length past the end.
pub fn walk<'a>(
    wire: &'a [u8],
    base: usize,
    each: &mut dyn FnMut(u32, &'a [u8], usize) -> Result<(), Unwalkable>,
) -> Result<(), Unwalkable> {
    walk_typed(wire, base, &mut |field, wire_type, body, at| {
        if wire_type == 2 {
            each(field, body, at)
        } else {
            Ok(())
        }
    })
}

/// [`walk`], calling `each(field number, wire type, bytes, offset)` on every field: a varint's
/// bytes are empty, a fixed field's are its 4 or 8 bytes. For a map field, whose entries prost
/// decodes as length-delimited whatever wire type the tag says (prost 0.14's map merge never
/// checks it), so a walk that skipped a fixed-size field 1 of a map would count nothing of the
/// entry prost builds from it.
pub fn walk_typed<'a>(
    mut wire: &'a [u8],
    base: usize,
    each: &mut dyn FnMut(u32, u8, &'a [u8], usize) -> Result<(), Unwalkable>,
) -> Result<(), Unwalkable> {
    use prost::encoding::decode_varint;
    let end = base + wire.len();
    while !wire.is_empty() {
        let at = end - wire.len();
        let bad = |what| Unwalkable { at, what };
        let key = decode_varint(&mut wire).map_err(|_| bad("a truncated or overlong tag"))?;
        let field = u32::try_from(key >> 3)
            .ok()
            .filter(|&f| f != 0 && key <= u64::from(u32::MAX))
            .ok_or_else(|| bad("a field number out of range"))?;
        let len = match key & 7 {
            0 => {
                decode_varint(&mut wire).map_err(|_| bad("a truncated or overlong varint"))?;
                each(field, 0, &[], end - wire.len())?;
                continue;
            }
            1 => 8,
            2 => decode_varint(&mut wire)
                .ok()
                .and_then(|l| usize::try_from(l).ok())
                .ok_or_else(|| bad("a truncated or overlong length"))?,
            5 => 4,
            3 | 4 => return Err(bad("a group (wire type 3 or 4)")),
            _ => return Err(bad("an undefined wire type (6 or 7)")),
        };
        let body_at = end - wire.len();
        let (body, rest) = wire
            .split_at_checked(len)
            .ok_or_else(|| bad("a field longer than the message"))?;
        wire = rest;
        // The wire type, 1, 2 or 5 here.
        each(field, (key & 7) as u8, body, body_at)?;
    }
    Ok(())
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
        // A malformed tail is refused too: never left to the decoder.
        let e = message(validate_wire(&[0x12, 0xff, 0x01], &caps));
        assert!(e.contains("longer than the message at byte 0"), "{e}");
    }

    #[test]
    fn what_the_walk_cannot_count_is_refused() {
        let caps = RequestCaps::default();
        let refused = |wire: &[u8], what: &str| match validate_wire(wire, &caps) {
            Err(RequestError::Invalid(e)) => assert!(e.contains(what), "{wire:x?}: {e}"),
            other => panic!("{wire:x?} admitted: {other:?}"),
        };
        let domain = [0x0a, 1, b'd'];
        let with = |parts: &[&[u8]]| -> Vec<u8> { [&domain[..], &parts.concat()].concat() };
        // The review's request: an empty group of field 99, then descriptors.
        refused(
            &with(&[&[0x9b, 0x06, 0x9c, 0x06], &[0x12, 0].repeat(100)]),
            "group",
        );
        // The group at the start of a descriptor's body, then entries; in an entry; alone.
        refused(
            &with(&[&[0x12, 6, 0x9b, 0x06, 0x9c, 0x06, 0x0a, 0]]),
            "byte 5",
        );
        refused(&with(&[&[0x12, 6, 0x0a, 4, 0x0b, 0x0c, 0x12, 0]]), "group");
        refused(&with(&[&[0x0c]]), "group");
        refused(&with(&[&[0x0e]]), "wire type (6 or 7)");
        refused(&with(&[&[0x0f]]), "wire type (6 or 7)");
        refused(&with(&[&[0x02, 0]]), "field number");
        refused(&with(&[&[0x18, 0xff]]), "truncated or overlong varint");
        refused(
            &with(&[&[0x18], &[0xff; 11]]),
            "truncated or overlong varint",
        );
        refused(&with(&[&[0x12, 0x80]]), "truncated or overlong length");
        refused(&with(&[&[0x21, 1, 2]]), "longer than the message");
        refused(&with(&[&[0xf8, 0xff, 0xff, 0xff, 0x7f, 0]]), "field number");
        // Unknown fields of every defined wire type are walked past, as prost skips them.
        let known = with(&[&[0x12, 2, 0x0a, 0], &[0x98, 0x06, 1, 0x99, 0x06], &[0; 8]]);
        assert!(validate_wire(&known, &caps).is_ok());
        let strings_are_not_walked = with(&[&[0x12, 5, 0x0a, 3, 0x0a, 1, 0x0b]]);
        assert!(validate_wire(&strings_are_not_walked, &caps).is_ok());
    }
}

/// Random wire forms, and what prost makes of them: the wire walks (`validate_wire` here, the
/// RLQS report's in `quota::server`) may refuse what prost would decode, never admit what prost
/// decodes over the caps.
#[cfg(test)]
pub(crate) mod arbitrary {
    use proptest::prelude::*;

    /// A field of a message as generated: any wire type (groups and the undefined ones too),
    /// nested messages, and raw bytes.
    #[derive(Debug, Clone)]
    pub(crate) enum Field {
        Varint(u32, u64),
        Fixed(u32, bool),
        Bytes(u32, Vec<u8>),
        Message(u32, Vec<Field>),
        Group(u32, Vec<Field>),
        Undefined(u32, u8),
        Raw(Vec<u8>),
    }

    fn key(field: u32, wire_type: u8, out: &mut Vec<u8>) {
        prost::encoding::encode_varint(u64::from(field) << 3 | u64::from(wire_type), out);
    }

    /// The wire form of `fields`.
    pub(crate) fn encode(fields: &[Field], out: &mut Vec<u8>) {
        for f in fields {
            match f {
                Field::Varint(n, v) => {
                    key(*n, 0, out);
                    prost::encoding::encode_varint(*v, out);
                }
                Field::Fixed(n, wide) => {
                    key(*n, if *wide { 1 } else { 5 }, out);
                    out.extend_from_slice(&[7; 8][..if *wide { 8 } else { 4 }]);
                }
                Field::Bytes(n, b) => {
                    key(*n, 2, out);
                    prost::encoding::encode_varint(b.len() as u64, out);
                    out.extend_from_slice(b);
                }
                Field::Message(n, inner) => {
                    let mut body = Vec::new();
                    encode(inner, &mut body);
                    key(*n, 2, out);
                    prost::encoding::encode_varint(body.len() as u64, out);
                    out.extend_from_slice(&body);
                }
                Field::Group(n, inner) => {
                    key(*n, 3, out);
                    encode(inner, out);
                    key(*n, 4, out);
                }
                Field::Undefined(n, t) => key(*n, *t, out),
                Field::Raw(b) => out.extend_from_slice(b),
            }
        }
    }

    /// Field numbers the messages know (1-4), and one they do not (99).
    fn number() -> impl Strategy<Value = u32> {
        prop_oneof![4 => 1u32..=4, 1 => Just(99u32)]
    }

    /// Messages up to 4 deep: mostly the known fields as messages (so the walks see requests,
    /// descriptors, entries, reports, usages and bucket ids), with groups, scalars, strings,
    /// undefined wire types and raw junk among them.
    pub(crate) fn message() -> impl Strategy<Value = Vec<Field>> {
        let leaf = prop_oneof![
            3 => (number(), any::<u64>()).prop_map(|(n, v)| Field::Varint(n, v)),
            2 => (number(), any::<bool>()).prop_map(|(n, w)| Field::Fixed(n, w)),
            3 => (number(), prop::collection::vec(any::<u8>(), 0..4))
                .prop_map(|(n, b)| Field::Bytes(n, b)),
            1 => (number(), 6u8..8).prop_map(|(n, t)| Field::Undefined(n, t)),
            1 => prop::collection::vec(any::<u8>(), 1..4).prop_map(Field::Raw),
            // An empty message is a valid one of every type: what inflates a decode.
            4 => number().prop_map(|n| Field::Message(n, Vec::new())),
        ];
        let field = leaf.prop_recursive(4, 64, 8, |inner| {
            prop_oneof![
                6 => (number(), prop::collection::vec(inner.clone(), 0..8))
                    .prop_map(|(n, f)| Field::Message(n, f)),
                1 => (number(), prop::collection::vec(inner, 0..3))
                    .prop_map(|(n, f)| Field::Group(n, f)),
            ]
        });
        prop::collection::vec(field, 0..16)
    }

    /// A request of `shape[i]` entries in descriptor `i` (RLS), as Envoy would send it.
    pub(crate) fn rls(shape: &[usize]) -> Vec<Field> {
        let entry = Field::Message(
            1,
            vec![Field::Bytes(1, b"k".to_vec()), Field::Bytes(2, vec![])],
        );
        let mut fields = vec![Field::Bytes(1, b"d".to_vec())];
        fields.extend(
            shape
                .iter()
                .map(|&n| Field::Message(2, vec![entry.clone(); n])),
        );
        fields.push(Field::Varint(3, 1));
        fields
    }

    /// A report of `shape.len()` usages, usage `i` of a bucket of `shape[i]` pairs (RLQS).
    pub(crate) fn rlqs(shape: &[usize]) -> Vec<Field> {
        let pair = |i: usize| {
            Field::Message(
                1,
                vec![
                    Field::Bytes(1, vec![b'k', i as u8]),
                    Field::Bytes(2, vec![]),
                ],
            )
        };
        let usage = |n: usize| {
            Field::Message(
                2,
                vec![
                    Field::Message(1, (0..n).map(pair).collect()),
                    Field::Message(2, vec![Field::Varint(1, 5)]),
                    Field::Varint(3, 1),
                ],
            )
        };
        let mut fields = vec![Field::Bytes(1, b"d".to_vec())];
        fields.extend(shape.iter().map(|&n| usage(n)));
        fields
    }

    /// The messages in `fields`, itself included.
    fn count(fields: &[Field]) -> usize {
        let inner = |f: &Field| match f {
            Field::Message(_, i) => count(i),
            _ => 0,
        };
        1 + fields.iter().map(inner).sum::<usize>()
    }

    /// Inserts `slip` at `at` in the `k`th message of `fields` (itself first, depth first).
    fn insert(
        fields: &mut Vec<Field>,
        k: &mut usize,
        at: prop::sample::Index,
        slip: &mut Option<Field>,
    ) {
        if *k == 0 {
            if let Some(f) = slip.take() {
                fields.insert(at.index(fields.len() + 1), f);
            }
            return;
        }
        *k -= 1;
        for f in fields.iter_mut() {
            if let Field::Message(_, inner) = f {
                insert(inner, k, at, slip);
                if slip.is_none() {
                    return;
                }
            }
        }
    }

    /// What a hostile peer slips in: a group (empty or not), an undefined wire type, junk.
    fn hostile() -> impl Strategy<Value = Field> {
        prop_oneof![
            4 => number().prop_map(|n| Field::Group(n, Vec::new())),
            2 => (number(), message()).prop_map(|(n, f)| Field::Group(n, f)),
            1 => (number(), 6u8..8).prop_map(|(n, t)| Field::Undefined(n, t)),
            1 => prop::collection::vec(any::<u8>(), 1..4).prop_map(Field::Raw),
        ]
    }

    /// Messages of a valid `shape` (built by `build`) with up to 2 hostile fields slipped in
    /// anywhere, at any depth, sometimes cut short.
    pub(crate) fn tampered(build: fn(&[usize]) -> Vec<Field>) -> impl Strategy<Value = Vec<u8>> {
        let slips = prop::collection::vec(
            (
                any::<prop::sample::Index>(),
                any::<prop::sample::Index>(),
                hostile(),
            ),
            0..3,
        );
        let shape = prop::collection::vec(0usize..5, 0..7);
        (shape, slips, any::<prop::sample::Index>(), 0..4u8).prop_map(
            move |(shape, slips, cut, cut_it)| {
                let mut fields = build(&shape);
                for (which, at, field) in slips {
                    let mut k = which.index(count(&fields));
                    insert(&mut fields, &mut k, at, &mut Some(field));
                }
                let mut out = Vec::new();
                encode(&fields, &mut out);
                if cut_it == 0 && !out.is_empty() {
                    out.truncate(cut.index(out.len()));
                }
                out
            },
        )
    }

    /// Wire forms: random bytes, or a generated message, whole or cut short.
    pub(crate) fn wire() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            1 => prop::collection::vec(any::<u8>(), 0..64),
            4 => (message(), any::<prop::sample::Index>(), any::<bool>()).prop_map(
                |(fields, cut, whole)| {
                    let mut out = Vec::new();
                    encode(&fields, &mut out);
                    if !whole && !out.is_empty() {
                        out.truncate(cut.index(out.len()));
                    }
                    out
                }
            ),
        ]
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use proptest::prelude::*;

    /// Whenever the walk admits `wire` (caps of 2 descriptors, 2 entries), prost decodes it
    /// within them (or refuses it).
    fn admitted_within_caps(wire: &[u8]) -> Result<(), TestCaseError> {
        let caps = RequestCaps {
            descriptors: 2,
            entries: 2,
            ..RequestCaps::default()
        };
        if validate_wire(wire, &caps).is_ok() {
            if let Ok(r) = <RateLimitRequest as prost::Message>::decode(wire) {
                prop_assert!(
                    r.descriptors.len() <= 2,
                    "{} descriptors",
                    r.descriptors.len()
                );
                for d in &r.descriptors {
                    prop_assert!(d.entries.len() <= 2, "{} entries", d.entries.len());
                }
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        /// Whenever the walk admits a request, prost decodes it within the caps (or refuses it).
        #[test]
        fn an_admitted_request_decodes_within_the_caps(wire in arbitrary::wire()) {
            admitted_within_caps(&wire)?;
        }

        /// The same for requests as Envoy sends them, with a group (or other hostile field)
        /// slipped in anywhere, at any depth.
        #[test]
        fn a_tampered_request_admitted_decodes_within_the_caps(
            wire in arbitrary::tampered(arbitrary::rls),
        ) {
            admitted_within_caps(&wire)?;
        }

        /// What Envoy sends (proto3, no groups) is walked whole: admitted within the caps,
        /// refused over them, as the decoded check says.
        #[test]
        fn proto3_requests_are_counted_exactly(
            shape in prop::collection::vec(0usize..4, 0..5),
            addend in any::<bool>(),
        ) {
            use crate::proto::rate_limit_descriptor::Entry;
            let caps = RequestCaps { descriptors: 3, entries: 2, ..RequestCaps::default() };
            let request = RateLimitRequest {
                domain: "d".into(),
                descriptors: shape
                    .iter()
                    .map(|&n| crate::proto::RateLimitDescriptor {
                        entries: vec![Entry { key: "k".into(), value: "v".into() }; n],
                        hits_addend: addend.then_some(2),
                        ..Default::default()
                    })
                    .collect(),
                hits_addend: 1,
            };
            let wire = prost::Message::encode_to_vec(&request);
            let over = shape.len() > 3 || shape.iter().any(|&n| n > 2);
            prop_assert_eq!(validate_wire(&wire, &caps).is_err(), over);
        }
    }
}
