//! The second step: resolve every descriptor of a request to its limits on one config snapshot
//! (overrides, `replaces`, resource limits shared by several descriptors) and lay out the
//! checks the store decides together. Pure: no I/O, no clock.

use super::{RequestError, ServiceOptions};
use crate::config::{Counting, DomainRules, Limit, Quota, RuleSet, Unit};
use crate::proto::envoy::r#type::v3::RateLimitUnit;
use crate::proto::{rate_limit_descriptor, RateLimitDescriptor, RateLimitRequest};
use crate::rules;
use crate::store::{CounterKey, LimitCheck};
use std::sync::Arc;

/// What one descriptor resolved to.
#[derive(Debug)]
pub(super) enum Resolution {
    /// No limit applies (unknown domain, no match, or replaced by another limit).
    NoLimit,
    /// Only `unlimited` limits apply.
    Unlimited,
    /// Counted limits apply: indexes into `Plan::checks` and `Plan::limits`.
    Limited(Vec<usize>),
}

/// How a planned check is reported in a status.
#[derive(Debug)]
pub(super) struct Reported {
    pub(super) name: String,
    pub(super) limit: Limit,
    pub(super) shadow: bool,
}

/// What metrics need of one descriptor.
#[derive(Debug)]
pub(super) struct DescriptorInfo {
    /// See [`rules::Matched::stat_key`].
    pub(super) stat_key: String,
    pub(super) hits: u64,
    pub(super) refund: bool,
    /// The matched node's config `metadata` (for `RESPONSE_DYNAMIC_METADATA`).
    pub(super) metadata: Option<Arc<prost_types::Struct>>,
}

#[derive(Debug)]
pub(super) struct Plan {
    pub(super) resolutions: Vec<Resolution>,
    /// Parallel to `resolutions` when the domain is known; empty otherwise.
    pub(super) descriptors: Vec<DescriptorInfo>,
    pub(super) checks: Vec<LimitCheck>,
    /// Parallel to `checks`.
    pub(super) limits: Vec<Reported>,
}

/// The `(key, value)` pairs that key a descriptor's counters.
type CounterEntries = Vec<(String, String)>;

/// What one descriptor matched: its counter entries, candidate limits, stat key and the node's
/// config metadata.
type Matching<'a> = (
    CounterEntries,
    Vec<Candidate<'a>>,
    String,
    Option<Arc<prost_types::Struct>>,
);

/// A limit before `replaces` is applied.
struct Candidate<'a> {
    name: Option<&'a str>,
    replaces: &'a [String],
    quota: Quota,
    shadow: bool,
    quota_mode: bool,
    record_usage: bool,
    overridden: bool,
    /// How many leading counter entries key the counter (all of them, except for a resource
    /// limit above the descriptor's last node).
    depth: usize,
    /// Resource limits are charged once per request however many descriptors pass below them.
    resource: bool,
}

pub(super) fn plan(
    rules: &RuleSet,
    request: &RateLimitRequest,
    options: &ServiceOptions,
) -> Result<Plan, RequestError> {
    let mut plan = Plan {
        resolutions: Vec::with_capacity(request.descriptors.len()),
        descriptors: Vec::with_capacity(request.descriptors.len()),
        checks: Vec::new(),
        limits: Vec::new(),
    };
    let Some(domain) = rules.domains.get(&request.domain) else {
        // Unknown domain: every descriptor is OK with no limit, as envoyproxy/ratelimit answers.
        plan.resolutions
            .extend(request.descriptors.iter().map(|_| Resolution::NoLimit));
        return Ok(plan);
    };
    // The request's hits_addend: 0 (unset) means 1.
    let request_hits = u64::from(request.hits_addend.max(1));

    // Per descriptor: its counter entries and its candidate limits.
    let mut per_descriptor: Vec<Matching<'_>> = Vec::with_capacity(request.descriptors.len());
    for (i, d) in request.descriptors.iter().enumerate() {
        per_descriptor.push(match &d.limit {
            Some(o) => override_matching(domain, i, d, o)?,
            None => config_matching(domain, d),
        });
    }

    // `replaces`: a matched limit named in another matched limit's `replaces` is dropped.
    let replaced: Vec<&str> = per_descriptor
        .iter()
        .flat_map(|(_, cs, _, _)| cs.iter())
        .flat_map(|c| c.replaces.iter().map(String::as_str))
        .collect();

    // Resource limits already planned (a resource shared by several descriptors of one request
    // is checked once): a short list searched in place, no per-request map.
    let mut resource_checks: Vec<usize> = Vec::new();
    for (matching, d) in per_descriptor.into_iter().zip(&request.descriptors) {
        // A u64 from Envoy: beyond MAX_HITS (more than any limit) it saturates, never wraps.
        let hits = d
            .hits_addend
            .unwrap_or(request_hits)
            .min(crate::algorithm::MAX_HITS);
        let resolution = plan.add_descriptor(
            matching,
            &Charge {
                hits,
                refund: d.is_negative_hits,
                domain,
                options,
                replaced: &replaced,
            },
            &mut resource_checks,
        );
        plan.resolutions.push(resolution);
    }
    Ok(plan)
}

/// How one descriptor's checks charge, and what `plan` already knows of the request.
struct Charge<'a> {
    hits: u64,
    refund: bool,
    domain: &'a DomainRules,
    options: &'a ServiceOptions,
    /// Names dropped by some matched limit's `replaces`.
    replaced: &'a [&'a str],
}

/// Envoy's per-descriptor override: it replaces the configured limit (and is never shadow).
fn override_matching<'a>(
    domain: &'a DomainRules,
    i: usize,
    d: &RateLimitDescriptor,
    o: &rate_limit_descriptor::RateLimitOverride,
) -> Result<Matching<'a>, RequestError> {
    let entries: Vec<(String, String)> = d
        .entries
        .iter()
        .map(|e| (e.key.clone(), e.value.clone()))
        .collect();
    let unit = override_unit(o.unit).ok_or_else(|| {
        RequestError::Invalid(format!(
            "descriptors[{i}].limit.unit {} is not a valid rate limit unit",
            o.unit
        ))
    })?;
    let depth = entries.len();
    // The override keeps the stat key of the config node it matches, if any, so its metrics
    // stay as bounded as the config's.
    let stat_key = rules::find_limit(
        domain,
        d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str())),
    )
    .map(|m| m.stat_key)
    .unwrap_or_else(|| {
        d.entries
            .iter()
            .map(|e| e.key.as_str())
            .collect::<Vec<_>>()
            .join(".")
    });
    let candidate = Candidate {
        name: None,
        replaces: &[],
        quota: Quota::Limited(Limit::fixed(o.requests_per_unit, unit)),
        shadow: false,
        quota_mode: false,
        record_usage: false,
        overridden: true,
        depth,
        resource: false,
    };
    Ok((entries, vec![candidate], stat_key, None))
}

/// The config's limits for a descriptor: its node's own, then the resource limits above it.
fn config_matching<'a>(domain: &'a DomainRules, d: &RateLimitDescriptor) -> Matching<'a> {
    let Some(m) = rules::find_limit(
        domain,
        d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str())),
    ) else {
        return (Vec::new(), Vec::new(), String::new(), None);
    };
    let depth = m.counter_entries.len();
    let own = m.node.rate_limits.iter().map(|r| (r, depth, false));
    let above = m.ancestors.iter().map(|&(r, d)| (r, d, true));
    let candidates = own
        .chain(above)
        .map(|(r, depth, resource)| Candidate {
            name: r.name.as_deref(),
            replaces: &r.replaces,
            quota: r.quota,
            shadow: r.shadow_mode,
            quota_mode: r.quota_mode,
            record_usage: r.record_usage,
            overridden: false,
            depth,
            resource,
        })
        .collect();
    (
        m.counter_entries,
        candidates,
        m.stat_key,
        m.node.metadata.clone(),
    )
}

impl Plan {
    /// Adds one descriptor's live limits as checks (a resource limit already planned for an
    /// earlier descriptor is shared, not checked twice) and says how it resolved.
    fn add_descriptor(
        &mut self,
        (mut entries, candidates, stat_key, metadata): Matching<'_>,
        charge: &Charge<'_>,
        resource_checks: &mut Vec<usize>,
    ) -> Resolution {
        self.descriptors.push(DescriptorInfo {
            stat_key,
            hits: charge.hits,
            refund: charge.refund,
            metadata,
        });
        let live: Vec<&Candidate<'_>> = candidates
            .iter()
            .filter(|c| !c.name.is_some_and(|n| charge.replaced.contains(&n)))
            .collect();
        if live.is_empty() {
            return Resolution::NoLimit;
        }
        let mut indexes = Vec::new();
        let envoyproxy =
            charge.domain.counting.unwrap_or(charge.options.counting) == Counting::Envoyproxy;
        // The last limited candidate takes the entries instead of a copy.
        let last = live
            .iter()
            .rposition(|c| matches!(c.quota, Quota::Limited(_)));
        for (n, c) in live.iter().enumerate() {
            let Quota::Limited(limit) = c.quota else {
                continue;
            };
            let depth = c.depth.min(entries.len());
            let key_entries = if Some(n) == last && depth == entries.len() {
                std::mem::take(&mut entries)
            } else {
                entries[..depth].to_vec()
            };
            let key = CounterKey {
                domain: Arc::clone(&charge.domain.name),
                entries: key_entries,
                limit,
                overridden: c.overridden,
                domain_tag: charge.domain.domain_tag,
            };
            if c.resource {
                if let Some(&existing) =
                    resource_checks.iter().find(|&&i| self.checks[i].key == key)
                {
                    indexes.push(existing);
                    continue;
                }
                resource_checks.push(self.checks.len());
            }
            indexes.push(self.checks.len());
            self.limits.push(Reported {
                name: c.name.unwrap_or_default().to_string(),
                limit,
                shadow: c.shadow,
            });
            self.checks.push(LimitCheck {
                key,
                hits: charge.hits,
                refund: charge.refund,
                shadow: c.shadow || charge.options.global_shadow_mode,
                quota: c.quota_mode || charge.options.global_quota_mode,
                record: envoyproxy || c.record_usage,
                stop_over: envoyproxy && charge.options.stop_increment_when_over,
            });
        }
        if indexes.is_empty() {
            Resolution::Unlimited
        } else {
            Resolution::Limited(indexes)
        }
    }
}

/// Maps the override's `envoy.type.v3.RateLimitUnit` (which has no WEEK) to a unit.
fn override_unit(unit: i32) -> Option<Unit> {
    match RateLimitUnit::try_from(unit).ok()? {
        RateLimitUnit::Unknown => None,
        RateLimitUnit::Second => Some(Unit::Second),
        RateLimitUnit::Minute => Some(Unit::Minute),
        RateLimitUnit::Hour => Some(Unit::Hour),
        RateLimitUnit::Day => Some(Unit::Day),
        RateLimitUnit::Month => Some(Unit::Month),
        RateLimitUnit::Year => Some(Unit::Year),
    }
}
