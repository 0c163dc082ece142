//! A circuit breaker in front of a remote counter store. While Redis is known to be down, waiting
//! `REDIS_TIMEOUT` on every request only ties up sluice and Envoy: after `failure_threshold`
//! consecutive transient errors the breaker opens and answers at once with a transient error
//! (gRPC UNAVAILABLE, or the configured failure mode); after `open_for` it lets ONE request
//! through (half-open) to see whether Redis is back, and the health task's probe closes it as soon
//! as Redis answers a PING.
//!
//! States:
//! - **Closed**: every call reaches the store; consecutive `Transient` errors are counted, any
//!   answer from the store (a decision, or a `Permanent` error, which proves Redis is up) resets
//!   the count.
//! - **Open**: calls fail fast without touching the store, until `open_for` has elapsed.
//! - **HalfOpen**: one trial call is in flight; concurrent calls still fail fast. Its success
//!   closes the breaker, its transient failure re-opens it for another `open_for`.
//!
//! Time comes from an injected [`Clock`], so tests drive the open timer with a `ManualClock`.

use super::{BoxFuture, CounterStore, Decision, LimitCheck, StoreError, StoreSignals, WriteBack};
use crate::clock::Clock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::watch;

/// Default number of consecutive transient errors that opens the breaker.
pub const DEFAULT_FAILURE_THRESHOLD: u32 = 3;
/// Default time the breaker stays open before letting one trial call through.
pub const DEFAULT_OPEN_FOR: Duration = Duration::from_secs(1);

/// When the breaker opens and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerSettings {
    /// Consecutive transient errors that open the breaker (0 is treated as 1).
    pub failure_threshold: u32,
    /// How long the breaker stays open before one trial call is let through.
    pub open_for: Duration,
    /// The store's own time to answer (`REDIS_TIMEOUT`): a call its caller gave up on sooner
    /// says nothing about the store, which is then asked directly (a probe) within this time.
    pub patience: Duration,
}

impl Default for BreakerSettings {
    fn default() -> Self {
        Self {
            failure_threshold: DEFAULT_FAILURE_THRESHOLD,
            open_for: DEFAULT_OPEN_FOR,
            patience: super::redis::DEFAULT_TIMEOUT,
        }
    }
}

/// The breaker's state as metrics and readiness see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

/// The breaker's state with what each state needs to know. Transitions:
/// - `Closed { failures }` -> `Open` when `failures` reaches the threshold;
/// - `Open { since }` -> `HalfOpen` when the first call after `open_for` becomes the trial;
/// - `HalfOpen` -> `Closed` when the trial (or a probe) succeeds, -> `Open` when it fails;
/// - `Open` -> `Closed` when a probe succeeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Consecutive transient errors while closed.
    Closed {
        failures: u32,
    },
    /// Opened at this clock time.
    Open {
        since: Duration,
    },
    HalfOpen,
}

impl State {
    fn public(self) -> BreakerState {
        match self {
            Self::Closed { .. } => BreakerState::Closed,
            Self::Open { .. } => BreakerState::Open,
            Self::HalfOpen => BreakerState::HalfOpen,
        }
    }
}

#[derive(Debug)]
struct Inner {
    state: State,
    /// Bumped on every state change: a call that started under another generation (e.g. a slow
    /// call that was in flight when the breaker opened) does not move the state.
    generation: u64,
}

/// What a call is allowed to do.
enum Permit {
    /// A normal call while closed, started under this generation.
    Normal(u64),
    /// The one half-open trial, started under this generation.
    Trial(u64),
    /// Fail fast.
    Reject,
}

/// A circuit breaker around a [`CounterStore`] `S`. Cheap to clone: clones share the store
/// and the state (a call its caller dropped is judged after the caller is gone).
#[derive(Debug)]
pub struct CircuitBreaker<S> {
    shared: Arc<Shared<S>>,
}

impl<S> Clone for CircuitBreaker<S> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S> std::ops::Deref for CircuitBreaker<S> {
    type Target = Shared<S>;
    fn deref(&self) -> &Shared<S> {
        &self.shared
    }
}

/// What every clone of a [`CircuitBreaker`] shares.
#[derive(Debug)]
pub struct Shared<S> {
    inner: S,
    clock: Arc<dyn Clock>,
    settings: BreakerSettings,
    state: Mutex<Inner>,
    /// A dropped call is being judged (see `CallGuard`).
    judging: AtomicBool,
    /// Dropped calls the judgement under way stands for (each is a failure if it fails).
    covered: std::sync::atomic::AtomicU32,
    /// Where state changes are published (metrics, readiness).
    signal: Arc<watch::Sender<Option<BreakerState>>>,
}

impl<S: CounterStore> CircuitBreaker<S> {
    pub fn new(inner: S, settings: BreakerSettings, clock: Arc<dyn Clock>) -> Self {
        Self::with_signal(
            inner,
            settings,
            clock,
            Arc::new(watch::Sender::new(Some(BreakerState::Closed))),
        )
    }

    fn with_signal(
        inner: S,
        settings: BreakerSettings,
        clock: Arc<dyn Clock>,
        signal: Arc<watch::Sender<Option<BreakerState>>>,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                inner,
                clock,
                settings: BreakerSettings {
                    failure_threshold: settings.failure_threshold.max(1),
                    ..settings
                },
                state: Mutex::new(Inner {
                    state: State::Closed { failures: 0 },
                    generation: 0,
                }),
                judging: AtomicBool::new(false),
                covered: std::sync::atomic::AtomicU32::new(0),
                signal,
            }),
        }
    }

    /// Publishes the breaker's state on `signals` (for `/metrics` and readiness). Before the
    /// breaker is used (it is rebuilt around the same store).
    pub fn reporting_to(self, signals: &StoreSignals) -> Self {
        let state = self.state();
        let signal = Arc::clone(&signals.breaker);
        signal.send_replace(Some(state));
        match Arc::try_unwrap(self.shared) {
            Ok(s) => Self::with_signal(s.inner, s.settings, s.clock, signal),
            Err(shared) => {
                tracing::error!("breaker already shared: its state is not reported");
                Self { shared }
            }
        }
    }

    /// The current state. An open breaker whose `open_for` has elapsed still reports `Open`
    /// until a call (the trial) or a successful probe moves it.
    pub fn state(&self) -> BreakerState {
        self.lock().state.public()
    }

    pub fn settings(&self) -> BreakerSettings {
        self.settings
    }

    /// Whether a dropped call is being judged now.
    #[cfg(test)]
    fn judging(&self) -> bool {
        self.judging.load(Ordering::Acquire)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The state is a few plain fields always left consistent; a panic elsewhere while the
        // lock was held does not make it unusable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn admit(&self) -> Permit {
        let mut s = self.lock();
        match s.state {
            State::Closed { .. } => Permit::Normal(s.generation),
            State::HalfOpen => Permit::Reject,
            State::Open { since } => {
                if self.clock.now().saturating_sub(since) >= self.settings.open_for {
                    self.move_to(&mut s, State::HalfOpen);
                    tracing::debug!("Redis circuit half-open: letting one request through");
                    Permit::Trial(s.generation)
                } else {
                    Permit::Reject
                }
            }
        }
    }

    /// Records the result of a call started under `generation`.
    fn record(&self, generation: u64, trial: bool, transient_failure: bool) {
        let mut s = self.lock();
        if s.generation != generation {
            return;
        }
        match (trial, transient_failure) {
            (false, false) => s.state = State::Closed { failures: 0 },
            (false, true) => {
                let failures = match s.state {
                    State::Closed { failures } => failures.saturating_add(1),
                    _ => return,
                };
                s.state = State::Closed { failures };
                if failures >= self.settings.failure_threshold {
                    self.open(&mut s);
                    tracing::warn!(
                        failures,
                        open_for = ?self.settings.open_for,
                        "Redis circuit open: answering at once until Redis recovers"
                    );
                }
            }
            (true, false) => self.close(&mut s, "a request succeeded"),
            (true, true) => {
                // Still down: already reported when it opened, so no new warning per trial.
                self.open(&mut s);
                tracing::debug!("Redis circuit re-opened: the trial request failed");
            }
        }
    }

    /// A state change: a new generation, published.
    fn move_to(&self, s: &mut Inner, state: State) {
        s.state = state;
        s.generation += 1;
        self.signal.send_replace(Some(state.public()));
    }

    fn open(&self, s: &mut Inner) {
        let since = self.clock.now();
        self.move_to(s, State::Open { since });
    }

    /// Closes the breaker. Closing a closed one keeps its generation but not its failures.
    fn close(&self, s: &mut Inner, why: &str) {
        if let State::Closed { .. } = s.state {
            s.state = State::Closed { failures: 0 };
        } else {
            tracing::info!("Redis circuit closed: {why}");
            self.move_to(s, State::Closed { failures: 0 });
        }
    }

    fn reject(&self) -> StoreError {
        StoreError::Transient(format!(
            "Redis circuit open after {} consecutive failures; retrying Redis at most every {:?}",
            self.settings.failure_threshold, self.settings.open_for
        ))
    }
}

/// Judges a call dropped before it finished (Envoy gives up on a rate-limit call at its
/// deadline, `grpc-timeout`, and tonic then drops the handler). The caller's patience is the
/// caller's, not the store's: a call dropped after the store's own time (`patience`,
/// `REDIS_TIMEOUT`) is a failure; one dropped sooner is judged by the store itself: the same
/// call, as a check of 0 hits on its first counter (the same script, connection and slot;
/// it writes nothing), given what is left of that time. So a Redis slower than every caller's
/// deadline still opens the breaker, while a caller's 1 ms deadline never does. One judgement
/// runs at a time (a hung store is not asked once per dropped call); a dropped half-open trial
/// is always judged, and re-opens or closes the breaker by it.
struct CallGuard<'a, S: CounterStore + 'static> {
    breaker: &'a CircuitBreaker<S>,
    checks: &'a [LimitCheck],
    generation: u64,
    trial: bool,
    started: tokio::time::Instant,
    done: bool,
}

impl<S: CounterStore + 'static> Drop for CallGuard<'_, S> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let due = self.started + self.breaker.settings.patience;
        let (generation, trial) = (self.generation, self.trial);
        let (Some(first), Ok(rt)) = (self.checks.first(), tokio::runtime::Handle::try_current())
        else {
            self.breaker.record(generation, trial, true);
            return;
        };
        if tokio::time::Instant::now() >= due {
            self.breaker.record(generation, trial, true);
            return;
        }
        // A judgement under way stands for this call too: its failure counts once per call
        // it covers (a hung store still opens the breaker after `failure_threshold` calls).
        self.breaker.covered.fetch_add(1, Ordering::AcqRel);
        if self.breaker.judging.swap(true, Ordering::AcqRel) && !trial {
            return;
        }
        let check = LimitCheck {
            hits: 0,
            refund: false,
            record: false,
            stop_over: false,
            admin_limit: None,
            window: None,
            lease: None,
            ..first.clone()
        };
        let breaker = self.breaker.clone();
        rt.spawn(async move {
            let r =
                tokio::time::timeout_at(due, breaker.inner.decide(std::slice::from_ref(&check)))
                    .await;
            let covered = breaker.covered.swap(0, Ordering::AcqRel).max(1);
            breaker.judging.store(false, Ordering::Release);
            match r {
                // The store answers: the caller was impatient. A trial cut short closes the
                // breaker; a normal call changes nothing (failures counted before it stand).
                Ok(Ok(_)) => {
                    if trial {
                        breaker.record(generation, true, false);
                    }
                }
                Ok(Err(e)) if !e.is_transient() => {
                    if trial {
                        breaker.record(generation, true, false);
                    }
                }
                Ok(Err(_)) | Err(_) => {
                    for _ in 0..covered {
                        breaker.record(generation, trial, true);
                    }
                }
            }
        });
    }
}

impl<S: CounterStore + 'static> CounterStore for CircuitBreaker<S> {
    fn decide<'a>(
        &'a self,
        checks: &'a [LimitCheck],
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        Box::pin(async move {
            // A call of candidate checks alone (`CANDIDATE_CONFIG`, decided apart from the
            // answer; candidates come last, so a first one means all): never a trial, never
            // counted, so trying a limit cannot open the breaker on the enforced calls.
            if checks.first().is_some_and(|c| c.candidate) {
                if !matches!(self.lock().state, State::Closed { .. }) {
                    return Err(self.reject());
                }
                return self.inner.decide(checks).await;
            }
            let (generation, trial) = match self.admit() {
                Permit::Reject => return Err(self.reject()),
                Permit::Normal(g) => (g, false),
                Permit::Trial(g) => (g, true),
            };
            let mut guard = CallGuard {
                breaker: self,
                checks,
                generation,
                trial,
                started: tokio::time::Instant::now(),
                done: false,
            };
            let result = self.inner.decide(checks).await;
            guard.done = true;
            let transient = result.as_ref().is_err_and(StoreError::is_transient);
            self.record(generation, trial, transient);
            result
        })
    }

    fn probe(&self) -> BoxFuture<'_, bool> {
        Box::pin(async move {
            let ok = self.inner.probe().await;
            if ok {
                let mut s = self.lock();
                // An answered PING closes an open breaker, but does not clear the failures
                // counted while closed: a Redis that answers PING yet runs scripts slower than
                // every caller's deadline must still open it.
                if !matches!(s.state, State::Closed { .. }) {
                    self.close(&mut s, "Redis answered the health probe");
                }
            }
            ok
        })
    }
}

impl<S: WriteBack + 'static> WriteBack for CircuitBreaker<S> {
    fn write_back<'a>(
        &'a self,
        checks: &'a [LimitCheck],
        token: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let (generation, trial) = match self.admit() {
                Permit::Reject => return Err(self.reject()),
                Permit::Normal(g) => (g, false),
                Permit::Trial(g) => (g, true),
            };
            let mut guard = CallGuard {
                breaker: self,
                checks,
                generation,
                trial,
                started: tokio::time::Instant::now(),
                done: false,
            };
            let result = self.inner.write_back(checks, token, ttl).await;
            guard.done = true;
            let transient = result.as_ref().is_err_and(StoreError::is_transient);
            self.record(generation, trial, transient);
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::config::Unit;
    use crate::store::fake::FakeStore;

    type Breaker = CircuitBreaker<Arc<FakeStore>>;

    /// A gated store with one permit per call up to the threshold already given, so calls
    /// until the breaker opens pass and the trial after that waits.
    fn setup_open_gate() -> (Arc<FakeStore>, Breaker, ManualClock) {
        let (store, breaker, clock) = setup(true);
        store.open(DEFAULT_FAILURE_THRESHOLD as usize);
        (store, breaker, clock)
    }

    /// What the store answers from now on.
    #[derive(Debug, Clone, Copy)]
    enum Mode {
        Ok,
        Transient,
        Permanent,
    }

    fn set(store: &FakeStore, m: Mode) {
        store.fail_with(match m {
            Mode::Ok => None,
            Mode::Transient => Some(StoreError::Transient("down".into())),
            Mode::Permanent => Some(StoreError::Permanent("NOPERM".into())),
        });
    }

    fn checks() -> Vec<LimitCheck> {
        let limit = crate::config::Limit::fixed(5, Unit::Minute);
        vec![LimitCheck::for_tests("d", "v", limit, 1)]
    }

    /// A breaker reporting to `signals` around a fake store (held at its gate when `gated`).
    fn setup_with(gated: bool, signals: &StoreSignals) -> (Arc<FakeStore>, Breaker, ManualClock) {
        let clock = ManualClock::new(Duration::from_secs(1_000));
        let c: Arc<dyn Clock> = Arc::new(clock.clone());
        let store = Arc::new(if gated {
            FakeStore::gated(Arc::clone(&c))
        } else {
            FakeStore::new(Arc::clone(&c))
        });
        let breaker =
            CircuitBreaker::new(store.clone(), BreakerSettings::default(), c).reporting_to(signals);
        (store, breaker, clock)
    }

    fn setup(gated: bool) -> (Arc<FakeStore>, Breaker, ManualClock) {
        setup_with(gated, &StoreSignals::new("memory"))
    }

    async fn fail_until_open(store: &FakeStore, breaker: &Breaker) {
        set(store, Mode::Transient);
        for _ in 0..DEFAULT_FAILURE_THRESHOLD {
            let r = breaker.decide(&checks()).await;
            assert!(
                matches!(&r, Err(StoreError::Transient(m)) if m == "down"),
                "{r:?}"
            );
        }
        assert_eq!(breaker.state(), BreakerState::Open);
    }

    #[tokio::test]
    async fn opens_after_threshold_consecutive_transient_errors() {
        let (store, breaker, _clock) = setup(false);
        assert!(breaker.decide(&checks()).await.is_ok());
        set(&store, Mode::Transient);
        for _ in 0..DEFAULT_FAILURE_THRESHOLD - 1 {
            assert!(breaker.decide(&checks()).await.is_err());
            assert_eq!(breaker.state(), BreakerState::Closed);
        }
        // A success in between resets the count.
        set(&store, Mode::Ok);
        assert!(breaker.decide(&checks()).await.is_ok());
        set(&store, Mode::Transient);
        for _ in 0..DEFAULT_FAILURE_THRESHOLD - 1 {
            assert!(breaker.decide(&checks()).await.is_err());
        }
        assert_eq!(breaker.state(), BreakerState::Closed);
        assert!(breaker.decide(&checks()).await.is_err());
        assert_eq!(breaker.state(), BreakerState::Open);

        // Open: fails fast without calling the store.
        let before = store.calls();
        for _ in 0..10 {
            match breaker.decide(&checks()).await {
                Err(StoreError::Transient(m)) => assert!(m.contains("circuit open"), "{m}"),
                other => panic!("expected fail-fast, got {other:?}"),
            }
        }
        assert_eq!(store.calls(), before);
    }

    #[tokio::test]
    async fn permanent_errors_do_not_open_it() {
        let (store, breaker, _clock) = setup(false);
        set(&store, Mode::Permanent);
        for _ in 0..10 {
            assert!(matches!(
                breaker.decide(&checks()).await,
                Err(StoreError::Permanent(_))
            ));
        }
        assert_eq!(breaker.state(), BreakerState::Closed);
        // And they prove Redis is up: two transient errors, a permanent one, two more: closed.
        set(&store, Mode::Transient);
        for _ in 0..2 {
            let _ = breaker.decide(&checks()).await;
        }
        set(&store, Mode::Permanent);
        let _ = breaker.decide(&checks()).await;
        set(&store, Mode::Transient);
        for _ in 0..2 {
            let _ = breaker.decide(&checks()).await;
        }
        assert_eq!(breaker.state(), BreakerState::Closed);
        assert_eq!(store.calls(), 15);
    }

    #[tokio::test]
    async fn half_open_lets_one_call_through_then_closes_or_reopens() {
        let (store, breaker, clock) = setup(false);
        fail_until_open(&store, &breaker).await;
        let calls = store.calls();

        // Not yet time.
        clock.advance(DEFAULT_OPEN_FOR - Duration::from_millis(1));
        assert!(breaker.decide(&checks()).await.is_err());
        assert_eq!(store.calls(), calls);

        // Time: one trial, still failing -> open again, for another full period.
        clock.advance(Duration::from_millis(1));
        assert!(matches!(
            breaker.decide(&checks()).await,
            Err(StoreError::Transient(m)) if m == "down"
        ));
        assert_eq!(store.calls(), calls + 1);
        assert_eq!(breaker.state(), BreakerState::Open);
        clock.advance(DEFAULT_OPEN_FOR / 2);
        assert!(breaker.decide(&checks()).await.is_err());
        assert_eq!(store.calls(), calls + 1);

        // Redis is back: the next trial succeeds and closes the breaker.
        set(&store, Mode::Ok);
        clock.advance(DEFAULT_OPEN_FOR);
        assert!(breaker.decide(&checks()).await.is_ok());
        assert_eq!(breaker.state(), BreakerState::Closed);
        assert!(breaker.decide(&checks()).await.is_ok());
        assert_eq!(store.calls(), calls + 3);
    }

    #[tokio::test]
    async fn concurrent_callers_fail_fast_while_the_trial_runs() {
        let (store, breaker, clock) = setup_open_gate();
        let breaker = Arc::new(breaker);
        fail_until_open(&store, &breaker).await;
        set(&store, Mode::Ok);
        clock.advance(DEFAULT_OPEN_FOR);

        let b = Arc::clone(&breaker);
        let before = store.calls();
        let trial = tokio::spawn(async move { b.decide(&checks()).await.map(|d| d.admitted) });
        store.wait_calls(before + 1).await;
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
        let calls = store.calls();
        for _ in 0..5 {
            assert!(breaker.decide(&checks()).await.is_err());
        }
        assert_eq!(store.calls(), calls, "no second call while half-open");

        store.open(1);
        assert!(trial.await.unwrap().unwrap());
        assert_eq!(breaker.state(), BreakerState::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_trial_reopens_it() {
        let (store, breaker, clock) = setup_open_gate();
        fail_until_open(&store, &breaker).await;
        clock.advance(DEFAULT_OPEN_FOR);

        let b = breaker.clone();
        let before = store.calls();
        let trial = tokio::spawn(async move { b.decide(&checks()).await.is_ok() });
        store.wait_calls(before + 1).await;
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
        // Still down: it does not answer the judgement the dropped trial leads to either.
        trial.abort();
        assert!(trial.await.is_err());
        tokio::time::advance(BreakerSettings::default().patience).await;
        until(|| breaker.state() == BreakerState::Open).await;
        assert!(
            breaker.decide(&checks()).await.is_err(),
            "a trial cut short counts as a failure: open for another period"
        );

        // After it, the next call is a new trial.
        clock.advance(DEFAULT_OPEN_FOR);
        set(&store, Mode::Ok);
        store.open(1);
        assert!(breaker.decide(&checks()).await.is_ok());
        assert_eq!(breaker.state(), BreakerState::Closed);
    }

    #[tokio::test]
    async fn an_answered_probe_does_not_clear_failures_counted_while_closed() {
        // Redis answers PING but the scripts fail: the failures still add up to open it.
        let (store, breaker, _clock) = setup(false);
        store.set_probe(true);
        set(&store, Mode::Transient);
        for i in 0..DEFAULT_FAILURE_THRESHOLD {
            if i > 0 {
                assert!(breaker.probe().await);
                assert_eq!(breaker.state(), BreakerState::Closed);
            }
            assert!(breaker.decide(&checks()).await.is_err());
        }
        assert_eq!(breaker.state(), BreakerState::Open);
        // ...and an answered probe closes the open breaker.
        assert!(breaker.probe().await);
        assert_eq!(breaker.state(), BreakerState::Closed);
    }

    /// Yields until `cond` holds (the task a dropped call leaves behind has run).
    async fn until(cond: impl Fn() -> bool) {
        for _ in 0..1000 {
            if cond() {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("condition never held");
    }

    /// Starts a call on `breaker` and drops it once it reached the store (its caller's
    /// deadline).
    async fn dropped_call(store: &FakeStore, breaker: &Breaker) {
        let b = breaker.clone();
        let before = store.calls();
        let call = tokio::spawn(async move { b.decide(&checks()).await.is_ok() });
        store.wait_calls(before + 1).await;
        call.abort();
        assert!(call.await.is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn calls_dropped_unfinished_count_as_failures() {
        // A store that never answers (nor the judgement of a dropped call, a check on the same
        // counter): every call is cut by its caller.
        let (store, breaker, _clock) = setup(true);
        for i in 0..DEFAULT_FAILURE_THRESHOLD {
            assert_eq!(breaker.state(), BreakerState::Closed, "call {i}");
            dropped_call(&store, &breaker).await;
            tokio::time::advance(BreakerSettings::default().patience).await;
            until(|| breaker.state() != BreakerState::Closed || !breaker.judging()).await;
        }
        assert_eq!(breaker.state(), BreakerState::Open);
        let before = store.calls();
        assert!(breaker.decide(&checks()).await.is_err());
        assert_eq!(
            store.calls(),
            before,
            "an open breaker does not wait on the store"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn calls_dropped_while_one_is_judged_count_by_its_verdict() {
        // The store never answers; three calls are cut before the first judgement ends: its
        // failure stands for all three, and the breaker opens.
        let (store, breaker, _clock) = setup(true);
        for _ in 0..DEFAULT_FAILURE_THRESHOLD {
            dropped_call(&store, &breaker).await;
        }
        assert!(breaker.judging());
        assert_eq!(breaker.state(), BreakerState::Closed);
        tokio::time::advance(BreakerSettings::default().patience).await;
        until(|| breaker.state() == BreakerState::Open).await;
    }

    #[tokio::test]
    async fn calls_their_callers_drop_on_a_live_store_never_open_it() {
        // A caller's 1 ms deadline cuts every call short; the store answers the judgement:
        // the breaker stays closed however many there are (issue 37: the caller's deadline is
        // not the store's failure).
        let (store, breaker, _clock) = setup(true);
        for i in 0..10 * DEFAULT_FAILURE_THRESHOLD {
            dropped_call(&store, &breaker).await;
            // The judgement: one check through the gate.
            store.open(1);
            until(|| !breaker.judging()).await;
            assert_eq!(
                breaker.state(),
                BreakerState::Closed,
                "after {} dropped calls",
                i + 1
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_dropped_after_the_store_timeout_is_a_failure() {
        // The store had its whole REDIS_TIMEOUT: its probe answering now does not excuse it.
        let (store, breaker, _clock) = setup(true);
        store.set_probe(true);
        for _ in 0..DEFAULT_FAILURE_THRESHOLD {
            let b = breaker.clone();
            let before = store.calls();
            let call = tokio::spawn(async move { b.decide(&checks()).await.is_ok() });
            store.wait_calls(before + 1).await;
            tokio::time::advance(BreakerSettings::default().patience).await;
            call.abort();
            assert!(call.await.is_err());
        }
        assert_eq!(breaker.state(), BreakerState::Open);
    }

    #[tokio::test]
    async fn a_slow_call_from_before_opening_does_not_close_it() {
        let (store, breaker, _clock) = setup(false);
        // A call is admitted while closed...
        let Permit::Normal(generation) = breaker.admit() else {
            panic!("closed admits")
        };
        // ...others fail and open the breaker while it is still in flight...
        fail_until_open(&store, &breaker).await;
        // ...and its late success does not close it (nor does a late failure count).
        breaker.record(generation, false, false);
        assert_eq!(breaker.state(), BreakerState::Open);
        breaker.record(generation, false, true);
        assert_eq!(breaker.state(), BreakerState::Open);
    }

    #[tokio::test]
    async fn a_successful_probe_closes_it_and_health_follows() {
        let signals = StoreSignals::new("redis");
        let (store, breaker, _clock) = setup_with(false, &signals);
        assert!(signals.healthy());
        fail_until_open(&store, &breaker).await;
        assert_eq!(signals.breaker_state(), Some(BreakerState::Open));
        assert!(!signals.healthy());

        store.set_probe(false);
        assert!(!breaker.probe().await);
        assert_eq!(breaker.state(), BreakerState::Open);

        store.set_probe(true);
        assert!(breaker.probe().await);
        assert_eq!(breaker.state(), BreakerState::Closed);
        assert!(signals.healthy());

        // Closed but the backend reports unhealthy: unhealthy.
        signals.set_health(false);
        assert!(!signals.healthy());
    }

    #[test]
    fn a_zero_threshold_means_one() {
        let store = FakeStore::new(Arc::new(ManualClock::default()));
        let b = CircuitBreaker::new(
            store,
            BreakerSettings {
                failure_threshold: 0,
                open_for: Duration::from_millis(10),
                ..BreakerSettings::default()
            },
            Arc::new(ManualClock::default()),
        );
        assert_eq!(b.settings().failure_threshold, 1);
        assert_eq!(b.state(), BreakerState::Closed);
    }
}
