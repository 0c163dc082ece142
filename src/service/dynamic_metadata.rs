//! `RESPONSE_DYNAMIC_METADATA`: the response's `dynamic_metadata`, built as envoyproxy/ratelimit
//! builds it, so Envoy filters and access logs that read it (`%DYNAMIC_METADATA(...)%`) see the
//! same fields:
//!
//! - `domain`: the request's domain;
//! - `descriptors`: per request descriptor, `entries` (`"key=value"` strings), `limit` (the
//!   override's text form, when the descriptor carries one) and `hitsAddend` (when set);
//! - `hitsAddend`: the request's, when not 0;
//! - `metadata`: the config `metadata` of every descriptor that passed (answered OK with a
//!   limit), merged in request order: the first value of a field wins, except that two mappings
//!   merge field by field.

use crate::proto::RateLimitRequest;
use prost_types::value::Kind;
use prost_types::{ListValue, Struct, Value};
use std::collections::BTreeMap;

fn string(s: String) -> Value {
    Value {
        kind: Some(Kind::StringValue(s)),
    }
}

fn number(n: f64) -> Value {
    Value {
        kind: Some(Kind::NumberValue(n)),
    }
}

/// The metadata of `request`; `passed` holds the config metadata of the descriptors that passed,
/// in request order.
pub(crate) fn build<'a>(
    request: &RateLimitRequest,
    passed: impl Iterator<Item = &'a Struct>,
) -> Struct {
    let mut fields = BTreeMap::new();
    fields.insert("domain".to_string(), string(request.domain.clone()));
    let descriptors = request
        .descriptors
        .iter()
        .map(|d| {
            let mut f = BTreeMap::new();
            let entries = d
                .entries
                .iter()
                .map(|e| string(format!("{}={}", e.key, e.value)))
                .collect();
            f.insert(
                "entries".to_string(),
                Value {
                    kind: Some(Kind::ListValue(ListValue { values: entries })),
                },
            );
            if let Some(limit) = &d.limit {
                f.insert("limit".to_string(), string(override_text(limit)));
            }
            if let Some(h) = d.hits_addend {
                f.insert("hitsAddend".to_string(), number(h as f64));
            }
            Value {
                kind: Some(Kind::StructValue(Struct { fields: f })),
            }
        })
        .collect();
    fields.insert(
        "descriptors".to_string(),
        Value {
            kind: Some(Kind::ListValue(ListValue {
                values: descriptors,
            })),
        },
    );
    if request.hits_addend != 0 {
        fields.insert(
            "hitsAddend".to_string(),
            number(f64::from(request.hits_addend)),
        );
    }
    let mut merged = Struct::default();
    for m in passed {
        merge(&mut merged, m);
    }
    if !merged.fields.is_empty() {
        fields.insert(
            "metadata".to_string(),
            Value {
                kind: Some(Kind::StructValue(merged)),
            },
        );
    }
    Struct { fields }
}

/// Go's text form of the override message, as envoyproxy puts it there.
fn override_text(o: &crate::proto::rate_limit_descriptor::RateLimitOverride) -> String {
    let unit = crate::proto::envoy::r#type::v3::RateLimitUnit::try_from(o.unit)
        .map(|u| u.as_str_name().to_string())
        .unwrap_or_else(|_| o.unit.to_string());
    format!("requests_per_unit:{} unit:{unit}", o.requests_per_unit)
}

/// Adds `src`'s fields that `dest` lacks; where both hold a mapping, merges them the same way.
fn merge(dest: &mut Struct, src: &Struct) {
    for (k, v) in &src.fields {
        match dest.fields.get_mut(k) {
            None => {
                dest.fields.insert(k.clone(), v.clone());
            }
            Some(Value {
                kind: Some(Kind::StructValue(d)),
            }) => {
                if let Some(Kind::StructValue(s)) = &v.kind {
                    merge(d, s);
                }
            }
            Some(_) => {}
        }
    }
}
