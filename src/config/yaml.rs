//! A small YAML node tree that keeps the 1-based line of every node, built from `yaml-rust2`'s
//! event parser. We do not use serde_yaml because it exposes no node positions, so a loader built
//! on it could only ever report the first error; with a line on every node the loader can report
//! every mistake of a file at once.

use std::collections::{HashMap, HashSet};
use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};

/// Deepest nesting of sequences/mappings accepted. Real configs nest two YAML levels per
/// descriptor level, so this allows ~100 descriptor levels while keeping recursion bounded.
const MAX_DEPTH: usize = 200;

/// Most nodes that aliases may add by expansion (the "billion laughs" guard).
const MAX_ALIAS_EXPANSION: usize = 100_000;

/// Most scalar text that aliases may add by expansion: a few copies of a long string are as
/// much a bomb as many copies of a short one (a 600 KiB string aliased 99 000 times fits a
/// 1 MiB ConfigMap and expands to 58 GB).
const MAX_ALIAS_BYTES: usize = 8 << 20;

const CORE_TAG_PREFIX: &str = "tag:yaml.org,2002:";

/// One YAML node with the line it starts on.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    /// 1-based line.
    pub line: usize,
    pub value: Value,
    /// Number of nodes in this subtree; charged against the alias budget when an alias copies it.
    weight: usize,
    /// Bytes of scalar text in this subtree; charged likewise.
    bytes: usize,
}

impl Node {
    /// A node of a config that has no source text (one pushed over xDS): line 0, which errors
    /// show as no line at all.
    pub(crate) fn synthetic(value: Value) -> Node {
        Node {
            line: 0,
            value,
            weight: 1,
            bytes: 0,
        }
    }

    /// A string scalar: never resolved as a bool, number or null, whatever its text.
    pub(crate) fn string(text: impl Into<String>) -> Node {
        Node::synthetic(Value::Scalar(Scalar {
            text: text.into(),
            plain: false,
            tag: None,
        }))
    }

    /// A plain scalar, resolved as YAML would (`true`, `42`).
    pub(crate) fn plain(text: impl Into<String>) -> Node {
        Node::synthetic(Value::Scalar(Scalar {
            text: text.into(),
            plain: true,
            tag: None,
        }))
    }
}

#[derive(Debug, Clone)]
pub(crate) enum Value {
    Scalar(Scalar),
    Seq(Vec<Node>),
    /// Entries in file order. Explicit duplicate keys are kept so the loader can report them;
    /// entries brought in by a `<<` merge never duplicate an explicit key.
    Map(Vec<(Node, Node)>),
}

#[derive(Debug, Clone)]
pub(crate) struct Scalar {
    pub text: String,
    /// Plain (unquoted, not a block scalar): only plain scalars resolve to null, bool or numbers.
    pub plain: bool,
    /// Resolved tag (`!!str` becomes `tag:yaml.org,2002:str`), if one was written.
    pub tag: Option<String>,
}

/// What a scalar means. Scalars resolve the way envoyproxy/ratelimit's YAML library (Go
/// `gopkg.in/yaml.v2`, YAML 1.1 flavoured) resolves them, so a config means the same here: `yes`
/// and `on` are booleans and `010` is octal in both.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Resolved {
    Null,
    Bool(bool),
    Int(i128),
    Float,
    Str,
}

impl Scalar {
    pub fn resolve(&self) -> Resolved {
        match self.tag.as_deref() {
            Some(t) if t == "!" || t.strip_prefix(CORE_TAG_PREFIX) == Some("str") => {
                return Resolved::Str
            }
            _ => {}
        }
        if !self.plain {
            return Resolved::Str;
        }
        resolve_plain(&self.text)
    }
}

/// yaml.v2's resolution of an untagged plain scalar.
fn resolve_plain(s: &str) -> Resolved {
    match s {
        "" | "~" | "null" | "Null" | "NULL" => return Resolved::Null,
        "y" | "Y" | "yes" | "Yes" | "YES" | "true" | "True" | "TRUE" | "on" | "On" | "ON" => {
            return Resolved::Bool(true)
        }
        "n" | "N" | "no" | "No" | "NO" | "false" | "False" | "FALSE" | "off" | "Off" | "OFF" => {
            return Resolved::Bool(false)
        }
        ".nan" | ".NaN" | ".NAN" | ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF"
        | "-.inf" | "-.Inf" | "-.INF" => return Resolved::Float,
        _ => {}
    }
    // yaml.v2 drops underscores, then tries Go's strconv.ParseInt/ParseUint with base 0.
    let plain: String = s.chars().filter(|&c| c != '_').collect();
    if let Some(n) = parse_go_int(&plain) {
        return Resolved::Int(n);
    }
    if is_yaml_float(&plain) {
        return Resolved::Float;
    }
    Resolved::Str
}

/// Go's `strconv.ParseInt(s, 0, 64)` then `ParseUint(s, 0, 64)`: optional sign, then `0x`, `0o`,
/// `0b` or a leading `0` (octal) prefix, or decimal.
fn parse_go_int(s: &str) -> Option<i128> {
    let (neg, body) = match s.as_bytes().first()? {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    let lower = body.to_ascii_lowercase();
    let (radix, digits) = if let Some(d) = lower.strip_prefix("0x") {
        (16, d)
    } else if let Some(d) = lower.strip_prefix("0o") {
        (8, d)
    } else if let Some(d) = lower.strip_prefix("0b") {
        (2, d)
    } else if lower.len() > 1 && lower.starts_with('0') {
        (8, &lower[1..])
    } else {
        (10, lower.as_str())
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    let magnitude = u64::from_str_radix(digits, radix).ok()?;
    let n = i128::from(magnitude);
    if neg {
        // ParseUint never accepts a sign, so negatives must fit in i64.
        (n <= i128::from(i64::MAX) + 1).then_some(-n)
    } else {
        Some(n)
    }
}

/// yaml.v2's float pattern: `^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$`.
fn is_yaml_float(s: &str) -> bool {
    let b = s.as_bytes();
    let mut i = 0;
    if matches!(b.first(), Some(b'-' | b'+')) {
        i += 1;
    }
    let digits = |i: &mut usize| {
        let start = *i;
        while *i < b.len() && b[*i].is_ascii_digit() {
            *i += 1;
        }
        *i - start
    };
    if b.get(i) == Some(&b'.') {
        i += 1;
        if digits(&mut i) == 0 {
            return false;
        }
    } else {
        if digits(&mut i) == 0 {
            return false;
        }
        if b.get(i) == Some(&b'.') {
            i += 1;
            digits(&mut i);
        }
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'-' | b'+')) {
            i += 1;
        }
        if digits(&mut i) == 0 {
            return false;
        }
    }
    i == b.len()
}

/// A YAML syntax (or structure) error that stops parsing of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SyntaxError {
    pub line: usize,
    pub message: String,
}

/// Parses every document of `text` into node trees. Anchors, aliases and `<<` merge keys are
/// resolved (yaml.v2 accepts them), under a budget on alias expansion and a nesting limit so a
/// hostile file cannot exhaust memory or the stack.
pub(crate) fn parse(text: &str) -> Result<Vec<Node>, SyntaxError> {
    let mut builder = Builder::default();
    let mut parser = Parser::new_from_str(text);
    // Events are pulled one by one rather than through `Parser::load`, which recurses once per
    // nesting level and would overflow the stack on a hostile file before our depth limit acts.
    loop {
        let (event, mark) = parser.next_token().map_err(|e| SyntaxError {
            line: e.marker().line(),
            message: format!("YAML syntax error: {}", e.info()),
        })?;
        let end = event == Event::StreamEnd;
        builder.on_event(event, mark);
        if let Some(e) = builder.error.take() {
            return Err(e);
        }
        if end {
            return Ok(builder.docs);
        }
    }
}

enum Frame {
    Seq {
        line: usize,
        anchor: usize,
        items: Vec<Node>,
    },
    Map {
        line: usize,
        anchor: usize,
        entries: Vec<(Node, Node)>,
        key: Option<Node>,
    },
}

#[derive(Default)]
struct Builder {
    stack: Vec<Frame>,
    docs: Vec<Node>,
    anchors: HashMap<usize, Node>,
    expanded: usize,
    expanded_bytes: usize,
    error: Option<SyntaxError>,
}

impl MarkedEventReceiver for Builder {
    fn on_event(&mut self, ev: Event, mark: Marker) {
        // After the first error nothing more is built.
        if self.error.is_some() {
            return;
        }
        let line = mark.line();
        match ev {
            Event::Scalar(text, style, anchor, tag) => {
                let bytes = text.len();
                let scalar = Scalar {
                    text,
                    plain: style == TScalarStyle::Plain,
                    tag: tag.map(|t| format!("{}{}", t.handle, t.suffix)),
                };
                let value = Value::Scalar(scalar);
                self.complete(
                    Node {
                        line,
                        value,
                        weight: 1,
                        bytes,
                    },
                    anchor,
                );
            }
            Event::Alias(id) => self.alias(id, line),
            Event::SequenceStart(anchor, _) => self.open(Frame::Seq {
                line,
                anchor,
                items: Vec::new(),
            }),
            Event::MappingStart(anchor, _) => self.open(Frame::Map {
                line,
                anchor,
                entries: Vec::new(),
                key: None,
            }),
            Event::SequenceEnd | Event::MappingEnd => self.close(),
            Event::StreamStart
            | Event::StreamEnd
            | Event::DocumentStart
            | Event::DocumentEnd
            | Event::Nothing => {}
        }
    }
}

impl Builder {
    /// A copy of the anchored node, counted against the alias expansion budget.
    fn alias(&mut self, id: usize, line: usize) {
        let Some(node) = self.anchors.get(&id) else {
            // The parser rejects unknown anchors, so this is an alias inside its own anchor.
            return self.fail(
                line,
                "recursive alias: an alias refers to its own enclosing node",
            );
        };
        self.expanded = self.expanded.saturating_add(node.weight);
        self.expanded_bytes = self.expanded_bytes.saturating_add(node.bytes);
        if self.expanded > MAX_ALIAS_EXPANSION {
            return self.fail(
                line,
                format!(
                    "aliases expand to more than {MAX_ALIAS_EXPANSION} nodes; refusing to load"
                ),
            );
        }
        if self.expanded_bytes > MAX_ALIAS_BYTES {
            return self.fail(
                line,
                format!(
                    "aliases expand to more than {} MiB of text; refusing to load",
                    MAX_ALIAS_BYTES >> 20
                ),
            );
        }
        let mut copy = node.clone();
        // Errors inside the copy point at the anchor; the alias line is more useful for the
        // copied node itself.
        copy.line = line;
        self.complete(copy, 0);
    }

    /// Opens a sequence or a mapping, within the nesting limit.
    fn open(&mut self, frame: Frame) {
        let line = match &frame {
            Frame::Seq { line, .. } | Frame::Map { line, .. } => *line,
        };
        if self.push(line) {
            self.stack.push(frame);
        }
    }

    /// Closes the innermost collection into a node (merge keys resolved).
    fn close(&mut self) {
        let Some(frame) = self.stack.pop() else {
            return;
        };
        let (line, anchor, value, (weight, bytes)) = match frame {
            Frame::Seq {
                line,
                anchor,
                items,
            } => {
                let w = items.iter().fold((1, 0usize), |(n, b), i| {
                    (n + i.weight, b.saturating_add(i.bytes))
                });
                (line, anchor, Value::Seq(items), w)
            }
            Frame::Map {
                line,
                anchor,
                entries,
                ..
            } => match resolve_merges(entries) {
                Ok(entries) => {
                    let w = entries.iter().fold((1, 0usize), |(n, b), (k, v)| {
                        (n + k.weight + v.weight, b.saturating_add(k.bytes + v.bytes))
                    });
                    (line, anchor, Value::Map(entries), w)
                }
                Err(e) => return self.error = Some(e),
            },
        };
        self.complete(
            Node {
                line,
                value,
                weight,
                bytes,
            },
            anchor,
        );
    }

    fn fail(&mut self, line: usize, message: impl Into<String>) {
        self.error = Some(SyntaxError {
            line,
            message: message.into(),
        });
    }

    /// Checks the nesting limit before opening a collection.
    fn push(&mut self, line: usize) -> bool {
        if self.stack.len() >= MAX_DEPTH {
            self.fail(line, format!("YAML nested deeper than {MAX_DEPTH} levels"));
            return false;
        }
        true
    }

    /// Attaches a finished node to its parent (or ends a document) and records its anchor.
    fn complete(&mut self, node: Node, anchor: usize) {
        if anchor != 0 {
            self.anchors.insert(anchor, node.clone());
        }
        match self.stack.last_mut() {
            None => self.docs.push(node),
            Some(Frame::Seq { items, .. }) => items.push(node),
            Some(Frame::Map { entries, key, .. }) => match key.take() {
                None => *key = Some(node),
                Some(k) => {
                    let mut node = node;
                    // An omitted value (`key:` then a newline) is marked where the parser noticed
                    // it, often the next line; its key's line is where a reader looks.
                    if matches!(&node.value, Value::Scalar(s) if s.plain && s.text.is_empty()) {
                        node.line = k.line;
                    }
                    entries.push((k, node));
                }
            },
        }
    }
}

fn is_merge_key(node: &Node) -> bool {
    match &node.value {
        Value::Scalar(s) => {
            (s.plain && s.tag.is_none() && s.text == "<<")
                || s.tag
                    .as_deref()
                    .and_then(|t| t.strip_prefix(CORE_TAG_PREFIX))
                    == Some("merge")
        }
        _ => false,
    }
}

fn scalar_text(node: &Node) -> Option<&str> {
    match &node.value {
        Value::Scalar(s) => Some(&s.text),
        _ => None,
    }
}

/// Applies `<<` merge keys (YAML 1.1, supported by yaml.v2): explicit keys win, then earlier
/// merged mappings win over later ones.
fn resolve_merges(entries: Vec<(Node, Node)>) -> Result<Vec<(Node, Node)>, SyntaxError> {
    if !entries.iter().any(|(k, _)| is_merge_key(k)) {
        return Ok(entries);
    }
    let (merges, mut out): (Vec<_>, Vec<_>) =
        entries.into_iter().partition(|(k, _)| is_merge_key(k));
    let mut seen: HashSet<String> = out
        .iter()
        .filter_map(|(k, _)| scalar_text(k).map(str::to_owned))
        .collect();
    for (key, value) in merges {
        let sources = match value.value {
            Value::Map(entries) => vec![entries],
            Value::Seq(items) => {
                let mut maps = Vec::with_capacity(items.len());
                for item in items {
                    match item.value {
                        Value::Map(entries) => maps.push(entries),
                        _ => {
                            return Err(SyntaxError {
                                line: item.line,
                                message: "merge key `<<` takes a mapping or a list of mappings"
                                    .into(),
                            })
                        }
                    }
                }
                maps
            }
            Value::Scalar(_) => {
                return Err(SyntaxError {
                    line: key.line,
                    message: "merge key `<<` takes a mapping or a list of mappings".into(),
                })
            }
        };
        for source in sources {
            for (k, v) in source {
                let fresh = match scalar_text(&k) {
                    Some(t) => seen.insert(t.to_owned()),
                    None => true,
                };
                if fresh {
                    out.push((k, v));
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map_lines(node: &Node) -> Vec<(String, usize, usize)> {
        match &node.value {
            Value::Map(entries) => entries
                .iter()
                .map(|(k, v)| (scalar_text(k).unwrap_or("?").to_owned(), k.line, v.line))
                .collect(),
            _ => panic!("not a map"),
        }
    }

    #[test]
    fn lines_are_one_based() {
        let docs = parse("a: 1\nb:\n  c: 2\n").unwrap();
        assert_eq!(docs.len(), 1);
        assert_eq!(docs[0].line, 1);
        let lines = map_lines(&docs[0]);
        assert_eq!(lines[0], ("a".to_owned(), 1, 1));
        assert_eq!(lines[1].0, "b");
        assert_eq!(lines[1].1, 2);
        assert_eq!(lines[1].2, 3, "a block mapping starts at its first key");
    }

    #[test]
    fn yaml_v2_scalar_resolution() {
        let r = |s: &str| resolve_plain(s);
        assert_eq!(r("yes"), Resolved::Bool(true));
        assert_eq!(r("Off"), Resolved::Bool(false));
        assert_eq!(r("~"), Resolved::Null);
        assert_eq!(r(""), Resolved::Null);
        assert_eq!(r("010"), Resolved::Int(8));
        assert_eq!(r("0x1F"), Resolved::Int(31));
        assert_eq!(r("1_000"), Resolved::Int(1000));
        assert_eq!(r("-5"), Resolved::Int(-5));
        assert_eq!(
            r("18446744073709551615"),
            Resolved::Int(18446744073709551615)
        );
        assert_eq!(r("1.5"), Resolved::Float);
        assert_eq!(r("09"), Resolved::Float);
        assert_eq!(r("1e3"), Resolved::Float);
        assert_eq!(r(".inf"), Resolved::Float);
        assert_eq!(r("2024-01-01"), Resolved::Str);
        assert_eq!(r("abc"), Resolved::Str);
        assert_eq!(r("-"), Resolved::Str);
        assert_eq!(r("."), Resolved::Str);
    }

    #[test]
    fn quoted_and_str_tagged_scalars_are_strings() {
        let docs = parse("a: '10'\nb: !!str 10\nc: 10\n").unwrap();
        let Value::Map(entries) = &docs[0].value else {
            panic!("not a map")
        };
        let kinds: Vec<_> = entries
            .iter()
            .map(|(_, v)| match &v.value {
                Value::Scalar(s) => s.resolve(),
                _ => panic!("not a scalar"),
            })
            .collect();
        assert_eq!(kinds, vec![Resolved::Str, Resolved::Str, Resolved::Int(10)]);
    }

    #[test]
    fn merge_keys_explicit_wins() {
        let docs = parse("base: &b {x: 1, y: 2}\nm:\n  <<: *b\n  y: 3\n").unwrap();
        let Value::Map(top) = &docs[0].value else {
            panic!("not a map")
        };
        let Value::Map(m) = &top[1].1.value else {
            panic!("not a map")
        };
        let pairs: Vec<_> = m
            .iter()
            .map(|(k, v)| (scalar_text(k).unwrap(), scalar_text(v).unwrap()))
            .collect();
        assert_eq!(pairs, vec![("y", "3"), ("x", "1")]);
    }

    #[test]
    fn alias_bomb_is_refused() {
        let mut text = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..10 {
            let prev = i - 1;
            text.push_str(&format!(
                "a{i}: &a{i} [*a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, \
                 *a{prev}, *a{prev}, *a{prev}, *a{prev}]\n"
            ));
        }
        let err = parse(&text).unwrap_err();
        assert!(err.message.contains("aliases expand"), "{err:?}");
    }

    #[test]
    fn alias_bomb_of_long_strings_is_refused_by_its_bytes() {
        // Review A15: few nodes, much text. 600 KiB aliased 100 times would be 60 MB.
        let long = "x".repeat(600 << 10);
        let aliases = vec!["*s"; 100].join(", ");
        let err = parse(&format!("s: &s \"{long}\"\nt: [{aliases}]\n")).unwrap_err();
        assert!(err.message.contains("MiB of text"), "{err:?}");
        assert_eq!(err.line, 2, "the line of the alias past the budget");
        // Aliases as configs use them: a short string copied many times is fine.
        let short = "y".repeat(1 << 10);
        let aliases = vec!["*s"; 1000].join(", ");
        assert!(parse(&format!("s: &s \"{short}\"\nt: [{aliases}]\n")).is_ok());
    }

    #[test]
    fn deep_nesting_is_refused() {
        let text = format!("{}{}", "[".repeat(250), "]".repeat(250));
        let err = parse(&text).unwrap_err();
        assert!(err.message.contains("nested deeper"), "{err:?}");
        let text = "- ".repeat(5000);
        assert!(parse(&text).is_err());
    }

    #[test]
    fn syntax_error_has_line() {
        let err = parse("a: 1\nb: [1, 2\nc: 3\n").unwrap_err();
        assert!(err.line >= 2, "{err:?}");
        assert!(err.message.starts_with("YAML syntax error"));
    }
}
