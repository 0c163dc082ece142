//! Load-time warnings (counting, Redis key layout): what loads and is exact, but may not be what an
//! operator meant. Kept apart from the model (`mod.rs`) and the loader (`load/`): a warning never
//! changes a decision.

use super::{Counting, DomainRules, Level, RuleSet};

impl RuleSet {
    /// Where a resource limit (`applies_to_descendants`) runs under envoyproxy counting
    /// (`global` for a domain without `counting:`): every request below it is recorded there,
    /// denied ones too, so one consumer over its own limit still burns the resource's budget.
    pub fn counting_warnings(&self, global: Counting) -> Vec<String> {
        fn walk(level: &Level, file: &str, out: &mut Vec<String>) {
            for n in level.nodes() {
                if n.rate_limits.iter().any(|r| r.applies_to_descendants) {
                    out.push(format!(
                        "{file}:{}: {}: applies_to_descendants under envoyproxy counting: \
                         requests denied below this node are still charged to it (a consumer \
                         over its own limit burns the resource's budget); set \
                         `counting: all_or_nothing` on the domain to charge only admitted requests",
                        n.location.line, n.path
                    ));
                }
                walk(&n.children, file, out);
            }
        }
        let mut out = Vec::new();
        let mut domains: Vec<&DomainRules> = self.domains.values().collect();
        domains.sort_by(|a, b| a.domain.cmp(&b.domain));
        for d in domains {
            if d.counting.unwrap_or(global) == Counting::Envoyproxy {
                walk(&d.root, &d.file, &mut out);
            }
        }
        out
    }

    /// Where a leased resource has limits below it that share its hash tag: on a Redis Cluster
    /// they stay on the resource's slot (one master decides every consumer of it). Their own
    /// hash tags are a key-layout choice (`own_hash_tags: true` on the node), never implied by
    /// `leased:`, which changes no counter (issue 50): an upgrade from a release that implied it
    /// re-keys them once, and this says so.
    pub fn layout_warnings(&self) -> Vec<String> {
        fn below_share_the_tag(level: &Level) -> bool {
            level.nodes().any(|n| {
                n.rate_limits.iter().any(|r| !r.own_tag) || below_share_the_tag(&n.children)
            })
        }
        fn walk(level: &Level, file: &str, out: &mut Vec<String>) {
            for n in level.nodes() {
                let leased = n.rate_limits.iter().any(|r| r.leased.is_some());
                if leased && below_share_the_tag(&n.children) {
                    out.push(format!(
                        "{file}:{}: {}: a leased resource whose limits below share its Redis hash \
                         tag: on a Cluster one master decides all of them; add \
                         `own_hash_tags: true` to this node to spread them over the masters (it \
                         starts their counters afresh once)",
                        n.location.line, n.path
                    ));
                }
                walk(&n.children, file, out);
            }
        }
        let mut out = Vec::new();
        let mut domains: Vec<&DomainRules> = self.domains.values().collect();
        domains.sort_by(|a, b| a.domain.cmp(&b.domain));
        for d in domains.into_iter().filter(|d| !d.domain_tag) {
            walk(&d.root, &d.file, &mut out);
        }
        out
    }
}
