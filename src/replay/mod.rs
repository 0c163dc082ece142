//! `sluice replay`: a decision log (`decision_log`) fed to a config again, on the embedded
//! memory store with a virtual clock, as fast as the machine goes: "if I had set 50 instead of
//! 100 yesterday, who would have been limited, and when?".
//!
//! Why the memory store and a virtual clock: the store then decides each request at the
//! instant the log says it was decided (the memory store logs its own reading), in the order
//! of those instants, so the enforced config replayed on a memory store's log gives back every
//! logged answer (fixed and sliding windows, token buckets alike). Why the whole decision
//! engine (`RateLimiter`) and not the algorithms alone: a replay must match the config's
//! descriptors, overrides, shadow mode and hits exactly as the service does.
//!
//! What a replay cannot reproduce, stated: a log written by a Redis-backed service records the
//! service's time, not Redis' (within a millisecond); leased limits are decided on the
//! counter itself (no slices: what they approximate); a log appended to across restarts
//! carries counters over the restart; a sampled log (`DECISION_LOG_SAMPLE`) holds whole
//! consumers, so limits per consumer replay exactly and shared limits see only the sample.

pub mod cli;
mod render;
mod report;

pub use render::{svg, table};
pub use report::{ConfigReport, Consumer, LimitReport, Report, Totals};

use crate::clock::Clock;
use crate::config::RuleSet;
use crate::decision_log::line::Line;
use crate::service::{RateLimiter, RequestError, ServiceOptions};
use crate::store::StoreStack;
use crate::telemetry::Telemetry;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Counters one replay's memory store holds at most: far above a day's consumers of a busy
/// domain (an evicted counter would start again at zero and admit what the log denied).
const MAX_COUNTERS: usize = 50_000_000;

/// The replay's time: set to each line's instant before it is decided.
#[derive(Debug, Default)]
pub struct VirtualClock(AtomicU64);

impl VirtualClock {
    pub fn set_us(&self, us: u64) {
        self.0.store(us, Ordering::Relaxed);
    }
}

impl Clock for VirtualClock {
    fn now(&self) -> Duration {
        Duration::from_micros(self.0.load(Ordering::Relaxed))
    }
}

/// The lines of one or more log files (rotated ones too, in any order), sorted by when they
/// were decided (the memory store's count of decisions orders those of one instant).
pub fn read_logs(
    paths: &[std::path::PathBuf],
) -> Result<(Vec<Line>, crate::decision_log::Skipped), String> {
    let (mut all, mut skipped) = (Vec::new(), crate::decision_log::Skipped::default());
    for p in paths {
        let (lines, s) = crate::decision_log::read_lines(p)?;
        all.extend(lines);
        skipped.lines += s.lines;
        if skipped.first.is_none() {
            skipped.first = s.first;
        }
    }
    if let (true, Some(first)) = (all.is_empty(), &skipped.first) {
        return Err(first.clone());
    }
    all.sort_by_key(|l| (l.t, l.seq));
    Ok((all, skipped))
}

/// Replays `lines` against `rules` (named `name` in the report), calling `progress` with the
/// lines done every so often; `top` consumers are kept per limit.
pub async fn replay(
    name: &str,
    rules: RuleSet,
    options: ServiceOptions,
    lines: &[Line],
    top: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<ConfigReport, String> {
    let clock = Arc::new(VirtualClock::default());
    let dyn_clock: Arc<dyn Clock> = Arc::clone(&clock) as Arc<dyn Clock>;
    let store = StoreStack::memory(Arc::clone(&dyn_clock), MAX_COUNTERS);
    let telemetry = Telemetry::new(dyn_clock).map_err(|e| e.to_string())?;
    let limiter = RateLimiter::new(rules, store, options, telemetry);
    let mut report = report::Builder::new(name, lines, top);
    for (i, line) in lines.iter().enumerate() {
        clock.set_us(line.t);
        match limiter.should_rate_limit(line.request()).await {
            Ok(response) => report.add(line, &response),
            Err(RequestError::Invalid(_)) => report.invalid(),
            Err(e) => return Err(format!("replaying line {}: {e}", i + 1)),
        }
        if i % 10_000 == 0 {
            progress(i);
        }
    }
    progress(lines.len());
    Ok(report.finish())
}

#[cfg(test)]
mod tests;
