//! A stream follows the rules in force: its domain's label on the gauges, and each bucket's
//! descriptor, are resolved again when a reload, an xDS push or the first config changes them.

use super::{Pairs, QuotaStream};
use crate::quota::bucket;
use std::sync::Arc;

impl QuotaStream {
    /// Re-resolves the stream's label and its buckets' descriptors when the rules in force
    /// changed since it last looked (a reload, an xDS push, the first config).
    pub(super) fn follow_rules(&mut self) {
        let rules = self.limiter.rules();
        if self.rules.as_ref().is_some_and(|r| Arc::ptr_eq(r, &rules)) {
            return;
        }
        self.rules = Some(Arc::clone(&rules));
        let Some(domain) = self.domain.clone() else {
            return;
        };
        let label = if rules.domains.contains_key(&domain) {
            domain
        } else {
            "unknown".to_string()
        };
        if self.label.as_deref() != Some(label.as_str()) {
            let m = self.metrics().clone();
            let held = i64::try_from(self.buckets.len()).unwrap_or(i64::MAX);
            let rate: f64 = self.buckets.values().map(|b| b.rate).sum();
            if let Some(old) = &self.label {
                m.streams.with_label_values(&[old]).dec();
                m.buckets.with_label_values(&[old]).sub(held);
                m.assigned_rate.with_label_values(&[old]).sub(rate);
            }
            m.streams.with_label_values(&[&label]).inc();
            m.buckets.with_label_values(&[&label]).add(held);
            m.assigned_rate.with_label_values(&[&label]).add(rate);
            self.label = Some(label);
        }
        let all: Vec<Pairs> = self.buckets.keys().cloned().collect();
        for pairs in all {
            let descriptor = self.resolve(&pairs);
            if let Some(b) = self.buckets.get_mut(&pairs) {
                b.descriptor = descriptor;
            }
        }
    }

    /// The descriptor `pairs` stand for under the rules in force, sharing `pairs` when equal.
    pub(super) fn resolve(&self, pairs: &Pairs) -> Option<Pairs> {
        self.descriptor_of(pairs).map(|d| {
            if *d == **pairs {
                Arc::clone(pairs)
            } else {
                Arc::from(d)
            }
        })
    }

    fn descriptor_of(&self, pairs: &[(String, String)]) -> Option<Vec<(String, String)>> {
        let rules = self.limiter.rules();
        let domain = rules.domains.get(self.domain.as_deref()?)?;
        bucket::descriptor_of(domain, pairs)
    }
}
