//! The one test double of the store contract (`test-util` builds only): a real
//! [`MemoryStore`] underneath, so what it decides is real, with what the unit and integration
//! tests need around it — counted calls, a gate that holds calls until the test opens it, and
//! failures or probe answers the test sets. Tests of Redis behaviour use real Redis instead.

use super::memory::MemoryStore;
use super::{BoxFuture, CounterStore, Decision, LimitCheck, StoreError, WriteBack};
use crate::clock::Clock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A memory store a test can count, hold, fail and probe.
#[derive(Debug)]
pub struct FakeStore {
    inner: MemoryStore,
    calls: AtomicUsize,
    /// Set: every call fails with this error (without reaching the memory store).
    failure: Mutex<Option<StoreError>>,
    probe_ok: AtomicBool,
    /// Set: every call waits for one permit, consumed, before it is decided.
    gate: Option<tokio::sync::Semaphore>,
}

impl FakeStore {
    /// Decides on a memory store on `clock`, counting calls.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            inner: MemoryStore::new(clock),
            calls: AtomicUsize::new(0),
            failure: Mutex::new(None),
            probe_ok: AtomicBool::new(true),
            gate: None,
        }
    }

    /// Fails every call with `error` (and answers probes with `false`).
    pub fn failing(error: StoreError) -> Self {
        let s = Self::new(Arc::new(crate::clock::SystemClock));
        s.fail_with(Some(error));
        s.set_probe(false);
        s
    }

    /// Holds every call until [`FakeStore::open`] lets it through (one permit per call).
    pub fn gated(clock: Arc<dyn Clock>) -> Self {
        Self {
            gate: Some(tokio::sync::Semaphore::new(0)),
            ..Self::new(clock)
        }
    }

    /// Lets `n` held calls (present or future) through the gate.
    pub fn open(&self, n: usize) {
        if let Some(g) = &self.gate {
            g.add_permits(n);
        }
    }

    /// From now on, every call fails with `error`; `None` decides again.
    pub fn fail_with(&self, error: Option<StoreError>) {
        *self.failure.lock().unwrap_or_else(|e| e.into_inner()) = error;
    }

    /// What [`CounterStore::probe`] answers.
    pub fn set_probe(&self, ok: bool) {
        self.probe_ok.store(ok, Ordering::SeqCst);
    }

    /// Calls that reached the store (held ones included).
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// Yields until `n` calls have reached the store.
    pub async fn wait_calls(&self, n: usize) {
        while self.calls() < n {
            tokio::task::yield_now().await;
        }
    }
}

impl CounterStore for FakeStore {
    fn decide<'a>(
        &'a self,
        checks: &'a [LimitCheck],
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        Box::pin(async move {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if let Some(g) = &self.gate {
                if let Ok(p) = g.acquire().await {
                    p.forget();
                }
            }
            let failure = self
                .failure
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            match failure {
                Some(e) => Err(e),
                None => self.inner.decide(checks).await,
            }
        })
    }

    fn probe(&self) -> BoxFuture<'_, bool> {
        Box::pin(async move { self.probe_ok.load(Ordering::SeqCst) })
    }
}

/// Records as it decides: a store in this process has no lost replies (so no token to check).
impl WriteBack for FakeStore {
    fn write_back<'a>(
        &'a self,
        checks: &'a [LimitCheck],
        token: &'a str,
        ttl: std::time::Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let _ = (token, ttl);
        Box::pin(async move { self.decide(checks).await.map(|_| ()) })
    }
}
