//! Descriptor matching: which configured limit, if any, applies to one request descriptor. This
//! is envoyproxy/ratelimit's reference walk, kept exactly: per level exact key+value, then
//! wildcards in file order, then the bare key; only the node of the LAST entry supplies a limit;
//! no backtracking. It also decides which values name the counter (`share_threshold`) and
//! collects the resource limits (`applies_to_descendants`) of the nodes passed on the way.

use crate::config::{DescriptorNode, DomainRules, Level, RateLimitRule, ValueMatch};

/// Where a descriptor landed in the rule tree.
#[derive(Debug, Clone)]
pub struct Matched<'a> {
    /// The node of the descriptor's last entry; its `rate_limits` apply to the descriptor.
    pub node: &'a DescriptorNode,
    /// The `(key, value)` pairs that identify the counters: the request's values, except that
    /// a wildcard node with `share_threshold` contributes its pattern, so all values it matches
    /// share one counter.
    pub counter_entries: Vec<(String, String)>,
    /// Resource limits above the last node (`applies_to_descendants`), each with the number of
    /// leading `counter_entries` that key its counter (the path down to its node).
    pub ancestors: Vec<(&'a RateLimitRule, usize)>,
    /// The descriptor's key in metrics, as envoyproxy/ratelimit names its stats: one
    /// `key` or `key_value` segment per level, joined by `.`. A segment carries the config's
    /// value (bounded by the config), the request's value only where the node says
    /// `value_to_metric`, and every level carries the request's value when the last node says
    /// `detailed_metric`.
    pub stat_key: String,
    /// The trailing entry that names the request on the node's `in_flight` limit, if the
    /// descriptor has one.
    pub lease: Option<LeaseEntry>,
}

/// A descriptor's trailing request entry on a lease node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseEntry {
    /// The entry was the node's `done_key` (the stream-done call), not its `id_key`.
    pub release: bool,
    /// The request id: the entry's value.
    pub id: String,
}

/// Finds the node for one level: exact, then the first wildcard (file order), then the bare key.
pub fn find_in_level<'a>(level: &'a Level, key: &str, value: &str) -> Option<&'a DescriptorNode> {
    if let Some(n) = level.exact.get(key).and_then(|m| m.get(value)) {
        return Some(n);
    }
    if let Some(n) = level.wildcards.iter().find(|n| {
        n.key == key && matches!(&n.value, ValueMatch::Wildcard(p) if glob_match(p, value))
    }) {
        return Some(n);
    }
    level.bare.get(key)
}

/// Resolves a descriptor (its `(key, value)` entries, in order) against a domain's rules:
/// `None` when the walk does not reach a node for the last entry.
pub fn find_limit<'a, 'e, I>(domain: &'a DomainRules, entries: I) -> Option<Matched<'a>>
where
    I: IntoIterator<Item = (&'e str, &'e str)>,
    I::IntoIter: ExactSizeIterator,
{
    let entries = entries.into_iter();
    let last = entries.len().checked_sub(1)?;
    let mut level = &domain.root;
    let mut counter_entries = Vec::with_capacity(last + 1);
    let mut ancestors = Vec::new();
    let mut segments: Vec<(&'a DescriptorNode, &'e str)> = Vec::with_capacity(last + 1);
    let mut entries = entries.enumerate().peekable();
    while let Some((i, (key, value))) = entries.next() {
        let node = find_in_level(level, key, value)?;
        segments.push((node, value));
        let counted_value = match &node.value {
            ValueMatch::Wildcard(pattern) if node.share_threshold => pattern.clone(),
            _ => value.to_string(),
        };
        counter_entries.push((key.to_string(), counted_value));
        // A lease node's descriptor ends in one more entry naming the request (`in_flight`'s
        // `id_key` or `done_key`): it is this node's, and that entry keys no counter.
        let lease = match (i + 1 == last, &node.lease_keys, entries.peek()) {
            (true, Some(keys), Some(&(_, (k, id)))) if k == keys.id_key || k == keys.done_key => {
                Some(LeaseEntry {
                    release: k == keys.done_key,
                    id: id.to_string(),
                })
            }
            _ => None,
        };
        if i == last || lease.is_some() {
            return Some(Matched {
                node,
                counter_entries,
                ancestors,
                stat_key: stat_key(&segments, node.detailed_metric),
                lease,
            });
        }
        // A request deeper than the config matches nothing.
        if node.children.is_empty() {
            return None;
        }
        ancestors.extend(
            node.rate_limits
                .iter()
                .filter(|r| r.applies_to_descendants)
                .map(|r| (r, i + 1)),
        );
        level = &node.children;
    }
    None
}

/// See [`Matched::stat_key`].
fn stat_key(segments: &[(&DescriptorNode, &str)], detailed: bool) -> String {
    let mut out = String::new();
    for (i, (node, value)) in segments.iter().enumerate() {
        if i > 0 {
            out.push('.');
        }
        out.push_str(&node.key);
        let shown = if detailed || node.value_to_metric {
            Some(*value)
        } else {
            match &node.value {
                ValueMatch::Exact(v) | ValueMatch::Wildcard(v) => Some(v.as_str()),
                ValueMatch::Any => None,
            }
        };
        if let Some(v) = shown.filter(|v| !v.is_empty()) {
            out.push('_');
            out.push_str(v);
        }
    }
    out
}

/// `*` matches any run of characters (including none), anywhere and any number of times; every
/// other character matches itself.
pub fn glob_match(pattern: &str, value: &str) -> bool {
    let p = pattern.as_bytes();
    let v = value.as_bytes();
    let (mut pi, mut vi) = (0, 0);
    // Position of the last `*` seen and the value position it currently absorbs up to.
    let mut star: Option<(usize, usize)> = None;
    while vi < v.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, vi));
            pi += 1;
        } else if pi < p.len() && p[pi] == v[vi] {
            pi += 1;
            vi += 1;
        } else if let Some((sp, sv)) = star {
            // Let the last `*` absorb one more character and retry from there.
            pi = sp + 1;
            vi = sv + 1;
            star = Some((sp, sv + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::glob_match;

    #[test]
    fn glob_cases() {
        for (p, v, want) in [
            ("foo*", "foo", true),
            ("foo*", "foobar", true),
            ("foo*", "fo", false),
            ("*bar", "foobar", true),
            ("*bar", "foobaz", false),
            ("f*r", "foobar", true),
            ("f*r", "foobaz", false),
            ("/api/*/users/*", "/api/v1/users/42", true),
            ("/api/*/users/*", "/api/v1/groups/42", false),
            ("a*b*c", "abc", true),
            ("a*b*c", "aXbYbZc", true),
            ("a*b*c", "aXbYcZ", false),
            ("*", "", true),
            ("**", "x", true),
            ("exact", "exact", true),
            ("exact", "exacT", false),
            ("ü*", "über", true),
        ] {
            assert_eq!(glob_match(p, v), want, "pattern {p:?} value {v:?}");
        }
    }
}
