//! The bucket caps, and how they are shared (issue 38, review A1). A bucket no limit names is
//! never tracked (ALLOW_ALL either way), so values the config does not limit fill no cap. A
//! limited bucket past a cap is denied until its next report, never ALLOW_ALL: a cap must not
//! fail open, and its usage could not be charged.
//!
//! Under `RLQS_MAX_BUCKETS` any stream takes what it reports. At the cap the room is shared:
//! each domain with streams gets an equal part of the cap, and each of its streams an equal part
//! of that (its fair share). A stream under its fair share still gets a new bucket (up to twice
//! the cap in all, the memory bound), and while the process is over the cap every stream over
//! its fair share sheds down to it at its next report, its least used buckets first. So one
//! peer holding junk (or its end clients sending distinct keys) can keep no other stream out,
//! and what it loses is its own excess.

use super::{abandon_action, assign, blanket, bucket_id, Pairs, QuotaStream, ALLOW_TTL};
use super::{BlanketRule, BucketAction, Slot, ASSIGNMENT_TTL};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// Streams and buckets per domain, for the fair shares.
#[derive(Debug, Default)]
pub struct Census {
    domains: Mutex<HashMap<String, Count>>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Count {
    streams: usize,
    buckets: usize,
}

impl Census {
    fn with<R>(&self, f: impl FnOnce(&mut HashMap<String, Count>) -> R) -> R {
        f(&mut self.domains.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A stream of `domain` (its first report).
    pub fn join(&self, domain: &str) {
        self.with(|d| d.entry(domain.to_string()).or_default().streams += 1);
    }

    /// A stream of `domain` holding `buckets` ended.
    pub fn leave(&self, domain: &str, buckets: usize) {
        self.with(|d| {
            if let Some(c) = d.get_mut(domain) {
                c.streams = c.streams.saturating_sub(1);
                c.buckets = c.buckets.saturating_sub(buckets);
                if c.streams == 0 {
                    d.remove(domain);
                }
            }
        });
    }

    /// A bucket of `domain` tracked (`true`) or dropped.
    pub fn count(&self, domain: &str, tracked: bool) {
        self.with(|d| {
            if let Some(c) = d.get_mut(domain) {
                c.buckets = if tracked {
                    c.buckets + 1
                } else {
                    c.buckets.saturating_sub(1)
                };
            }
        });
    }

    /// One stream of `domain`'s fair share of `cap`: the cap split evenly among the domains
    /// with streams, the domain's part among its streams.
    pub fn fair_share(&self, domain: &str, cap: usize) -> usize {
        self.with(|d| {
            let domains = d.len().max(1);
            let streams = d.get(domain).map_or(1, |c| c.streams.max(1));
            cap / domains / streams
        })
    }
}

impl QuotaStream {
    /// This stream's fair share of `RLQS_MAX_BUCKETS`.
    fn fair_share(&self) -> usize {
        let cap = self.shared.settings.max_buckets;
        match &self.domain {
            Some(d) => self.shared.census.fair_share(d, cap),
            None => cap,
        }
    }

    /// The answer to a new bucket that is not tracked, or `None` to track it. Either, once
    /// idle, is abandoned, so Envoy's reports shrink back (an abandon while in use would bring
    /// it straight back).
    pub(super) fn untracked(&mut self, pairs: &Pairs, used: u64) -> Option<BucketAction> {
        let id = || bucket_id(pairs);
        if self.resolve(pairs).is_none() {
            return Some(if used == 0 {
                abandon_action(id())
            } else {
                assign(id(), blanket(BlanketRule::AllowAll), ALLOW_TTL)
            });
        }
        let reason = self.over_cap()?;
        self.refuse(reason);
        Some(if used == 0 {
            abandon_action(id())
        } else {
            assign(id(), blanket(BlanketRule::DenyAll), ASSIGNMENT_TTL)
        })
    }

    /// Why a new bucket cannot be tracked, if it cannot; else it is counted in.
    fn over_cap(&self) -> Option<&'static str> {
        let s = &self.shared.settings;
        if self.buckets.len() >= s.max_buckets_per_stream {
            return Some("over_bucket_cap");
        }
        let before = self.shared.buckets.fetch_add(1, Ordering::AcqRel);
        let at_cap = before >= s.max_buckets;
        if at_cap && (self.buckets.len() >= self.fair_share() || before / 2 >= s.max_buckets) {
            self.shared.buckets.fetch_sub(1, Ordering::AcqRel);
            return Some("over_total_bucket_cap");
        }
        None
    }

    /// The buckets this stream gives up now: while the process is over `RLQS_MAX_BUCKETS`, those
    /// past its fair share, the least used first (lowest demand, then never measured).
    pub(super) fn to_shed(&self) -> HashSet<Pairs> {
        if self.shared.buckets.load(Ordering::Acquire) <= self.shared.settings.max_buckets {
            return HashSet::new();
        }
        let excess = self.buckets.len().saturating_sub(self.fair_share());
        if excess == 0 {
            return HashSet::new();
        }
        let mut by_use: Vec<(&Pairs, f64)> = self
            .buckets
            .iter()
            .map(|(p, b)| (p, b.demand.unwrap_or(0.0)))
            .collect();
        by_use.sort_by(|a, b| a.1.total_cmp(&b.1));
        by_use
            .into_iter()
            .take(excess)
            .map(|(p, _)| Arc::clone(p))
            .collect()
    }

    /// The shed buckets a report did not name, abandoned.
    pub(super) fn shed_unreported(
        &mut self,
        shed: &HashSet<Pairs>,
        seen: &HashSet<Pairs>,
    ) -> Vec<Slot> {
        shed.iter()
            .filter(|p| !seen.contains(*p) && self.buckets.contains_key(*p))
            .cloned()
            .collect::<Vec<_>>()
            .into_iter()
            .map(|p| {
                self.refuse("over_fair_share");
                self.abandon(&p, 0)
            })
            .collect()
    }
}
