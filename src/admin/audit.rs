//! The audit trail of admin writes: one structured log line per write (target `sluice::audit`:
//! who, what, on which counters, before, after, why, and how it went) and the
//! `sluice_admin_writes_total` series. Written whether the write succeeded or not.

use crate::telemetry::admin_metrics::AdminMetrics;

/// One admin write, as audited.
#[derive(Debug)]
pub struct Write<'a> {
    pub caller: &'a str,
    /// reset, set_override, delete_override.
    pub operation: &'static str,
    pub domain: &'a str,
    /// The entries, as `k=v, k=v`.
    pub target: String,
    pub before: String,
    pub after: String,
    pub reason: &'a str,
}

impl Write<'_> {
    /// Logs the line and counts the write; `result` is what the caller was answered.
    pub fn record(&self, metrics: &AdminMetrics, result: Result<(), &str>) {
        let outcome = if result.is_ok() { "ok" } else { "error" };
        metrics
            .writes
            .with_label_values(&[self.operation, self.caller, outcome])
            .inc();
        tracing::info!(
            target: "sluice::audit",
            caller = self.caller,
            operation = self.operation,
            domain = self.domain,
            target_entries = %self.target,
            before = %self.before,
            after = %self.after,
            reason = self.reason,
            result = outcome,
            error = result.err().unwrap_or_default(),
            "admin write"
        );
    }
}

/// Entries as the audit line and the CLI write them.
pub fn entries_text(entries: &[(String, String)]) -> String {
    entries
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ")
}
