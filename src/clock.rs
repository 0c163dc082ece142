//! Time source for decisions. The memory store and the service read time only through [`Clock`],
//! so tests drive window logic with a [`ManualClock`] instead of sleeping.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Wall-clock time as a duration since the Unix epoch. Windows are aligned to the epoch so every
/// replica agrees on where a window starts.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now(&self) -> Duration;
}

/// The process clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        // A clock before 1970 is a broken host; treating it as the epoch keeps serving.
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
    }
}

#[cfg(any(test, feature = "test-util"))]
pub use manual::ManualClock;

/// Tests only (the `test-util` feature): a clock the test moves by hand.
#[cfg(any(test, feature = "test-util"))]
mod manual {
    use super::Clock;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    /// A clock that only moves when told to; shared by clones.
    #[derive(Debug, Clone, Default)]
    pub struct ManualClock {
        nanos: Arc<AtomicU64>,
    }

    impl ManualClock {
        pub fn new(start: Duration) -> Self {
            let clock = Self::default();
            clock.set(start);
            clock
        }

        pub fn set(&self, t: Duration) {
            self.nanos.store(t.as_nanos() as u64, Ordering::SeqCst);
        }

        pub fn advance(&self, by: Duration) {
            self.nanos.fetch_add(by.as_nanos() as u64, Ordering::SeqCst);
        }
    }

    impl Clock for ManualClock {
        fn now(&self) -> Duration {
            Duration::from_nanos(self.nanos.load(Ordering::SeqCst))
        }
    }
}
