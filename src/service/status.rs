//! What `GET /config/status` reports: when the rules in force were loaded and how the last
//! reload went. Kept apart from the decision: only reloads and the admin endpoint touch it.

use crate::config::RuleSet;

/// The state of the config for operators (`GET /config/status`): when the rules in force were
/// loaded, and how the last reload went.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ConfigStatus {
    /// Unix seconds the rules in force were loaded.
    pub loaded_at: u64,
    /// Domains in the rules in force.
    pub domains: Vec<String>,
    /// Reloads that took effect, and that failed, since start.
    pub reloads_ok: u64,
    pub reloads_failed: u64,
    /// The last reload attempt, if any.
    pub last_reload: Option<ReloadOutcome>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct ReloadOutcome {
    /// Unix seconds of the attempt.
    pub at: u64,
    pub ok: bool,
    /// Every error of a failed reload (file:line: path: message, one per line).
    pub error: Option<String>,
}

pub(super) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub(super) fn describe_rules(rules: &RuleSet) -> (u64, Vec<String>) {
    let at = rules
        .loaded_at
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut domains: Vec<String> = rules.domains.keys().cloned().collect();
    domains.sort();
    (at, domains)
}
