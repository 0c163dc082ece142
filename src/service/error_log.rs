//! Store errors logged at most once a second, so a dead Redis under load writes one line a
//! second with the count left out, not one line per request.

use super::FailureMode;
use crate::store::StoreError;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Logs store errors at most once per [`ErrorLog::EVERY`], with the number left out in between,
/// so a dead Redis under load writes one line a second, not one per request.
#[derive(Debug)]
pub(super) struct ErrorLog {
    start: std::time::Instant,
    /// Milliseconds since `start` of the last line written, plus one (0 = never).
    last: AtomicU64,
    suppressed: AtomicU64,
}

impl ErrorLog {
    const EVERY: Duration = Duration::from_secs(1);

    pub(super) fn new() -> Self {
        Self {
            start: std::time::Instant::now(),
            last: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Whether a line may be written at `now_ms` (milliseconds since `start`): `Some(n)` with
    /// the number of errors left out since the last line, or `None` (this one is counted).
    pub(super) fn due(&self, now_ms: u64) -> Option<u64> {
        let now = now_ms.saturating_add(1);
        let last = self.last.load(Ordering::Relaxed);
        let due = last == 0 || now.saturating_sub(last) >= Self::EVERY.as_millis() as u64;
        if !due
            || self
                .last
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(self.suppressed.swap(0, Ordering::Relaxed))
    }

    pub(super) fn log(&self, error: &StoreError, failure_mode: Option<FailureMode>) {
        let now = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        let Some(suppressed) = self.due(now) else {
            return;
        };
        let answer = match failure_mode {
            None => "UNAVAILABLE",
            Some(FailureMode::Allow) => "OK (FAILURE_MODE=allow)",
            Some(FailureMode::Deny) => "OVER_LIMIT (FAILURE_MODE=deny)",
            Some(FailureMode::Local) => "OVER_LIMIT (FAILURE_MODE=local, the local store failed)",
        };
        // Store errors carry no credentials (URLs are redacted where they are built).
        tracing::warn!(
            error = %error,
            answer,
            suppressed_since_last = suppressed,
            "counter store could not decide"
        );
    }
}
