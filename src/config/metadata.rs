//! A descriptor's `metadata` (envoyproxy/ratelimit's free-form map), kept as the protobuf
//! `Struct` it ends up in: with `RESPONSE_DYNAMIC_METADATA=true` the metadata of the descriptors
//! a request passed is returned to Envoy in the response's `dynamic_metadata`. Converted once at
//! load, so a response only clones a shared pointer.

use super::yaml::{Node, Resolved, Value};
use prost_types::value::Kind;

/// The mapping as a `Struct`; `Err` says what is not a mapping (the top level must be one).
pub(crate) fn to_struct(node: &Node) -> Result<prost_types::Struct, String> {
    match &node.value {
        Value::Map(entries) => Ok(prost_types::Struct {
            fields: entries
                .iter()
                .map(|(k, v)| (key_text(k), to_value(v)))
                .collect(),
        }),
        Value::Scalar(s) if s.resolve() == Resolved::Null => Ok(prost_types::Struct::default()),
        _ => Err("`metadata` must be a mapping".into()),
    }
}

fn key_text(node: &Node) -> String {
    match &node.value {
        Value::Scalar(s) => s.text.clone(),
        // A non-scalar key cannot be a Struct field name: name it by its shape.
        Value::Seq(_) => "[sequence]".into(),
        Value::Map(_) => "{mapping}".into(),
    }
}

fn to_value(node: &Node) -> prost_types::Value {
    let kind = match &node.value {
        Value::Scalar(s) => match s.resolve() {
            Resolved::Null => Kind::NullValue(0),
            Resolved::Bool(b) => Kind::BoolValue(b),
            Resolved::Int(i) => Kind::NumberValue(i as f64),
            Resolved::Float => Kind::NumberValue(float(&s.text)),
            Resolved::Str => Kind::StringValue(s.text.clone()),
        },
        Value::Seq(items) => Kind::ListValue(prost_types::ListValue {
            values: items.iter().map(to_value).collect(),
        }),
        Value::Map(entries) => Kind::StructValue(prost_types::Struct {
            fields: entries
                .iter()
                .map(|(k, v)| (key_text(k), to_value(v)))
                .collect(),
        }),
    };
    prost_types::Value { kind: Some(kind) }
}

/// A YAML float (`1.5`, `.inf`, `-.Inf`, `.nan`).
fn float(text: &str) -> f64 {
    match text.to_ascii_lowercase().as_str() {
        ".inf" | "+.inf" => f64::INFINITY,
        "-.inf" => f64::NEG_INFINITY,
        ".nan" => f64::NAN,
        t => t.replace('_', "").parse().unwrap_or(f64::NAN),
    }
}
