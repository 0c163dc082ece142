//! The audit trail of admin writes, target `sluice::audit`: two structured log lines per write,
//! `admin write attempt` before the store is called (who, what, on which counters, to what,
//! why) and `admin write` after it (the same, what was there before, and how it went), paired
//! by `write_id`; and the `sluice_admin_writes_total` series, counted with the outcome.
//!
//! Why two lines: the attempt is on record before anything can change, so a write whose outcome
//! never came (the process died mid-call) still names who tried what. Why the service runs the
//! store call and the outcome line on a task of its own (`service.rs`): a caller that goes away
//! must not cut a write between the store and its record.
//!
//! Why [`always_on`]: an audit trail that `LOG_LEVEL=warn` (envoyproxy's default) silences is no
//! audit trail, so the target is enabled at INFO whatever `LOG_LEVEL` and `RUST_LOG` say.
//!
//! Why every caller-controlled field is recorded as a `&str` (never `%` Display): the text
//! format writes a `&str` field Debug-escaped and quoted, the JSON format as a JSON string, so
//! a newline or a quote in an entry value, a limit name or a reason stays inside its field and
//! cannot forge a line (`%` fields are written raw).

use crate::telemetry::admin_metrics::AdminMetrics;
use std::sync::atomic::{AtomicU64, Ordering};
use tracing_subscriber::filter::{Directive, EnvFilter};

/// The log target of the audit lines.
pub const TARGET: &str = "sluice::audit";

/// The directive that enables [`TARGET`] at INFO.
const DIRECTIVE: &str = "sluice::audit=info";

/// `filter` with the audit target enabled at INFO, added last so it wins over whatever level
/// or `RUST_LOG` directive the operator set (a directive for the same target is replaced).
pub fn always_on(filter: EnvFilter) -> EnvFilter {
    match DIRECTIVE.parse::<Directive>() {
        Ok(d) => filter.add_directive(d),
        // A constant that parses (a unit test says so): never taken.
        Err(_) => filter,
    }
}

/// Numbers the writes of this process, so an attempt line and its outcome line pair up.
static NEXT_WRITE: AtomicU64 = AtomicU64::new(1);

/// One admin write, as audited.
#[derive(Debug, Clone)]
pub struct Write {
    /// Pairs the attempt line with the outcome line.
    pub id: u64,
    pub caller: String,
    /// reset, set_override, delete_override.
    pub operation: &'static str,
    pub domain: String,
    /// The entries, as `k=v, k=v`.
    pub target: String,
    pub before: String,
    pub after: String,
    pub reason: String,
}

impl Write {
    /// A write of `operation` by `caller`, numbered; `before` is filled in by the outcome.
    pub fn new(
        caller: &str,
        operation: &'static str,
        domain: &str,
        target: String,
        after: String,
        reason: &str,
    ) -> Self {
        Self {
            id: NEXT_WRITE.fetch_add(1, Ordering::Relaxed),
            caller: caller.to_string(),
            operation,
            domain: domain.to_string(),
            target,
            before: String::new(),
            after,
            reason: reason.to_string(),
        }
    }

    /// The attempt line, before the store is called: what is about to be written.
    pub fn attempt(&self) {
        tracing::info!(
            target: TARGET,
            write_id = self.id,
            caller = self.caller.as_str(),
            operation = self.operation,
            domain = self.domain.as_str(),
            target_entries = self.target.as_str(),
            after = self.after.as_str(),
            reason = self.reason.as_str(),
            "admin write attempt"
        );
    }

    /// The outcome line, and the write counted; `result` is what the caller was answered.
    pub fn record(&self, metrics: &AdminMetrics, result: Result<(), &str>) {
        let outcome = if result.is_ok() { "ok" } else { "error" };
        metrics
            .writes
            .with_label_values(&[self.operation, self.caller.as_str(), outcome])
            .inc();
        tracing::info!(
            target: TARGET,
            write_id = self.id,
            caller = self.caller.as_str(),
            operation = self.operation,
            domain = self.domain.as_str(),
            target_entries = self.target.as_str(),
            before = self.before.as_str(),
            after = self.after.as_str(),
            reason = self.reason.as_str(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_audit_directive_parses() {
        assert!(DIRECTIVE.parse::<Directive>().is_ok());
    }
}
