//! Why this file: tonic reads a whole message before its decoder sees it, so a message the
//! whole-message walks refuse (`validate_wire` for RLS, `count_usages` for RLQS) has still cost
//! its bytes: up to the caps' message size (4.3 MiB for RLS, `RLQS_MAX_REPORT_BYTES` 8 MiB for
//! RLQS) per call, and 1 024 calls per connection: 8 concurrent 8 MiB reports behind a group
//! held 64 MiB in buffers before any was refused (issue 50). Here each message's top level is
//! walked as its bytes arrive, so one that starts with a group (or anything else the walk
//! cannot count), or carries more of the counted field than its cap, is refused as soon as
//! that is seen, before the rest is read. The whole-message walk still runs (it also walks the
//! nested messages and gives the exact counts); this one only refuses earlier, and refuses
//! nothing that one admits.

use super::Unwalkable;
use bytes::Bytes;
use futures_util::StreamExt;
use tonic::codegen::{http, Body, StdError};
use tonic::Status;

/// What one kind of message is walked for: its top-level field 2 (RLS descriptors, RLQS
/// usages) counted against `max` when `max` is set, and how a refusal names the message.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// The message, as a refusal names it ("a usage report").
    pub message: &'static str,
    /// The cap on field 2's occurrences, what they are ("bucket usages") and the setting
    /// that sets the cap; `None`: not counted here (the whole-message walk counts them).
    pub count: Option<(usize, &'static str, &'static str)>,
}

/// `req` with its body walked as it arrives: a message refused ends the body with its status,
/// which tonic hands to the call as the message's error; `on_refuse` runs once per refusal
/// (the RLS route counts it as an invalid request).
pub fn walked<B>(
    req: http::Request<B>,
    max_bytes: usize,
    spec: Spec,
    on_refuse: impl Fn() + Send + 'static,
) -> http::Request<axum::body::Body>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<StdError>,
{
    let mut walk = Walk::new(max_bytes, spec);
    req.map(|body| {
        let chunks = axum::body::Body::new(body).into_data_stream().map(
            move |chunk| -> Result<Bytes, StdError> {
                let chunk = chunk?;
                walk.feed(&chunk).inspect_err(|_| on_refuse())?;
                Ok(chunk)
            },
        );
        axum::body::Body::from_stream(chunks)
    })
}

/// Where the walk is in the stream of gRPC messages: a 5-byte prefix (compression flag and
/// length), then the message, whose top-level fields are walked.
#[derive(Debug)]
struct Walk {
    max_bytes: usize,
    spec: Spec,
    prefix: [u8; 5],
    /// Bytes of the prefix read so far.
    have: usize,
    /// Bytes of the current message still to come (0: a prefix is next).
    left: usize,
    /// Whether the current message is walked: not compressed and within `max_bytes` (tonic
    /// refuses the others from their prefix).
    walked: bool,
    /// The offset in the current message.
    at: usize,
    field: Field,
    /// Field 2's occurrences in the current message.
    counted: usize,
}

/// The part of a field being read.
#[derive(Debug, Clone, Copy)]
enum Field {
    Key {
        value: u64,
        bytes: u32,
        start: usize,
    },
    Varint {
        bytes: u32,
        start: usize,
    },
    Length {
        field: u64,
        value: u64,
        bytes: u32,
        start: usize,
    },
    Skip(usize),
}

const KEY: Field = Field::Key {
    value: 0,
    bytes: 0,
    start: 0,
};

impl Walk {
    fn new(max_bytes: usize, spec: Spec) -> Self {
        Self {
            max_bytes,
            spec,
            prefix: [0; 5],
            have: 0,
            left: 0,
            walked: false,
            at: 0,
            field: KEY,
            counted: 0,
        }
    }

    /// Takes the next bytes of the body.
    fn feed(&mut self, mut data: &[u8]) -> Result<(), Status> {
        while !data.is_empty() {
            if self.left == 0 {
                let take = (5 - self.have).min(data.len());
                let (head, rest) = data.split_at(take);
                self.prefix[self.have..self.have + take].copy_from_slice(head);
                self.have += take;
                data = rest;
                if self.have == 5 {
                    self.have = 0;
                    let [flag, len @ ..] = self.prefix;
                    self.left = u32::from_be_bytes(len) as usize;
                    self.walked = flag == 0 && self.left <= self.max_bytes;
                    self.at = 0;
                    self.field = KEY;
                    self.counted = 0;
                }
                continue;
            }
            let (now, rest) = data.split_at(self.left.min(data.len()));
            data = rest;
            self.left -= now.len();
            if self.walked {
                self.walk(now)?;
            }
        }
        Ok(())
    }

    fn walk(&mut self, mut bytes: &[u8]) -> Result<(), Status> {
        loop {
            if let Field::Skip(n) = self.field {
                let k = n.min(bytes.len());
                bytes = &bytes[k..];
                self.at += k;
                self.field = if n == k {
                    Field::Key {
                        value: 0,
                        bytes: 0,
                        start: self.at,
                    }
                } else {
                    Field::Skip(n - k)
                };
            }
            let Some((&b, rest)) = bytes.split_first() else {
                return Ok(());
            };
            bytes = rest;
            self.at += 1;
            self.byte(b)?;
        }
    }

    /// One byte of a key, a varint or a length.
    fn byte(&mut self, b: u8) -> Result<(), Status> {
        let message = self.spec.message;
        let refuse = |at, what| {
            let e = Unwalkable { at, what };
            Status::invalid_argument(format!("{message} refused: {e}"))
        };
        let push = |value: u64, bytes: u32, start| {
            if bytes >= 10 {
                return Err(refuse(start, "a truncated or overlong varint"));
            }
            Ok((value | u64::from(b & 0x7f) << (7 * bytes), b & 0x80 == 0))
        };
        self.field = match self.field {
            Field::Key {
                value,
                bytes,
                start,
            } => {
                let (value, done) = push(value, bytes, start)?;
                if !done {
                    self.field = Field::Key {
                        value,
                        bytes: bytes + 1,
                        start,
                    };
                    return Ok(());
                }
                if value >> 3 == 0 || value > u64::from(u32::MAX) {
                    return Err(refuse(start, "a field number out of range"));
                }
                match value & 7 {
                    0 => Field::Varint { bytes: 0, start },
                    1 => Field::Skip(8),
                    2 => Field::Length {
                        field: value >> 3,
                        value: 0,
                        bytes: 0,
                        start,
                    },
                    5 => Field::Skip(4),
                    3 | 4 => return Err(refuse(start, "a group (wire type 3 or 4)")),
                    _ => return Err(refuse(start, "an undefined wire type (6 or 7)")),
                }
            }
            Field::Varint { bytes, start } => match push(0, bytes, start)? {
                (_, true) => Field::Skip(0),
                (_, false) => Field::Varint {
                    bytes: bytes + 1,
                    start,
                },
            },
            Field::Length {
                field,
                value,
                bytes,
                start,
            } => match push(value, bytes, start)? {
                (len, true) => {
                    if let (2, Some((max, what, setting))) = (field, self.spec.count) {
                        self.counted += 1;
                        if self.counted > max {
                            return Err(Status::invalid_argument(format!(
                                "{message} of more than {max} {what} ({setting})"
                            )));
                        }
                    }
                    Field::Skip(usize::try_from(len).unwrap_or(usize::MAX))
                }
                (value, false) => Field::Length {
                    field,
                    value,
                    bytes: bytes + 1,
                    start,
                },
            },
            Field::Skip(n) => Field::Skip(n),
        };
        Ok(())
    }
}

/// A gRPC frame of `message`, uncompressed.
#[cfg(test)]
pub(crate) fn framed(message: &[u8]) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

/// Feeds `stream` to a walk for `spec` in pieces of `piece` bytes.
#[cfg(test)]
pub(crate) fn fed(stream: &[u8], piece: usize, spec: Spec) -> Result<(), Status> {
    let mut walk = Walk::new(1 << 20, spec);
    stream
        .chunks(piece.max(1))
        .try_for_each(|chunk| walk.feed(chunk))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::{arbitrary, RequestCaps};
    use proptest::prelude::*;

    fn report(max_usages: usize) -> Spec {
        Spec {
            message: "a usage report",
            count: Some((max_usages, "bucket usages", "RLQS_MAX_USAGES_PER_REPORT")),
        }
    }

    const REQUEST: Spec = Spec {
        message: "a rate-limit request",
        count: None,
    };

    #[test]
    fn a_group_or_a_usage_too_many_is_refused_as_it_arrives() {
        let mut head = vec![0x0a, 1, b'd', 0x9b, 0x06, 0x9c, 0x06];
        let mut stream = framed(&head);
        stream.truncate(5 + head.len());
        for spec in [report(10), REQUEST] {
            let e = fed(&stream, 3, spec).expect_err("the group");
            assert!(
                e.message().contains("group (wire type 3 or 4) at byte 3"),
                "{e:?}"
            );
            assert!(e.message().starts_with(spec.message), "{e:?}");
        }
        // Usages: 3 admitted at a cap of 3, the 4th refused, in pieces of any size.
        head.truncate(3);
        head.extend_from_slice(&[0x12, 0].repeat(4));
        for piece in [1, 2, 7, 100] {
            assert!(fed(&framed(&head[..9]), piece, report(3)).is_ok());
            let e = fed(&framed(&head), piece, report(3)).expect_err("4 usages");
            assert!(e.message().contains("RLQS_MAX_USAGES_PER_REPORT"), "{e:?}");
            // Descriptors are counted by the whole-message walk, not here.
            assert!(fed(&framed(&head), piece, REQUEST).is_ok());
        }
        // Two messages in a row: the count starts again.
        let two = [framed(&head[..9]), framed(&head[..9])].concat();
        assert!(fed(&two, 4, report(3)).is_ok());
        // A compressed message, or one over the size cap, is not walked (tonic refuses it).
        let mut compressed = framed(&[0x0c]);
        compressed[0] = 1;
        assert!(fed(&compressed, 1, report(3)).is_ok());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        /// Never refuses an RLS request that the whole-message walk admits, whatever the
        /// pieces (the RLQS twin is in quota/server.rs).
        #[test]
        fn refuses_no_request_the_whole_walk_admits(
            wire in prop_oneof![arbitrary::wire(), arbitrary::tampered(arbitrary::rls)],
            piece in 1usize..16,
        ) {
            let caps = RequestCaps { descriptors: u32::MAX, entries: u32::MAX, ..RequestCaps::default() };
            if crate::service::validate_wire(&wire, &caps).is_ok() {
                let stream = [framed(&wire), framed(&wire)].concat();
                let got = fed(&stream, piece, REQUEST);
                prop_assert!(got.is_ok(), "{:?}", got);
            }
        }
    }
}
