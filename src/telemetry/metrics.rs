//! Prometheus metrics for `GET /metrics`, in the text exposition format (0.0.4) that every
//! Prometheus, Grafana Agent and OpenTelemetry Collector scrapes. Per-descriptor counters carry
//! only the domain and the config's descriptor key. With `detailed_metric` / `value_to_metric`
//! the key carries request values, so traffic could grow the series without end: at most
//! [`MAX_DESCRIPTOR_SERIES`] (domain, key) pairs get series of their own; later ones are counted
//! under the key `_overflow` of their domain.

use super::quota_metrics::QuotaMetrics;
pub use super::registrar::MetricsError;
use super::registrar::{catch_up, Registrar};
use crate::store::breaker::BreakerState;
use crate::store::StoreSignals;
use prometheus::{
    Encoder, Gauge, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};
use std::time::Duration;

/// How a request ended, for the request latency histogram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestOutcome {
    Ok,
    OverLimit,
    /// INVALID_ARGUMENT.
    Invalid,
    /// The store failed and no failure mode answered (UNAVAILABLE).
    Error,
}

impl RequestOutcome {
    /// In the order of `Metrics::request_by_outcome`.
    const ALL: [Self; 4] = [Self::Ok, Self::OverLimit, Self::Invalid, Self::Error];

    fn label(self) -> &'static str {
        match self {
            RequestOutcome::Ok => "ok",
            RequestOutcome::OverLimit => "over_limit",
            RequestOutcome::Invalid => "invalid_argument",
            RequestOutcome::Error => "unavailable",
        }
    }
}

/// What one descriptor contributed to the per-descriptor counters of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DescriptorHits {
    /// Hits the descriptor asked for (its `hits_addend`).
    pub hits: u64,
    /// A limit (enforced or shadow) denied these hits.
    pub over_limit: bool,
    /// The denial came from the local deny cache, without a store call.
    pub local_cache: bool,
    /// The denial was only a shadow limit's (or global shadow mode's): reported OK.
    pub shadow: bool,
    /// Allowed, with the most restrictive limit's use at or past `NEAR_LIMIT_RATIO`.
    pub near_limit: bool,
}

/// Every metric sluice exports, in one registry.
/// The (domain, descriptor key) pairs that have series of their own, by domain.
#[derive(Debug, Default)]
struct SeriesSet {
    pairs: std::collections::HashMap<Box<str>, std::collections::HashSet<Box<str>>>,
    len: usize,
    /// Times the write lock was taken.
    writes: u64,
}

/// (domain, descriptor key) pairs with per-descriptor series of their own, at most.
pub const MAX_DESCRIPTOR_SERIES: usize = 10_000;
/// The descriptor key the pairs past [`MAX_DESCRIPTOR_SERIES`] are counted under.
pub const OVERFLOW_KEY: &str = "_overflow";
/// The longest descriptor key label, in bytes: a longer key (request values can be kilobytes)
/// is labelled with its first this many (cut at a character boundary), so a scrape of the full
/// table stays a few megabytes.
pub const MAX_LABEL_BYTES: usize = 256;

/// `key`'s first [`MAX_LABEL_BYTES`] bytes, at a character boundary.
fn label_prefix(key: &str) -> &str {
    if key.len() <= MAX_LABEL_BYTES {
        return key;
    }
    let mut end = MAX_LABEL_BYTES;
    while !key.is_char_boundary(end) {
        end -= 1;
    }
    key.get(..end).unwrap_or_default()
}

#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    /// The (domain, key) pairs that have series.
    descriptor_series: std::sync::Arc<std::sync::RwLock<SeriesSet>>,
    total_hits: IntCounterVec,
    within_limit: IntCounterVec,
    near_limit: IntCounterVec,
    over_limit: IntCounterVec,
    over_limit_with_local_cache: IntCounterVec,
    shadow_mode: IntCounterVec,
    /// Series resolved once (a label lookup per request costs a hash and a lock): request
    /// durations by outcome, store durations ok / error.
    request_by_outcome: [prometheus::Histogram; 4],
    store_ok: prometheus::Histogram,
    store_failed: prometheus::Histogram,
    store_errors: IntCounterVec,
    breaker_state: IntGauge,
    store_up: IntGauge,
    config_loads: IntCounterVec,
    config_timestamp: Gauge,
    config_rules: IntGaugeVec,
    offenders_dropped: IntCounter,
    undo_failures: IntCounter,
    evictions: IntCounter,
    candidate_evictions: IntCounter,
    /// Calls on lease limits (`in_flight`, `reservations`), by domain, call and outcome.
    lease_calls: IntCounterVec,
    local: LocalMetrics,
    /// The quota service's series.
    pub quota: QuotaMetrics,
    /// The admin API's series.
    pub admin: super::admin_metrics::AdminMetrics,
    slices: super::slice_metrics::SliceMetrics,
    global: super::global_metrics::GlobalMetrics,
    /// Slots and reservations held, leases expired, releases without an entry.
    pub leases: std::sync::Arc<super::leases::LeaseMetrics>,
    /// The decision log's lines written and dropped (`DECISION_LOG`; 0 while it is off).
    decision_log: crate::decision_log::Counters,
}

/// `FAILURE_MODE=local`'s series, read from the stack's [`crate::store::LocalTallies`] when
/// rendered.
#[derive(Debug, Clone)]
struct LocalMetrics {
    decisions: IntCounterVec,
    deciding: IntGauge,
    write_backs: IntCounterVec,
    counters: IntGauge,
    evictions: IntCounter,
    late_calls_dropped: IntCounter,
    replicas: IntGauge,
    owed: IntGauge,
}

impl LocalMetrics {
    fn register(r: &Registrar) -> Result<Self, MetricsError> {
        let m = Self {
            decisions: r.add(IntCounterVec::new(
                Opts::new(
                    "sluice_local_decisions_total",
                    "Requests decided by this replica alone (FAILURE_MODE=local) because the \
                     store did not answer in time, by domain and outcome (ok, over_limit).",
                ),
                &["domain", "outcome"],
            ))?,
            deciding: r.add(IntGauge::new(
                "sluice_deciding_locally",
                "1 from the first local decision until everything decided locally is written \
                 back to the store, else 0.",
            ))?,
            write_backs: r.add(IntCounterVec::new(
                Opts::new(
                    "sluice_local_write_backs_total",
                    "Write-backs of local decisions to the store, by result (done, failed: each \
                     failure is retried under its token, never charged twice).",
                ),
                &["result"],
            ))?,
            counters: r.add(IntGauge::new(
                "sluice_local_counters",
                "Counters held for local decisions (local store, learned, owed), each part \
                 bounded by LOCAL_MAX_COUNTERS.",
            ))?,
            evictions: r.add(IntCounter::new(
                "sluice_local_evictions_total",
                "Local counters evicted, or not kept, because LOCAL_MAX_COUNTERS was reached.",
            ))?,
            late_calls_dropped: r.add(IntCounter::new(
                "sluice_local_late_calls_dropped_total",
                "Store calls dropped at their caller's deadline because LOCAL_MAX_LATE_CALLS                  calls were already awaited (a master that hangs); their hits may be counted                  twice.",
            ))?,
            replicas: r.add(IntGauge::new(
                "sluice_local_replicas",
                "Replicas sharing the store at the last heartbeat (FAILURE_MODE=local splits each \
                 limit among them); 0 before one answered.",
            ))?,
            owed: r.add(IntGauge::new(
                "sluice_local_owed",
                "Counters owing a write-back to the store, plus store calls still awaited after \
                 their request was answered locally.",
            ))?,
        };
        // Both results from the start (at 0), so `rate()` and alerts see them before the first.
        for result in ["done", "failed"] {
            m.write_backs.with_label_values(&[result]);
        }
        Ok(m)
    }

    fn update(&self, t: &crate::store::LocalTallies) {
        for (domain, admitted, n) in t.decisions() {
            let outcome = if admitted { "ok" } else { "over_limit" };
            catch_up(&self.decisions.with_label_values(&[&*domain, outcome]), n);
        }
        self.deciding.set(i64::from(
            t.deciding.load(std::sync::atomic::Ordering::Relaxed),
        ));
        catch_up(
            &self.write_backs.with_label_values(&["done"]),
            t.write_backs.get(),
        );
        catch_up(
            &self.write_backs.with_label_values(&["failed"]),
            t.write_back_failures.get(),
        );
        catch_up(&self.late_calls_dropped, t.late_calls_dropped.get());
        let relaxed = std::sync::atomic::Ordering::Relaxed;
        self.replicas
            .set(i64::try_from(t.replicas.load(relaxed)).unwrap_or(i64::MAX));
        self.owed
            .set(i64::try_from(t.owed.load(relaxed)).unwrap_or(i64::MAX));
        let held = t.held.load(std::sync::atomic::Ordering::Relaxed);
        self.counters.set(i64::try_from(held).unwrap_or(i64::MAX));
        catch_up(
            &self.evictions,
            t.evictions.get() + t.skipped.load(std::sync::atomic::Ordering::Relaxed),
        );
    }
}

impl Metrics {
    pub fn new() -> Result<Self, MetricsError> {
        let r = Registrar(Registry::new());
        let request_duration = r.latency(
            "sluice_request_duration_seconds",
            "ShouldRateLimit decision time, from request to response, by outcome.",
            "outcome",
        )?;
        let store_duration = r.latency(
            "sluice_store_call_duration_seconds",
            "Time of one counter store call (all limits of a request), by result.",
            "result",
        )?;
        let store_errors = r.counter_vec(
            "sluice_store_errors_total",
            "Counter store calls that failed, by kind (transient: retrying may help).",
            ("kind", &["transient", "permanent"]),
        )?;
        let config_loads = r.counter_vec(
            "sluice_config_loads_total",
            "Config loads and reloads, by result (a failed one keeps the old rules).",
            ("result", &["success", "failure"]),
        )?;
        register_build_info(&r)?;
        let (offenders_dropped, undo_failures, evictions, lease_calls) = ops_counters(&r)?;
        let [total_hits, within_limit, near_limit, over_limit, over_limit_with_local_cache, shadow_mode] =
            descriptor_counters(&r)?;
        Ok(Self {
            total_hits,
            within_limit,
            near_limit,
            over_limit,
            over_limit_with_local_cache,
            shadow_mode,
            request_by_outcome: RequestOutcome::ALL
                .map(|o| request_duration.with_label_values(&[o.label()])),
            store_ok: store_duration.with_label_values(&["ok"]),
            store_failed: store_duration.with_label_values(&["error"]),
            store_errors,
            breaker_state: r.add(IntGauge::new(
                "sluice_circuit_breaker_state",
                "Redis circuit breaker: 0 closed, 1 half-open (probing), 2 open; -1 no breaker.",
            ))?,
            store_up: r.add(IntGauge::new(
                "sluice_store_up",
                "1 if the counter store answered its last contact, else 0.",
            ))?,
            config_loads,
            config_timestamp: r.add(Gauge::new(
                "sluice_config_loaded_timestamp_seconds",
                "Unix time the rules in force were loaded.",
            ))?,
            config_rules: r.add(IntGaugeVec::new(
                Opts::new(
                    "sluice_config_rate_limits",
                    "Rate limits in the rules in force, per domain.",
                ),
                &["domain"],
            ))?,
            offenders_dropped,
            undo_failures,
            evictions,
            candidate_evictions: r.add(IntCounter::new(
                "sluice_candidate_evictions_total",
                "Live memory-store counters of candidate limits (CANDIDATE_CONFIG) evicted to \
                 make room for other candidates' (they have MEMORY_MAX_COUNTERS of their own \
                 and never evict an enforced counter): each starts afresh mid-window.",
            ))?,
            lease_calls,
            local: LocalMetrics::register(&r)?,
            quota: QuotaMetrics::register(&r)?,
            admin: super::admin_metrics::AdminMetrics::register(&r)?,
            slices: super::slice_metrics::SliceMetrics::register(&r)?,
            global: super::global_metrics::GlobalMetrics::register(&r)?,
            leases: std::sync::Arc::new(super::leases::LeaseMetrics::register(&r.0)?),
            decision_log: decision_log_counters(&r)?,
            descriptor_series: Default::default(),
            registry: r.0,
        })
    }

    /// Adds one descriptor's hits to the per-descriptor counters.
    pub fn descriptor(&self, domain: &str, key: &str, d: DescriptorHits) {
        let labels = [domain, self.series_key(domain, key)];
        self.total_hits.with_label_values(&labels).inc_by(d.hits);
        if d.over_limit {
            self.over_limit.with_label_values(&labels).inc_by(d.hits);
            if d.local_cache {
                self.over_limit_with_local_cache
                    .with_label_values(&labels)
                    .inc_by(d.hits);
            }
            if d.shadow {
                self.shadow_mode.with_label_values(&labels).inc_by(d.hits);
            }
        } else {
            self.within_limit.with_label_values(&labels).inc_by(d.hits);
            if d.near_limit {
                self.near_limit.with_label_values(&labels).inc_by(d.hits);
            }
        }
    }

    /// One call on a lease limit: `call` is take, free, check, reserve or settle.
    pub fn lease_call(&self, domain: &str, call: &str, allowed: bool) {
        let outcome = if allowed { "ok" } else { "over_limit" };
        self.lease_calls
            .with_label_values(&[domain, call, outcome])
            .inc();
    }

    /// `key` (its first [`MAX_LABEL_BYTES`]), or [`OVERFLOW_KEY`] once [`MAX_DESCRIPTOR_SERIES`]
    /// other pairs have series. A known pair, and any pair once the table is full, costs a
    /// shared read lock and two lookups, no allocation: only a pair that gets a series of its
    /// own (at most [`MAX_DESCRIPTOR_SERIES`] in the process's life) takes the write lock.
    fn series_key<'k>(&self, domain: &str, key: &'k str) -> &'k str {
        let key = label_prefix(key);
        let known = |s: &SeriesSet| s.pairs.get(domain).is_some_and(|keys| keys.contains(key));
        match self.descriptor_series.read() {
            Ok(s) if known(&s) => return key,
            Ok(s) if s.len >= MAX_DESCRIPTOR_SERIES => return OVERFLOW_KEY,
            Ok(_) => {}
            Err(_) => return key,
        }
        let Ok(mut set) = self.descriptor_series.write() else {
            return key;
        };
        set.writes += 1;
        if known(&set) {
            return key;
        }
        if set.len >= MAX_DESCRIPTOR_SERIES {
            return OVERFLOW_KEY;
        }
        set.len += 1;
        set.pairs
            .entry(domain.into())
            .or_default()
            .insert(key.into());
        key
    }

    pub fn request(&self, outcome: RequestOutcome, took: Duration) {
        self.request_by_outcome[outcome as usize].observe(took.as_secs_f64());
    }

    /// One store call: its time, and the error kind if it failed.
    pub fn store_call(&self, took: Duration, error: Option<&crate::store::StoreError>) {
        let series = if error.is_some() {
            &self.store_failed
        } else {
            &self.store_ok
        };
        series.observe(took.as_secs_f64());
        match error {
            Some(e) if e.is_transient() => {
                self.store_errors.with_label_values(&["transient"]).inc();
            }
            Some(_) => {
                self.store_errors.with_label_values(&["permanent"]).inc();
            }
            None => {}
        }
    }

    /// A config load or reload that took effect.
    pub fn config_loaded(&self, rules: &crate::config::RuleSet) {
        self.config_loads.with_label_values(&["success"]).inc();
        let at = rules
            .loaded_at
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        self.config_timestamp.set(at.as_secs_f64());
        self.config_rules.reset();
        for (domain, n) in rules.rule_counts() {
            self.config_rules
                .with_label_values(&[domain.as_str()])
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// A config load or reload that failed (the rules in force stay).
    pub fn config_failed(&self) {
        self.config_loads.with_label_values(&["failure"]).inc();
    }

    /// The text exposition of every metric, with the gauges read now (`now`, the service's
    /// clock): the store's breaker and health, the offenders tracker's running total of denials
    /// it could not record, the leases held.
    pub fn render(&self, store: &StoreSignals, offenders_dropped: u64, now: Duration) -> String {
        self.leases.update(now);
        let (breaker, store_up) = (store.breaker_state(), *store.health.borrow());
        let seen = self.undo_failures.get();
        let total = store.undo_failures.get();
        if total > seen {
            self.undo_failures.inc_by(total - seen);
        }
        for (shown, total) in [
            (&self.evictions, &store.evictions),
            (&self.candidate_evictions, &store.candidate_evictions),
        ] {
            let (seen, total) = (shown.get(), total.get());
            if total > seen {
                shown.inc_by(total - seen);
            }
        }
        let seen = self.offenders_dropped.get();
        if offenders_dropped > seen {
            self.offenders_dropped.inc_by(offenders_dropped - seen);
        }
        self.breaker_state.set(match breaker {
            None => -1,
            Some(BreakerState::Closed) => 0,
            Some(BreakerState::HalfOpen) => 1,
            Some(BreakerState::Open) => 2,
        });
        self.store_up.set(i64::from(store_up));
        self.local.update(&store.local);
        self.slices.update(&store.slices);
        self.global.update(&store.global);
        let mut out = Vec::new();
        // Encoding into a Vec fails only on a metric with an invalid name, which `new` rejects.
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::error!(error = %e, "cannot encode metrics");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

/// `sluice_decision_log_*`: lines written, lines dropped by reason.
fn decision_log_counters(
    r: &super::registrar::Registrar,
) -> Result<crate::decision_log::Counters, MetricsError> {
    let dropped = r.counter_vec(
        "sluice_decision_log_dropped_total",
        "Decision log lines dropped: its queue was full (the request went on undelayed), the \
         file could not be written (disk full), or the line was larger than a file may be.",
        ("reason", &["queue_full", "write_error", "too_large"]),
    )?;
    Ok(crate::decision_log::Counters {
        lines: r.add(IntCounter::new(
            "sluice_decision_log_lines_total",
            "Decided requests written to the decision log (DECISION_LOG).",
        ))?,
        dropped_queue: dropped.with_label_values(&["queue_full"]),
        dropped_write: dropped.with_label_values(&["write_error"]),
        dropped_large: dropped.with_label_values(&["too_large"]),
    })
}

impl Metrics {
    /// The decision log's counters (registered here, fed by its writer).
    pub fn decision_log_counters(&self) -> crate::decision_log::Counters {
        self.decision_log.clone()
    }

    /// Every metric family as it stands now (the store gauges as last rendered).
    pub fn gather(&self) -> Vec<prometheus::proto::MetricFamily> {
        self.registry.gather()
    }
}

/// The content type of [`Metrics::render`]'s output.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The per-descriptor counters, in the order of [`Metrics`]' fields.
fn descriptor_counters(r: &Registrar) -> Result<[IntCounterVec; 6], MetricsError> {
    Ok([
        r.descriptor_counter(
            "total_hits",
            "Hits asked for, per domain and descriptor key.",
        )?,
        r.descriptor_counter("within_limit", "Hits no limit denied.")?,
        r.descriptor_counter(
            "near_limit",
            "Allowed hits that took the most restrictive limit to NEAR_LIMIT_RATIO or beyond.",
        )?,
        r.descriptor_counter(
            "over_limit",
            "Hits a limit denied (shadow limits included; see shadow_mode).",
        )?,
        r.descriptor_counter(
            "over_limit_with_local_cache",
            "Denied hits answered by the local deny cache without a store call.",
        )?,
        r.descriptor_counter(
            "shadow_mode",
            "Hits a shadow limit (or SHADOW_MODE) would have denied; answered OK.",
        )?,
    ])
}

/// The running totals of what sluice dropped or could not do: offenders not recorded, Cluster
/// undos that failed, memory-store evictions; and the lease calls by outcome.
fn ops_counters(
    r: &Registrar,
) -> Result<(IntCounter, IntCounter, IntCounter, IntCounterVec), MetricsError> {
    let offenders_dropped = r.add(IntCounter::new(
        "sluice_offenders_dropped_total",
        "Denials not recorded in /debug/offenders because its domain cap was reached.",
    ))?;
    let undo_failures = r.add(IntCounter::new(
        "sluice_refund_failures_total",
        "Redis Cluster charges that could not be undone after a request was denied in \
         another slot (retried first): each leaves a counter charged for a denied request.",
    ))?;
    let evictions = r.add(IntCounter::new(
        "sluice_memory_evictions_total",
        "Live memory-store counters evicted to make room under MEMORY_MAX_COUNTERS (the \
         closest to expiry first): each starts afresh, which can only admit more.",
    ))?;
    let lease_calls = r.add(IntCounterVec::new(
        Opts::new(
            "sluice_lease_calls_total",
            "Calls on `in_flight` limits (take, free, check) and on limits with \
             `reservations` (reserve, settle), by domain, call and outcome (ok, \
             over_limit; a free or a settle is never denied).",
        ),
        &["domain", "call", "outcome"],
    ))?;
    Ok((offenders_dropped, undo_failures, evictions, lease_calls))
}

/// `sluice_build_info{version}`: always 1.
fn register_build_info(r: &Registrar) -> Result<(), MetricsError> {
    let build_info = r.add(IntGaugeVec::new(
        Opts::new(
            "sluice_build_info",
            "Always 1; labels say which build runs.",
        ),
        &["version"],
    ))?;
    build_info
        .with_label_values(&[env!("CARGO_PKG_VERSION")])
        .set(1);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_values_in_descriptor_keys_cannot_grow_the_series_without_end() {
        // `detailed_metric` puts request values in the key: a client sending a new value with
        // every request must not add a series with every request.
        let m = Metrics::new().expect("metrics");
        let hits = DescriptorHits {
            hits: 1,
            ..DescriptorHits::default()
        };
        for i in 0..MAX_DESCRIPTOR_SERIES + 500 {
            m.descriptor("d", &format!("user_{i}"), hits);
        }
        let writes = m.descriptor_series.read().expect("lock").writes;
        assert_eq!(
            writes, MAX_DESCRIPTOR_SERIES as u64,
            "once the table is full, a new key takes no write lock"
        );
        m.descriptor("d", "user_7", hits);
        let total = m
            .gather()
            .into_iter()
            .find(|f| f.name() == "sluice_rate_limit_total_hits")
            .expect("total hits family");
        let series = total.get_metric().len();
        assert_eq!(
            series,
            MAX_DESCRIPTOR_SERIES + 1,
            "capped, plus the overflow"
        );
        let value_of = |key: &str| {
            total
                .get_metric()
                .iter()
                .find(|s| s.get_label().iter().any(|l| l.value() == key))
                .map(|s| s.get_counter().get_value())
        };
        assert_eq!(value_of(OVERFLOW_KEY), Some(500.0));
        assert_eq!(
            value_of("user_7"),
            Some(2.0),
            "a known key keeps its series"
        );
    }

    #[test]
    fn a_long_key_is_labelled_with_its_first_256_bytes() {
        let m = Metrics::new().expect("metrics");
        let hits = DescriptorHits {
            hits: 1,
            ..DescriptorHits::default()
        };
        // 70 KB: cut at 256 bytes, back to a character boundary (x and 127 two-byte ones).
        m.descriptor("e", &format!("x{}", "é".repeat(35_000)), hits);
        let mut labels: Vec<usize> = m
            .gather()
            .into_iter()
            .filter(|f| f.name() == "sluice_rate_limit_total_hits")
            .flat_map(|f| f.get_metric().to_vec())
            .flat_map(|s| s.get_label().to_vec())
            .map(|l| l.value().len())
            .collect();
        labels.sort_unstable();
        assert_eq!(labels, vec![1, 255], "domain and key: {labels:?}");
    }
}
