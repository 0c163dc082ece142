//! The second step: resolve every descriptor of a request to its limits on one config snapshot
//! (overrides, `replaces`, resource limits shared by several descriptors) and lay out the
//! checks the store decides together. Pure: no I/O, no clock.

use super::{RequestError, ServiceOptions};
use crate::config::{
    Algorithm, Counting, DomainRules, Limit, Quota, RateLimitRule, Reservations, RuleSet, Unit,
    MAX_LEASE_ID_BYTES,
};
use crate::proto::envoy::r#type::v3::RateLimitUnit;
use crate::proto::{rate_limit_descriptor, RateLimitDescriptor, RateLimitRequest};
use crate::rules;
use crate::store::{CounterKey, LeaseCall, LimitCheck};
use std::sync::Arc;

/// What one descriptor resolved to.
#[derive(Debug)]
pub(super) enum Resolution {
    /// No limit applies (unknown domain, no match, or replaced by another limit).
    NoLimit,
    /// Only `unlimited` limits apply.
    Unlimited,
    /// Counted limits apply: indexes into `Plan::limits`.
    Limited(Vec<usize>),
}

/// One descriptor of the request: how it resolved, and what its metrics and metadata need.
#[derive(Debug)]
pub(super) struct PlannedDescriptor {
    pub(super) resolution: Resolution,
    /// See [`rules::Matched::stat_key`] (empty in an unknown domain).
    pub(super) stat_key: String,
    pub(super) hits: u64,
    pub(super) refund: bool,
    /// The matched node's config `metadata` (for `RESPONSE_DYNAMIC_METADATA`).
    pub(super) metadata: Option<Arc<prost_types::Struct>>,
}

/// One limit of the request: the check the store decides and how a status reports it. Which
/// descriptors it speaks for is in their [`Resolution`]s (a resource limit that several
/// descriptors pass below is planned once and serves them all).
#[derive(Debug)]
pub(super) struct PlannedLimit {
    pub(super) check: LimitCheck,
    /// The limit the response reports: the check's own, or an admin override's.
    pub(super) shown: Limit,
    /// The limit's `name` (empty when unnamed).
    pub(super) name: String,
    /// Its configured `shadow_mode`: a status reports OK for it ([`LimitCheck::shadow`] also
    /// carries the global `SHADOW_MODE`).
    pub(super) shadow: bool,
}

/// A request laid out for the store and the response: one row per descriptor, one per limit.
#[derive(Debug)]
pub(super) struct Plan {
    pub(super) descriptors: Vec<PlannedDescriptor>,
    pub(super) limits: Vec<PlannedLimit>,
}

impl Plan {
    /// What the store decides: every limit's check, in plan order (the outcomes come back in
    /// the same order). A clone shares the counter keys' entries, so it allocates one vector.
    pub(super) fn checks(&self) -> Vec<LimitCheck> {
        self.limits.iter().map(|l| l.check.clone()).collect()
    }

    /// Gives each calendar limit the window containing `now_us` (see `config/calendar.rs`):
    /// the one time a plan meets the clock, its caller's.
    /// `now_us` is read once, and only by a plan that has such a limit.
    pub(super) fn calendar_windows(&mut self, now_us: impl Fn() -> u64) {
        let mut now = None;
        let mut read = || *now.get_or_insert_with(&now_us);
        for l in &mut self.limits {
            let period = l.check.key.limit.period;
            if let Some(c) = period.calendar() {
                l.check.window = c.calendar().window_at(read());
            } else if l.check.slice.is_some()
                && l.check.key.limit.algorithm == Algorithm::FixedWindow
            {
                // A leased window's counter is keyed by its window's start (as a calendar
                // window's is), so a slice granted or given back lands in its own window. (A
                // leased token bucket has no window: its slices are tokens, taken and given
                // back on the one bucket.)
                let p = period.millis().saturating_mul(1000).max(1);
                let now_us = read();
                let start = now_us - now_us % p;
                l.check.window = Some((start, start.saturating_add(p)));
            }
        }
    }
}

/// What one descriptor matched.
struct Matching<'a> {
    /// The `(key, value)` pairs that key its counters.
    entries: Vec<(String, String)>,
    candidates: Vec<Candidate<'a>>,
    /// See [`rules::Matched::stat_key`].
    stat_key: String,
    /// The matched node's config `metadata`.
    metadata: Option<Arc<prost_types::Struct>>,
    /// The trailing entry naming the request on the node's `in_flight` limit.
    lease: Option<rules::LeaseEntry>,
    /// The entries keying the resource limits above, where they differ from `entries` (an
    /// override keys its own counter by the request's values; the resources above it keep
    /// the config's counters, `share_threshold` patterns included).
    resource_entries: Option<Vec<(String, String)>>,
}

/// A descriptor's `(key, value)` pairs as they key counters.
type Entries = Vec<(String, String)>;

/// A limit before `replaces` is applied.
struct Candidate<'a> {
    name: Option<&'a str>,
    replaces: &'a [String],
    quota: Quota,
    shadow: bool,
    quota_mode: bool,
    record_usage: bool,
    /// The limit's `reservations`, if the descriptor has them.
    reservations: Option<Reservations>,
    /// The limit's `leased` terms, if the descriptor has them.
    leased: Option<crate::config::Leasing>,
    overridden: bool,
    /// How many leading counter entries key the counter (all of them, except for a resource
    /// limit above the descriptor's last node).
    depth: usize,
    /// Resource limits are charged once per request however many descriptors pass below them.
    resource: bool,
    /// The limit's own: its counters take hash tags of their own ([`RateLimitRule::own_tag`]).
    own_tag: bool,
}

pub(super) fn plan(
    rules: &RuleSet,
    request: &RateLimitRequest,
    options: &ServiceOptions,
) -> Result<Plan, RequestError> {
    let mut plan = Plan {
        descriptors: Vec::with_capacity(request.descriptors.len()),
        limits: Vec::new(),
    };
    let Some(domain) = rules.domains.get(&request.domain) else {
        // Unknown domain: every descriptor is OK with no limit, as envoyproxy/ratelimit answers.
        plan.descriptors
            .extend(request.descriptors.iter().map(|d| PlannedDescriptor {
                resolution: Resolution::NoLimit,
                stat_key: String::new(),
                hits: 0,
                refund: d.is_negative_hits,
                metadata: None,
            }));
        return Ok(plan);
    };
    // The request's hits_addend: 0 (unset) means 1.
    let request_hits = u64::from(request.hits_addend.max(1));

    // Per descriptor: its counter entries and its candidate limits.
    let mut per_descriptor: Vec<Matching<'_>> = Vec::with_capacity(request.descriptors.len());
    // Whether Envoy's per-descriptor `limit` is honoured: a trust in whoever builds it.
    let overrides = domain
        .allow_limit_override
        .unwrap_or(options.allow_limit_override);
    for (i, d) in request.descriptors.iter().enumerate() {
        let matching = match d.limit.as_ref().filter(|_| overrides) {
            Some(o) => override_matching(domain, i, d, o)?,
            None => config_matching(domain, d),
        };
        if let Some(l) = &matching.lease {
            // Each id is kept with its counter while its slot is held: bounded here.
            if l.id.len() > MAX_LEASE_ID_BYTES {
                return Err(RequestError::Invalid(format!(
                    "descriptors[{i}]: the request id entry is {} bytes; at most \
                     {MAX_LEASE_ID_BYTES} are accepted",
                    l.id.len()
                )));
            }
        }
        per_descriptor.push(matching);
    }

    // `replaces`: a matched limit named in another matched limit's `replaces` is dropped.
    let replaced: Vec<&str> = per_descriptor
        .iter()
        .flat_map(|m| m.candidates.iter())
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
        plan.add_descriptor(
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
    let matched = rules::find_limit(
        domain,
        d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str())),
    );
    // The override keeps the stat key of the config node it matches, if any, so its metrics
    // stay as bounded as the config's.
    let stat_key = matched.as_ref().map_or_else(
        || {
            d.entries
                .iter()
                .map(|e| e.key.as_str())
                .collect::<Vec<_>>()
                .join(".")
        },
        |m| m.stat_key.clone(),
    );
    // On a node with a global limit the override is global too: decided on the home store's
    // counter (a regional counter would be a limit per region, set by the caller).
    let global = matched.as_ref().and_then(|m| {
        m.node
            .rate_limits
            .iter()
            .find_map(|r| r.leased.filter(|t| t.global))
    });
    let own = Candidate {
        name: None,
        replaces: &[],
        quota: Quota::Limited(Limit::fixed(o.requests_per_unit, unit)),
        shadow: false,
        quota_mode: false,
        record_usage: false,
        reservations: None,
        leased: global,
        overridden: true,
        depth,
        resource: false,
        own_tag: false,
    };
    // It replaces the node's own limits, never the resource limits above the node: those are
    // charged for every request below them, overridden or not.
    let mut candidates = vec![own];
    let mut resource_entries = None;
    if let Some(m) = matched {
        candidates.extend(m.ancestors.iter().map(|&(r, depth)| resource(r, depth)));
        resource_entries = Some(m.counter_entries);
    }
    Ok(Matching {
        entries,
        candidates,
        stat_key,
        metadata: None,
        lease: None,
        resource_entries,
    })
}

/// A resource limit (`applies_to_descendants`) above a descriptor's node, keyed by the first
/// `depth` counter entries.
fn resource(r: &RateLimitRule, depth: usize) -> Candidate<'_> {
    Candidate {
        name: r.name.as_deref(),
        replaces: &r.replaces,
        quota: r.quota,
        shadow: r.shadow_mode,
        quota_mode: r.quota_mode,
        record_usage: r.record_usage,
        reservations: r.reservations,
        leased: r.leased,
        overridden: false,
        depth,
        resource: true,
        own_tag: r.own_tag,
    }
}

/// The config's limits for a descriptor: its node's own, then the resource limits above it.
fn config_matching<'a>(domain: &'a DomainRules, d: &RateLimitDescriptor) -> Matching<'a> {
    let Some(m) = rules::find_limit(
        domain,
        d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str())),
    ) else {
        return Matching {
            entries: Vec::new(),
            candidates: Vec::new(),
            stat_key: String::new(),
            metadata: None,
            lease: None,
            resource_entries: None,
        };
    };
    let depth = m.counter_entries.len();
    let own = m.node.rate_limits.iter().map(|r| Candidate {
        resource: false,
        depth,
        ..resource(r, depth)
    });
    let above = m.ancestors.iter().map(|&(r, depth)| resource(r, depth));
    Matching {
        entries: m.counter_entries,
        candidates: own.chain(above).collect(),
        stat_key: m.stat_key,
        metadata: m.node.metadata.clone(),
        lease: m.lease,
        resource_entries: None,
    }
}

impl Plan {
    /// Adds one descriptor's row and its live limits (a resource limit already planned for an
    /// earlier descriptor is shared, not checked twice).
    fn add_descriptor(
        &mut self,
        matching: Matching<'_>,
        charge: &Charge<'_>,
        resource_checks: &mut Vec<usize>,
    ) {
        let Matching {
            entries,
            candidates,
            stat_key,
            metadata,
            lease,
            resource_entries,
        } = matching;
        let lease = lease.map(|l| LeaseCall {
            id: Arc::from(l.id),
            release: l.release,
            reservations: None,
        });
        let resolution = self.add_limits(
            (entries, resource_entries),
            &candidates,
            charge,
            lease.as_ref(),
            resource_checks,
        );
        self.descriptors.push(PlannedDescriptor {
            resolution,
            stat_key,
            hits: charge.hits,
            refund: charge.refund,
            metadata,
        });
    }

    /// `entries`: the descriptor's counter entries, and the resource limits' where they differ.
    fn add_limits(
        &mut self,
        entries: (Entries, Option<Entries>),
        candidates: &[Candidate<'_>],
        charge: &Charge<'_>,
        lease: Option<&LeaseCall>,
        resource_checks: &mut Vec<usize>,
    ) -> Resolution {
        let live: Vec<&Candidate<'_>> = candidates
            .iter()
            .filter(|c| !c.name.is_some_and(|n| charge.replaced.contains(&n)))
            .collect();
        if live.is_empty() {
            return Resolution::NoLimit;
        }
        let envoyproxy =
            charge.domain.counting.unwrap_or(charge.options.counting) == Counting::Envoyproxy;
        // The counters keyed by all of the descriptor's entries share one list (the entries
        // moved in, not copied); a resource limit above the last node takes a copy of a prefix.
        let full: Arc<[(String, String)]> = Arc::from(entries.0);
        let above: Option<Arc<[(String, String)]>> = entries.1.map(Arc::from);
        let mut indexes = Vec::new();
        for c in live {
            let Quota::Limited(limit) = c.quota else {
                continue;
            };
            let in_flight = limit.algorithm == Algorithm::InFlight;
            let reserving = lease.filter(|_| c.reservations.is_some());
            // A stream-done call frees its slot and settles its reservations; it charges none
            // of the descriptor's other rates.
            if lease.is_some_and(|l| l.release) && !in_flight && reserving.is_none() {
                continue;
            }
            let full = match &above {
                Some(above) if c.resource => above,
                _ => &full,
            };
            let depth = c.depth.min(full.len());
            let key_entries = if depth == full.len() {
                Arc::clone(full)
            } else {
                Arc::from(&full[..depth])
            };
            let key = counter_key(charge, c, (key_entries, limit));
            let check = check_for(c, key, charge, lease, envoyproxy);
            if c.resource {
                if let Some(&existing) = resource_checks
                    .iter()
                    .find(|&&i| shares(&self.limits[i].check, &check))
                {
                    // Charged once, at the most any descriptor below it asks: a caller's
                    // first descriptor of 0 hits must not make the rest free.
                    let shared = &mut self.limits[existing].check;
                    shared.hits = shared.hits.max(check.hits);
                    indexes.push(existing);
                    continue;
                }
                resource_checks.push(self.limits.len());
            }
            indexes.push(self.limits.len());
            self.limits.push(PlannedLimit {
                shown: check.key.limit,
                check,
                name: c.name.unwrap_or_default().to_string(),
                shadow: c.shadow,
            });
        }
        if indexes.is_empty() {
            Resolution::Unlimited
        } else {
            Resolution::Limited(indexes)
        }
    }
}

/// The counter of limit `c` keyed by `entries`: its identity is the limit's and the entries',
/// never the shape of the request that reached it (the hash tag is the limit's own, fixed at
/// load).
fn counter_key(
    charge: &Charge<'_>,
    c: &Candidate<'_>,
    (entries, limit): (Arc<[(String, String)]>, crate::config::Limit),
) -> CounterKey {
    CounterKey {
        domain: Arc::clone(&charge.domain.name),
        entries,
        limit,
        overridden: c.overridden,
        domain_tag: charge.domain.domain_tag,
        own_tag: c.own_tag && !charge.domain.domain_tag,
        candidate: false,
    }
}

/// The check one configured limit makes for one descriptor: an `in_flight` slot, a reservation
/// or its settle, or a rate's charge, with the flags its domain and the options give it.
/// Whether a resource limit's `check`, met again below another descriptor of the request, is
/// the one `planned` already (charged once per request): the same counter, charged the same
/// way, hits aside. A refund, or another lease call, is a check of its own.
fn shares(planned: &LimitCheck, check: &LimitCheck) -> bool {
    planned.key == check.key
        && planned.refund == check.refund
        && planned.lease == check.lease
        && planned.record == check.record
        && planned.quota == check.quota
        && planned.shadow == check.shadow
}

fn check_for(
    c: &Candidate<'_>,
    key: CounterKey,
    charge: &Charge<'_>,
    lease: Option<&LeaseCall>,
    envoyproxy: bool,
) -> LimitCheck {
    let in_flight = key.limit.algorithm == Algorithm::InFlight;
    let reserving = lease.filter(|_| c.reservations.is_some());
    if in_flight {
        // A slot, whatever the hits: taken or freed once per request id; without an id,
        // a check. A take is all or nothing in every counting (a slot is never taken
        // past `max`); a free is applied whatever the verdict.
        let release = lease.is_some_and(|l| l.release);
        LimitCheck {
            key,
            hits: u64::from(lease.is_some()),
            refund: false,
            shadow: c.shadow || charge.options.global_shadow_mode,
            quota: !release && (c.quota_mode || charge.options.global_quota_mode),
            record: release,
            stop_over: false,
            admin_limit: None,
            window: None,
            lease: lease.cloned(),
            leased: true,
            slice: None,
            candidate: false,
        }
    } else if let Some(l) = reserving {
        // A reservation: the request-time call charges its hits (the estimate) all or
        // nothing in every counting; the stream-done call settles at its hits (the
        // actual), whatever the verdict and never denied.
        // The estimate is the caller's: never under the limit's `min_estimate`.
        let floor = c.reservations.map_or(0, |r| u64::from(r.min_estimate));
        LimitCheck {
            key,
            hits: if l.release {
                charge.hits
            } else {
                charge.hits.max(floor)
            },
            refund: false,
            shadow: c.shadow || charge.options.global_shadow_mode,
            quota: !l.release && (c.quota_mode || charge.options.global_quota_mode),
            record: l.release,
            stop_over: false,
            admin_limit: None,
            window: None,
            lease: Some(LeaseCall {
                reservations: c.reservations,
                ..l.clone()
            }),
            leased: true,
            slice: None,
            candidate: false,
        }
    } else {
        LimitCheck {
            key,
            hits: charge.hits,
            refund: charge.refund,
            shadow: c.shadow || charge.options.global_shadow_mode,
            quota: c.quota_mode || charge.options.global_quota_mode,
            record: envoyproxy || c.record_usage,
            stop_over: envoyproxy && charge.options.stop_increment_when_over,
            admin_limit: None,
            window: None,
            lease: None,
            leased: c.reservations.is_some(),
            slice: c.leased,
            candidate: false,
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
