//! The admin API's series (`sluice_admin_*`): writes by operation, caller and result, calls
//! refused by reason, and the overrides in force on this replica. Callers are the names in the
//! tokens file or certificate subjects the client CA signed: as bounded as the operators.

use super::registrar::{MetricsError, Registrar};
use prometheus::{IntCounterVec, IntGauge, Opts};

#[derive(Debug, Clone)]
pub struct AdminMetrics {
    /// Writes (reset, set_override, delete_override) by caller and result (ok, error).
    pub writes: IntCounterVec,
    /// Calls refused: unauthenticated, permission_denied.
    pub refused: IntCounterVec,
    /// Counters the resets reset (Redis; the memory store does not count them).
    pub counters_reset: prometheus::IntCounter,
    /// Overrides live on this replica as last loaded.
    pub overrides_live: IntGauge,
}

impl AdminMetrics {
    pub(super) fn register(r: &Registrar) -> Result<Self, MetricsError> {
        Ok(Self {
            writes: r.add(IntCounterVec::new(
                Opts::new(
                    "sluice_admin_writes_total",
                    "Admin API writes (reset, set_override, delete_override), by caller and \
                     result (ok, error); each has its audit log line.",
                ),
                &["operation", "caller", "result"],
            ))?,
            refused: r.counter_vec(
                "sluice_admin_refused_total",
                "Admin API calls refused, by reason: unauthenticated (no or an unknown token), \
                 permission_denied (a read-scope caller writing).",
                ("reason", &["unauthenticated", "permission_denied"]),
            )?,
            counters_reset: r.add(prometheus::IntCounter::new(
                "sluice_admin_counters_reset_total",
                "Counters admin resets deleted (Redis; the memory store resets without counting).",
            ))?,
            overrides_live: r.add(IntGauge::new(
                "sluice_admin_overrides",
                "Admin overrides in force on this replica, as last loaded from the store.",
            ))?,
        })
    }
}
