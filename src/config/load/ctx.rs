//! The walk over one file's YAML tree: [`Ctx`] collects errors as it reads the root and the
//! `descriptors` lists, with the scalar readers every rule shares (`string`, `flag`, `list`, ...).
//! Descriptors and limits are built in their own files.

use super::super::yaml::{Node, Resolved, Value};
use super::super::{Counting, DomainRules, Level, RateLimitRule, ValueMatch};
use super::errors::ConfigError;
use super::schema::{unknown_key_message, Scope};
use std::collections::HashMap;
use std::sync::Arc;

/// One limit mapping as parsed, with what the descriptor-level checks need. When the mapping
/// had errors the rule holds placeholders; the descriptor is then discarded anyway.
pub(super) struct ParsedLimit {
    pub(super) rule: RateLimitRule,
    /// YAML path of the mapping, e.g. `descriptors[0].rate_limits[1]`.
    pub(super) path: String,
    /// Line of `name`, when the limit has one.
    pub(super) name_line: Option<usize>,
    /// Line of `applies_to_descendants: true`.
    pub(super) descendants_line: Option<usize>,
}

/// Walks one file's tree, collecting errors.
pub(super) struct Ctx {
    pub(super) file: Arc<str>,
    pub(super) errors: Vec<ConfigError>,
    /// `USE_CALENDAR_MONTH_RATE_LIMIT` (see [`super::LoadOptions::calendar_months`]).
    pub(super) calendar_months: bool,
    /// (line, path) of every `global` block: each needs the home store (`GLOBAL_REDIS_URL`).
    pub(super) globals: Vec<(Arc<str>, usize, String)>,
}

impl Ctx {
    pub(super) fn err(&mut self, line: usize, path: &str, message: impl Into<String>) {
        self.errors.push(ConfigError {
            file: self.file.to_string(),
            // Line 0: a config without source text (pushed over xDS).
            line: (line > 0).then_some(line),
            path: path.to_owned(),
            message: message.into(),
        });
    }

    /// The accepted entries of a mapping as `(key, key node, value node)`; reports non-string,
    /// unknown and duplicate keys.
    pub(super) fn entries<'a>(
        &mut self,
        entries: &'a [(Node, Node)],
        path: &str,
        scope: Scope,
    ) -> Vec<(&'a str, &'a Node, &'a Node)> {
        let mut out = Vec::with_capacity(entries.len());
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (k, v) in entries {
            let Value::Scalar(s) = &k.value else {
                self.err(k.line, path, "mapping keys must be plain strings");
                continue;
            };
            let key = s.text.as_str();
            if !scope.keys().contains(&key) {
                self.err(k.line, &join(path, key), unknown_key_message(key, scope));
                continue;
            }
            if let Some(first) = seen.insert(key, k.line) {
                // yaml.v2 silently keeps the last of duplicate keys, which can drop a whole
                // `descriptors` list unnoticed; sluice rejects it.
                self.err(
                    k.line,
                    &join(path, key),
                    format!("duplicate key '{key}' in one mapping (first at line {first})"),
                );
                continue;
            }
            out.push((key, k, v));
        }
        out
    }

    /// A string field. yaml.v2 turns any scalar into its source text (so `value: true` is
    /// "true" and null is ""), but its key validation rejects numbers with a fraction.
    pub(super) fn string(&mut self, node: &Node, path: &str, name: &str) -> Option<String> {
        match &node.value {
            Value::Scalar(s) => match s.resolve() {
                Resolved::Null => Some(String::new()),
                Resolved::Float => {
                    self.err(
                        node.line,
                        path,
                        format!(
                            "`{name}` {} reads as a floating-point number in YAML 1.1, which \
                             envoyproxy/ratelimit rejects here; quote it to use it as text: \"{}\"",
                            s.text, s.text
                        ),
                    );
                    None
                }
                Resolved::Bool(_) | Resolved::Int(_) | Resolved::Str => Some(s.text.clone()),
            },
            _ => {
                self.err(
                    node.line,
                    path,
                    format!("`{name}` must be a string, not a {}", kind(node)),
                );
                None
            }
        }
    }

    /// A boolean flag; null is false, as yaml.v2 leaves the Go zero value.
    pub(super) fn flag(&mut self, node: &Node, path: &str, name: &str) -> Option<bool> {
        if let Value::Scalar(s) = &node.value {
            match s.resolve() {
                Resolved::Null => return Some(false),
                Resolved::Bool(b) => return Some(b),
                _ => {}
            }
        }
        self.err(
            node.line,
            path,
            format!(
                "`{name}` must be a boolean (true or false), got {}",
                describe(node)
            ),
        );
        None
    }

    /// A list of mappings (or null, meaning empty).
    pub(super) fn list<'a>(
        &mut self,
        node: &'a Node,
        path: &str,
        name: &str,
    ) -> Option<&'a [Node]> {
        match &node.value {
            Value::Seq(items) => Some(items),
            Value::Scalar(s) if s.resolve() == Resolved::Null => Some(&[]),
            _ => {
                self.err(
                    node.line,
                    path,
                    format!("`{name}` must be a list, not a {}", kind(node)),
                );
                None
            }
        }
    }

    /// The top-level mapping: the rules and the line of `domain` when the domain is usable.
    pub(super) fn root(&mut self, root: &Node) -> Option<(DomainRules, usize)> {
        let Value::Map(entries) = &root.value else {
            self.err(
                root.line,
                "",
                format!(
                    "the top level must be a mapping with `domain` and `descriptors`, not a {}",
                    kind(root)
                ),
            );
            return None;
        };
        let mut domain: Option<(String, usize)> = None;
        let mut descriptors = None;
        let mut domain_seen = false;
        let mut domain_tag = false;
        let mut counting = None;
        let mut allow_limit_override = None;
        for (key, _, value) in self.entries(entries, "", Scope::Root) {
            match key {
                "hash_tag" => domain_tag = self.hash_tag(value),
                "counting" => counting = self.counting(value),
                "allow_limit_override" => {
                    allow_limit_override =
                        self.flag(value, "allow_limit_override", "allow_limit_override");
                }
                "domain" => {
                    domain_seen = true;
                    domain = self
                        .string(value, "domain", "domain")
                        .map(|d| (d, value.line));
                }
                "descriptors" => descriptors = Some(value),
                _ => {}
            }
        }
        let domain = self.domain_name(domain, domain_seen, root.line);
        let prefix = domain
            .as_ref()
            .map(|(d, _)| format!("{d}."))
            .unwrap_or_default();
        let mut level = Level::default();
        if let Some(node) = descriptors {
            self.descriptors(node, "descriptors", &prefix, &mut level);
        }
        domain.map(|(domain, line)| {
            (
                DomainRules {
                    name: Arc::from(domain.as_str()),
                    domain,
                    file: self.file.clone(),
                    root: level,
                    domain_tag,
                    counting,
                    allow_limit_override,
                    globals: std::mem::take(&mut self.globals),
                },
                line,
            )
        })
    }

    /// The `domain` read at `root_line` (`seen`: the key was there), if it is usable.
    fn domain_name(
        &mut self,
        domain: Option<(String, usize)>,
        seen: bool,
        root_line: usize,
    ) -> Option<(String, usize)> {
        match domain {
            Some((d, line)) if d.len() > super::MAX_DOMAIN_BYTES => {
                self.err(
                    line,
                    "domain",
                    format!(
                        "the domain is {} bytes; at most {} are accepted",
                        d.len(),
                        super::MAX_DOMAIN_BYTES
                    ),
                );
                None
            }
            Some((d, line)) if !d.is_empty() => Some((d, line)),
            Some((_, line)) => {
                self.err(line, "domain", "config file cannot have empty domain");
                None
            }
            None => {
                if !seen {
                    self.err(
                        root_line,
                        "domain",
                        "config file cannot have empty domain (`domain` is missing)",
                    );
                }
                None
            }
        }
    }

    /// `counting`: `envoyproxy` or `all_or_nothing`; absent, the global `COUNTING` applies.
    fn counting(&mut self, value: &Node) -> Option<Counting> {
        let raw = self.string(value, "counting", "counting")?;
        match raw.parse::<Counting>() {
            Ok(c) => Some(c),
            Err(e) => {
                self.err(value.line, "counting", e);
                None
            }
        }
    }

    /// `hash_tag`: `descriptor` (the default) or `domain`, which puts a whole domain in one slot.
    fn hash_tag(&mut self, value: &Node) -> bool {
        match self.string(value, "hash_tag", "hash_tag").as_deref() {
            Some("domain") => true,
            Some("descriptor") | None => false,
            Some(other) => {
                self.err(
                    value.line,
                    "hash_tag",
                    format!(
                        "hash_tag must be `descriptor` (the default: domain and the descriptor's \
                         first entry) or `domain` (the whole domain in one Redis Cluster slot), \
                         got {other:?}"
                    ),
                );
                false
            }
        }
    }

    /// One `descriptors` list into `level`; `prefix` is the stats path of the parent plus `.`.
    pub(super) fn descriptors(&mut self, node: &Node, path: &str, prefix: &str, level: &mut Level) {
        let Some(items) = self.list(node, path, "descriptors") else {
            return;
        };
        // Composite key (`key` or `key_value`, envoyproxy's map key for a level) -> first line.
        let mut seen: HashMap<String, usize> = HashMap::new();
        for (i, item) in items.iter().enumerate() {
            let item_path = format!("{path}[{i}]");
            let Some(node) = self.descriptor(item, &item_path, prefix, &mut seen) else {
                continue;
            };
            match &node.value {
                ValueMatch::Exact(v) => {
                    level
                        .exact
                        .entry(node.key.clone())
                        .or_default()
                        .insert(v.clone(), node);
                }
                ValueMatch::Wildcard(_) => level.wildcards.push(node),
                ValueMatch::Any => {
                    level.bare.insert(node.key.clone(), node);
                }
            }
        }
    }
}

impl Ctx {
    /// The text of a scalar extension value (`period`, `algorithm`), whatever YAML type it reads
    /// as; `expected` describes a valid value for the error.
    pub(super) fn text(
        &mut self,
        node: &Node,
        path: &str,
        name: &str,
        expected: &str,
    ) -> Option<String> {
        match &node.value {
            Value::Scalar(s) if s.resolve() != Resolved::Null => Some(s.text.clone()),
            Value::Scalar(_) => {
                self.err(
                    node.line,
                    path,
                    format!("`{name}` is empty; expected {expected}"),
                );
                None
            }
            _ => {
                self.err(
                    node.line,
                    path,
                    format!("`{name}` must be {expected}, not a {}", kind(node)),
                );
                None
            }
        }
    }

    /// `burst`: a whole number from 0 to u32::MAX.
    pub(super) fn burst(&mut self, node: &Node, path: &str) -> Option<u32> {
        if let Value::Scalar(s) = &node.value {
            if let Resolved::Int(n) = s.resolve() {
                if let Ok(n) = u32::try_from(n) {
                    return Some(n);
                }
            }
        }
        self.err(
            node.line,
            path,
            format!(
                "`burst` must be an integer from 0 to {}, got {}",
                u32::MAX,
                describe(node)
            ),
        );
        None
    }

    pub(super) fn requests_per_unit(&mut self, node: &Node, path: &str) -> Option<u32> {
        if let Value::Scalar(s) = &node.value {
            match s.resolve() {
                Resolved::Null => return Some(0),
                Resolved::Int(n) => {
                    if let Ok(n) = u32::try_from(n) {
                        return Some(n);
                    }
                }
                _ => {}
            }
        }
        self.err(
            node.line,
            path,
            format!(
                "requests_per_unit must be an integer from 0 to {}, got {}",
                u32::MAX,
                describe(node)
            ),
        );
        None
    }

    /// `replaces: [{name: a}, {name: b}]` into names, each with its line.
    pub(super) fn replaces(&mut self, node: &Node, path: &str) -> Vec<(String, usize)> {
        let mut names = Vec::new();
        let Some(items) = self.list(node, path, "replaces") else {
            return names;
        };
        for (i, item) in items.iter().enumerate() {
            let p = format!("{path}[{i}]");
            let Value::Map(entries) = &item.value else {
                self.err(
                    item.line,
                    &p,
                    format!(
                        "each `replaces` entry must be a mapping like {{name: other_limit}}, not a {}",
                        kind(item)
                    ),
                );
                continue;
            };
            let mut name = None;
            for (key, _, v) in self.entries(entries, &p, Scope::Replaces) {
                if key == "name" {
                    name = Some(self.string(v, &join(&p, key), key));
                }
            }
            match name {
                Some(Some(n)) if !n.is_empty() => names.push((n, item.line)),
                // Already reported as a bad string.
                Some(None) => {}
                _ => self.err(
                    item.line,
                    &join(&p, "name"),
                    "should not have an empty replaces entry (each entry needs a `name`)",
                ),
            }
        }
        names
    }
}

pub(super) fn is_null(node: &Node) -> bool {
    matches!(&node.value, Value::Scalar(s) if s.resolve() == Resolved::Null)
}

pub(super) fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

pub(super) fn kind(node: &Node) -> &'static str {
    match &node.value {
        Value::Scalar(_) => "scalar",
        Value::Seq(_) => "list",
        Value::Map(_) => "mapping",
    }
}

/// A node for an error message: a scalar's text, or its kind.
pub(super) fn describe(node: &Node) -> String {
    match &node.value {
        Value::Scalar(s) => format!("'{}'", s.text),
        _ => format!("a {}", kind(node)),
    }
}
