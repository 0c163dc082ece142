//! One `descriptors` entry into a [`DescriptorNode`]: its key and value matcher, its limits,
//! its flags and its children, with every error of the subtree collected.

use super::super::yaml::{Node, Value};
use super::super::{
    DescriptorNode, LeaseKeys, Level, Location, Quota, RateLimitRule, Reservations, ValueMatch,
};
use super::ctx::{join, kind, Ctx, ParsedLimit};
use super::schema::Scope;
use std::collections::HashMap;
use std::sync::Arc;

/// A descriptor's keys as written.
#[derive(Default)]
struct DescriptorKeys<'a> {
    key: Option<(String, usize)>,
    /// A key already reported as malformed.
    key_invalid: bool,
    value: String,
    /// A malformed value is reported once; it must not also read as "no value".
    value_bad: bool,
    /// (value node, path, line of the key) of `rate_limit` and of `rate_limits`.
    rate_limit: Option<(&'a Node, String, usize)>,
    rate_limits: Option<(&'a Node, String, usize)>,
    children: Option<(&'a Node, String)>,
    shadow_mode: bool,
    quota_mode: bool,
    detailed_metric: bool,
    value_to_metric: bool,
    share_threshold: Option<usize>,
    metadata: Option<Arc<prost_types::Struct>>,
    /// (value node, path) of `in_flight` and of `reservations`.
    in_flight: Option<(&'a Node, String)>,
    reservations: Option<(&'a Node, String)>,
    /// (value node, path) of `leased`.
    leased: Option<(&'a Node, String)>,
    /// (value node, path) of `global`.
    global: Option<(&'a Node, String)>,
    /// `own_hash_tags: true`: the limits strictly below take hash tags of their own.
    own_hash_tags: bool,
}

impl Ctx {
    /// The descriptor's `leased` or `global` block on its limits (not both).
    fn sliced(&mut self, keys: &DescriptorKeys<'_>, rules: &mut [RateLimitRule]) {
        match (&keys.leased, &keys.global) {
            (Some(_), Some((node, p))) => self.err(
                node.line,
                p,
                "`global` and `leased` on one descriptor: a global limit is already spent from \
                 slices (of its region's pool); keep `global` and move `leased`'s options into it"
                    .to_string(),
            ),
            (Some((node, p)), None) => self.leased_on(node, p, rules, false),
            (None, Some((node, p))) => self.leased_on(node, p, rules, true),
            (None, None) => {}
        }
    }

    pub(super) fn descriptor(
        &mut self,
        item: &Node,
        path: &str,
        prefix: &str,
        seen: &mut HashMap<String, usize>,
    ) -> Option<DescriptorNode> {
        let Value::Map(entries) = &item.value else {
            self.err(
                item.line,
                path,
                format!(
                    "config error, each entry of `descriptors` must be a mapping with at least \
                     `key`, not a {}",
                    kind(item)
                ),
            );
            return None;
        };
        let errors_before = self.errors.len();
        let keys = self.descriptor_keys(entries, path);
        let key = self.descriptor_key(&keys, item, path);
        let matcher = if keys.value.is_empty() {
            ValueMatch::Any
        } else if keys.value.contains('*') {
            ValueMatch::Wildcard(keys.value.clone())
        } else {
            ValueMatch::Exact(keys.value.clone())
        };
        if !keys.value_bad {
            self.check_matcher(&keys, key.as_ref(), &matcher, path);
        }
        let composite = key.as_ref().filter(|_| !keys.value_bad).map(|(k, _)| {
            if keys.value.is_empty() {
                k.clone()
            } else {
                format!("{k}_{}", keys.value)
            }
        });
        let stats_path = format!("{prefix}{}", composite.as_deref().unwrap_or(""));
        if let Some(c) = composite {
            self.check_unique(c, &stats_path, item.line, path, seen);
        }
        let mut rules = self.descriptor_limits(&keys, path);
        let lease_keys = self.lease_limit(&keys, &mut rules);
        self.sliced(&keys, &mut rules);
        let mut level = Level::default();
        if let Some((node, p)) = &keys.children {
            // Children are checked even when this descriptor is broken, so all errors show.
            self.descriptors(node, p, &format!("{stats_path}."), &mut level);
        }
        if keys.own_hash_tags {
            own_tags_below(&mut level);
        }

        let (key, _) = key?;
        // Any error in this descriptor or below it means the whole load fails; the node is
        // only built for a clean subtree.
        if self.errors.len() > errors_before {
            return None;
        }
        Some(DescriptorNode {
            key,
            value: matcher,
            rate_limits: rules,
            share_threshold: keys.share_threshold.is_some(),
            detailed_metric: keys.detailed_metric,
            value_to_metric: keys.value_to_metric,
            children: level,
            location: Location {
                file: self.file.clone(),
                line: item.line,
            },
            path: stats_path,
            metadata: keys.metadata,
            lease_keys,
        })
    }

    /// The lease blocks: `in_flight` added to the node's limits (with its shadow and quota
    /// modes), `reservations` set on the node's rate limits. Both name requests by the node's
    /// one pair of entry names, which must not also be the keys of child descriptors (they would
    /// hide them).
    fn lease_limit(
        &mut self,
        keys: &DescriptorKeys<'_>,
        rules: &mut Vec<RateLimitRule>,
    ) -> Option<LeaseKeys> {
        let in_flight = match &keys.in_flight {
            Some((node, p)) => Some((self.in_flight(node, p)?, p.as_str())),
            None => None,
        };
        let reservations = match &keys.reservations {
            Some((node, p)) => Some((self.reservations(node, p)?, node.line, p.as_str())),
            None => None,
        };
        let mut lease: Option<(LeaseKeys, &str)> = None;
        if let Some(((terms, lk), line, p)) = reservations {
            self.reserve_on(rules, terms, line, p);
            lease = Some((lk, p));
        }
        if let Some(((parsed, lk), p)) = in_flight {
            if let Some((other, op)) = &lease {
                if *other != lk {
                    self.err(
                        keys.in_flight.as_ref().map_or(0, |(n, _)| n.line),
                        p,
                        format!(
                            "`in_flight` names requests by '{}'/'{}' but `reservations` ({op}) \
                             by '{}'/'{}': one descriptor names its requests one way; use the \
                             same `id_key` and `done_key`",
                            lk.id_key, lk.done_key, other.id_key, other.done_key
                        ),
                    );
                    return None;
                }
            }
            rules.push(RateLimitRule {
                shadow_mode: keys.shadow_mode,
                quota_mode: keys.quota_mode,
                ..parsed.rule
            });
            lease = Some((lk, p));
        }
        let (lease, p) = lease?;
        self.check_lease_children(keys, &lease, p);
        Some(lease)
    }

    /// Sets `reservations` on the node's rate limits: it needs one, never `unlimited` (which has
    /// nothing to reserve) nor a resource limit (whose requests are other nodes').
    fn reserve_on(
        &mut self,
        rules: &mut [RateLimitRule],
        terms: Reservations,
        line: usize,
        path: &str,
    ) {
        if rules.is_empty() {
            self.err(
                line,
                path,
                "`reservations` reserves against the descriptor's `rate_limit`, and it has none"
                    .to_string(),
            );
        }
        for r in rules.iter_mut() {
            if r.quota == Quota::Unlimited {
                self.err(
                    line,
                    path,
                    "`reservations` on an `unlimited` limit: there is nothing to reserve against"
                        .to_string(),
                );
            } else if r.applies_to_descendants {
                self.err(
                    line,
                    path,
                    "`reservations` on a limit with `applies_to_descendants`: its requests name \
                     nodes below, not this one; put `reservations` on those nodes"
                        .to_string(),
                );
            } else {
                r.reservations = Some(terms);
            }
        }
    }

    /// A child whose key is one of the lease entry names would be mistaken for it.
    fn check_lease_children(&mut self, keys: &DescriptorKeys<'_>, lease: &LeaseKeys, block: &str) {
        let Some((
            Node {
                value: Value::Seq(items),
                ..
            },
            cp,
        )) = &keys.children
        else {
            return;
        };
        for (n, item) in items.iter().enumerate() {
            let Value::Map(entries) = &item.value else {
                continue;
            };
            let child_key = entries
                .iter()
                .find_map(|(k, v)| match (&k.value, &v.value) {
                    (Value::Scalar(k), Value::Scalar(v)) if k.text == "key" => Some(&v.text),
                    _ => None,
                });
            if let Some(ck) = child_key.filter(|ck| **ck == lease.id_key || **ck == lease.done_key)
            {
                self.err(
                    item.line,
                    &format!("{cp}[{n}]"),
                    format!(
                        "a child descriptor with key '{ck}', which this descriptor's lease \
                         block ({block}) uses to name requests: the two would be mistaken for \
                         each other; rename one"
                    ),
                );
            }
        }
    }

    /// Two siblings with the same key and value would count on one counter: an error naming
    /// the first.
    fn check_unique(
        &mut self,
        composite: String,
        stats_path: &str,
        line: usize,
        path: &str,
        seen: &mut HashMap<String, usize>,
    ) {
        match seen.get(&composite) {
            Some(first) => self.err(
                line,
                path,
                format!(
                    "duplicate descriptor composite key '{stats_path}' (first at line {first})"
                ),
            ),
            None => {
                seen.insert(composite, line);
            }
        }
    }

    /// Reads a descriptor's keys, reporting malformed values (each once).
    fn descriptor_keys<'a>(
        &mut self,
        entries: &'a [(Node, Node)],
        path: &str,
    ) -> DescriptorKeys<'a> {
        let mut d = DescriptorKeys::default();
        for (name, k, v) in self.entries(entries, path, Scope::Descriptor) {
            let p = join(path, name);
            match name {
                "key" => match self.string(v, &p, name) {
                    Some(k) => d.key = Some((k, v.line)),
                    None => d.key_invalid = true,
                },
                "value" => match self.string(v, &p, name) {
                    Some(s) => d.value = s,
                    None => d.value_bad = true,
                },
                "rate_limit" => d.rate_limit = Some((v, p, k.line)),
                "rate_limits" => d.rate_limits = Some((v, p, k.line)),
                "descriptors" => d.children = Some((v, p)),
                "in_flight" => d.in_flight = Some((v, p)),
                "reservations" => d.reservations = Some((v, p)),
                "leased" => d.leased = Some((v, p)),
                "global" => d.global = Some((v, p)),
                "own_hash_tags" => d.own_hash_tags = self.flag(v, &p, name).unwrap_or(false),
                "shadow_mode" => d.shadow_mode = self.flag(v, &p, name).unwrap_or(false),
                "quota_mode" => d.quota_mode = self.flag(v, &p, name).unwrap_or(false),
                "detailed_metric" => d.detailed_metric = self.flag(v, &p, name).unwrap_or(false),
                "value_to_metric" => d.value_to_metric = self.flag(v, &p, name).unwrap_or(false),
                "share_threshold" => {
                    d.share_threshold = (self.flag(v, &p, name) == Some(true)).then_some(v.line);
                }
                // Free-form, returned to Envoy with RESPONSE_DYNAMIC_METADATA.
                "metadata" => match super::super::metadata::to_struct(v) {
                    Ok(m) => d.metadata = Some(Arc::new(m)),
                    Err(e) => self.err(v.line, &p, e),
                },
                _ => {}
            }
        }
        d
    }

    /// The descriptor's key and its line; `None` (reported) when missing or empty.
    fn descriptor_key(
        &mut self,
        keys: &DescriptorKeys<'_>,
        item: &Node,
        path: &str,
    ) -> Option<(String, usize)> {
        match &keys.key {
            Some((k, line)) if k.is_empty() => {
                self.err(*line, &join(path, "key"), "descriptor has empty key");
                None
            }
            Some((k, line)) => Some((k.clone(), *line)),
            None => {
                if !keys.key_invalid {
                    self.err(
                        item.line,
                        path,
                        "descriptor has empty key (`key` is missing)",
                    );
                }
                None
            }
        }
    }

    /// Key wildcards (unsupported) and `share_threshold` without a wildcard value.
    fn check_matcher(
        &mut self,
        keys: &DescriptorKeys<'_>,
        key: Option<&(String, usize)>,
        matcher: &ValueMatch,
        path: &str,
    ) {
        if let Some((k, line)) = key {
            if *matcher == ValueMatch::Any && k.ends_with('*') {
                // envoyproxy/ratelimit turns a bare key ending in `*` into a prefix match on
                // "key_value" strings, i.e. on keys; sluice only supports wildcards in values.
                self.err(
                    *line,
                    &join(path, "key"),
                    format!(
                        "a bare key ending in '*' ('{k}') is a key wildcard, which sluice does not \
                         support; put the wildcard in `value`"
                    ),
                );
            }
        }
        if let Some(line) = keys.share_threshold {
            if !matches!(matcher, ValueMatch::Wildcard(_)) {
                let found = if keys.value.is_empty() {
                    "no value".to_owned()
                } else {
                    format!("value '{}'", keys.value)
                };
                self.err(
                    line,
                    &join(path, "share_threshold"),
                    format!(
                        "share_threshold can only be used with wildcard values (containing '*'), \
                         but found {found}"
                    ),
                );
            }
        }
    }

    /// The descriptor's limits (`rate_limit` or `rate_limits`, not both), with its shadow and
    /// quota modes.
    fn descriptor_limits(&mut self, keys: &DescriptorKeys<'_>, path: &str) -> Vec<RateLimitRule> {
        let mut limits = Vec::new();
        if let (Some((_, _, one_line)), Some((_, _, list_line))) =
            (&keys.rate_limit, &keys.rate_limits)
        {
            // Reported on whichever comes second; both are still checked below.
            let (line, key, other, other_line) = if one_line < list_line {
                (*list_line, "rate_limits", "rate_limit", *one_line)
            } else {
                (*one_line, "rate_limit", "rate_limits", *list_line)
            };
            self.err(
                line,
                &join(path, key),
                format!(
                    "`rate_limit` and `rate_limits` cannot both be given on one descriptor \
                     (`{other}` is at line {other_line}); put every limit in `rate_limits`"
                ),
            );
        }
        if let Some((node, p, _)) = &keys.rate_limit {
            limits.extend(self.limit(node, p, Scope::RateLimit));
        }
        if let Some((node, p, _)) = &keys.rate_limits {
            limits.extend(self.rate_limits(node, p));
        }
        let has_children = keys
            .children
            .as_ref()
            .is_some_and(|(node, _)| matches!(&node.value, Value::Seq(items) if !items.is_empty()));
        self.check_node_limits(&limits, has_children);
        limits
            .into_iter()
            .map(|l| RateLimitRule {
                shadow_mode: keys.shadow_mode,
                quota_mode: keys.quota_mode,
                ..l.rule
            })
            .collect()
    }

    /// The checks across the limits of one descriptor: unique names, and resource limits
    /// (`applies_to_descendants`) only where something can match below.
    pub(super) fn check_node_limits(&mut self, limits: &[ParsedLimit], has_children: bool) {
        let mut names: HashMap<&str, usize> = HashMap::new();
        for l in limits {
            if let (Some(name), Some(line)) = (l.rule.name.as_deref(), l.name_line) {
                if let Some(first) = names.get(name) {
                    self.err(
                        line,
                        &join(&l.path, "name"),
                        format!(
                            "duplicate limit name '{name}' on one descriptor (first at line \
                             {first}); the limits of a descriptor need distinct names"
                        ),
                    );
                } else {
                    names.insert(name, line);
                }
            }
            if let (Some(line), false) = (l.descendants_line, has_children) {
                self.err(
                    line,
                    &join(&l.path, "applies_to_descendants"),
                    "`applies_to_descendants: true` on a descriptor without child `descriptors`: \
                     no request can ever match below this node, so the flag could never act; add \
                     child descriptors or remove the flag",
                );
            }
        }
    }
}

/// Marks every limit of every node in `level` and below with a hash tag of its own (the
/// subtree of a node with `own_hash_tags: true`).
fn own_tags_below(level: &mut Level) {
    let nodes = level
        .exact
        .values_mut()
        .flat_map(|m| m.values_mut())
        .chain(level.wildcards.iter_mut())
        .chain(level.bare.values_mut());
    for node in nodes {
        for r in &mut node.rate_limits {
            r.own_tag = true;
        }
        own_tags_below(&mut node.children);
    }
}
