//! How a quota bucket names a limit. A `BucketId` is a map (no order) and the config tree has
//! levels, so the bucket's pairs are ordered by walking the domain's tree: at each level, the
//! pair that matches a node there (exact value, then wildcard, then bare key, as for a request)
//! comes next; when several pairs match nodes of one level, the one with the smallest key goes
//! first. The walk must use every pair. The ordered pairs are then an RLS descriptor: a bucket
//! `{consumer: alice, resource: api}` under a `resource` -> `consumer` tree is the descriptor
//! `resource=api, consumer=alice`, the SAME limits and the SAME counters as an RLS request with
//! that descriptor, so a fleet mixing RLS and RLQS Envoys shares one budget.

use crate::config::DomainRules;
use crate::rules::find_in_level;
use crate::service::RequestCaps;
use std::collections::HashMap;

/// Why a bucket id is not served (it gets ALLOW_ALL; the reason is counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// No pairs, or a pair with an empty key or value.
    Empty,
    /// More pairs, or longer keys or values, than the request caps allow.
    TooLarge,
}

impl Refused {
    pub fn label(self) -> &'static str {
        match self {
            Refused::Empty => "empty",
            Refused::TooLarge => "too_large",
        }
    }
}

/// Checks a bucket id against the request caps (the same bounds an RLS descriptor has).
pub fn check(bucket: &HashMap<String, String>, caps: &RequestCaps) -> Result<(), Refused> {
    if bucket.is_empty() || bucket.iter().any(|(k, v)| k.is_empty() || v.is_empty()) {
        return Err(Refused::Empty);
    }
    let too_long = bucket
        .iter()
        .any(|(k, v)| k.len() > caps.key_bytes as usize || v.len() > caps.value_bytes as usize);
    if bucket.len() > caps.entries as usize || too_long {
        return Err(Refused::TooLarge);
    }
    Ok(())
}

/// The descriptor a bucket (its pairs, in any order) stands for in `domain`, or `None` when its
/// pairs do not form a path of the domain's tree.
pub fn descriptor_of(
    domain: &DomainRules,
    bucket: &[(String, String)],
) -> Option<Vec<(String, String)>> {
    let mut left: Vec<(&String, &String)> = bucket.iter().map(|(k, v)| (k, v)).collect();
    left.sort();
    let mut ordered = Vec::with_capacity(left.len());
    let mut level = &domain.root;
    while !left.is_empty() {
        let (i, node) = left
            .iter()
            .enumerate()
            .find_map(|(i, (k, v))| find_in_level(level, k, v).map(|n| (i, n)))?;
        let (k, v) = left.remove(i);
        ordered.push((k.clone(), v.clone()));
        level = &node.children;
    }
    Some(ordered)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn domain(yaml: &str) -> DomainRules {
        let rules = crate::config::load_sources(&[("q.yaml".into(), yaml.into())])
            .unwrap_or_else(|e| panic!("{e}"));
        rules.domains.values().next().expect("one domain").clone()
    }

    fn bucket(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn pairs(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const TREE: &str = "domain: q\ndescriptors:\n  - key: resource\n    value: api\n    descriptors:\n      - key: consumer\n        rate_limit: {unit: minute, requests_per_unit: 10}\n  - key: x-api-key\n    rate_limit: {unit: minute, requests_per_unit: 600}\n";

    #[test]
    fn pairs_are_ordered_by_the_tree_whatever_the_map_order() {
        let d = domain(TREE);
        let got = descriptor_of(&d, &pairs(&[("consumer", "alice"), ("resource", "api")]));
        assert_eq!(
            got,
            Some(vec![
                ("resource".into(), "api".into()),
                ("consumer".into(), "alice".into())
            ])
        );
        assert_eq!(
            descriptor_of(&d, &pairs(&[("x-api-key", "k1")])),
            Some(vec![("x-api-key".into(), "k1".into())])
        );
    }

    #[test]
    fn a_bucket_that_is_no_path_of_the_tree_names_nothing() {
        let d = domain(TREE);
        assert_eq!(descriptor_of(&d, &pairs(&[("other", "x")])), None);
        assert_eq!(
            descriptor_of(&d, &pairs(&[("x-api-key", "k1"), ("extra", "y")])),
            None
        );
        assert_eq!(descriptor_of(&d, &pairs(&[("resource", "web")])), None);
    }

    #[test]
    fn bucket_ids_are_bounded_like_descriptors() {
        let caps = RequestCaps::default();
        assert_eq!(check(&bucket(&[]), &caps), Err(Refused::Empty));
        assert_eq!(check(&bucket(&[("k", "")]), &caps), Err(Refused::Empty));
        let long = "v".repeat(caps.value_bytes as usize + 1);
        assert_eq!(
            check(&bucket(&[("k", &long)]), &caps),
            Err(Refused::TooLarge)
        );
        assert_eq!(check(&bucket(&[("k", "v")]), &caps), Ok(()));
    }
}
