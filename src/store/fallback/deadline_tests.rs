//! Deadlines are the caller's, suspicion is the store's (issue 37): a caller's short deadline
//! never marks a healthy store down, a long one never waits past the store's budget, and the
//! cool-downs run on the monotonic clock. On paused tokio time, with a gated store that answers
//! when the test opens it.

use super::*;
use crate::clock::ManualClock;
use crate::config::{Limit, Unit};
use crate::store::fake::FakeStore;

const T0: Duration = Duration::from_secs(60 * 1_000_000 + 5);
const MS: Duration = Duration::from_millis(1);

struct Rig {
    store: Arc<FakeStore>,
    layer: LocalFallback,
    signals: StoreSignals,
    clock: ManualClock,
}

fn rig() -> Rig {
    rig_with(LocalSettings::default())
}

fn rig_with(settings: LocalSettings) -> Rig {
    let clock = ManualClock::new(T0);
    let store = Arc::new(FakeStore::gated(Arc::new(clock.clone())));
    let signals = StoreSignals::new("test");
    let layer = LocalFallback::new(
        Arc::clone(&store) as Arc<dyn crate::store::WriteBack>,
        None,
        settings,
        Arc::new(clock.clone()),
        &signals,
    );
    Rig {
        store,
        layer,
        signals,
        clock,
    }
}

fn check() -> LimitCheck {
    LimitCheck::for_tests("d", "k", Limit::fixed(100, Unit::Minute), 1)
}

impl Rig {
    /// One request while the store fails: decided locally.
    async fn failed_one(&self) -> Decision {
        self.store
            .fail_with(Some(StoreError::Transient("down".into())));
        self.store.open(1);
        self.layer
            .decide_by(vec![check()], None)
            .await
            .expect("answered")
    }

    fn down(&self) -> bool {
        self.layer.shared.suspect()
    }

    fn deciding(&self) -> bool {
        self.signals.local.deciding.load(Ordering::Relaxed)
    }

    /// Starts a request with `deadline` from now; the store holds it until opened.
    fn start(
        &self,
        deadline: Option<Duration>,
    ) -> tokio::task::JoinHandle<Result<Decision, StoreError>> {
        let layer = self.layer.clone();
        let deadline = deadline.map(|d| Instant::now() + d);
        tokio::spawn(async move { layer.decide_by(vec![check()], deadline).await })
    }
}

/// A store that failed one request (decided locally: 1 owed on [`check`]) and is back (a probe
/// found it); no cool-down after a failure.
async fn owing_one_after_an_outage() -> Rig {
    let r = rig_with(LocalSettings {
        retry_every: Duration::ZERO,
        ..LocalSettings::default()
    });
    let d = r.failed_one().await;
    assert_eq!(d.steps, 0, "decided locally: 1 owed");
    r.store.fail_with(None);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!r.down(), "the store is back");
    r
}

async fn settle_tasks() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn an_impatient_caller_waits_on_the_store_and_never_marks_it_down() {
    let r = rig();
    for i in 0..20 {
        // 1 ms: under the 10 ms margin. The store answers 5 ms later, past the caller's
        // deadline but well inside its own budget.
        let call = r.start(Some(MS));
        r.store.wait_calls(i + 1).await;
        tokio::time::advance(5 * MS).await;
        r.store.open(1);
        let d = call.await.expect("task").expect("answered");
        assert!(
            d.steps > 0,
            "request {i} was decided by the store, not locally"
        );
        assert!(!r.down(), "a caller's deadline never marks the store down");
        assert!(!r.deciding(), "sluice_deciding_locally stays 0");
    }
    // The next requests are decided on the store, which counted all 20 before them.
    r.store.open(1);
    let d = r
        .layer
        .decide_by(vec![check()], None)
        .await
        .expect("answered");
    assert!(d.steps > 0);
    assert_eq!(d.outcomes[0].remaining, 100 - 21);
    assert_eq!(r.layer.owed(), 0, "nothing decided locally, nothing owed");
}

#[tokio::test(start_paused = true)]
async fn a_deadline_answers_locally_but_only_the_store_budget_suspects_the_store() {
    let r = rig();
    // 15 ms: decided locally at 5 ms (15 less the 10 ms margin) while the store is still asked.
    let call = r.start(Some(15 * MS));
    r.store.wait_calls(1).await;
    tokio::time::advance(6 * MS).await;
    let d = call.await.expect("task").expect("answered");
    assert_eq!(d.steps, 0, "answered locally before the caller's deadline");
    settle_tasks().await;
    assert!(
        !r.down(),
        "6 ms is the caller's time, not the store's failure"
    );
    // The store has not answered within its budget (100 ms): now it is suspected.
    tokio::time::advance(95 * MS).await;
    settle_tasks().await;
    assert!(
        r.down(),
        "no answer within REDIS_TIMEOUT is the store's failure"
    );
}

#[tokio::test(start_paused = true)]
async fn a_huge_deadline_waits_the_store_budget_not_the_patience() {
    let r = rig();
    let asked = Instant::now();
    let call = r.start(Some(Duration::from_secs(3600)));
    r.store.wait_calls(1).await;
    // (Paused time jumps to the next timer when all tasks wait: the answer's time is the
    // timer's, not the machine's.)
    let d = call.await.expect("task").expect("answered");
    let waited = asked.elapsed();
    assert!(
        waited <= LocalSettings::default().budget,
        "answered after {waited:?}: the store's budget (REDIS_TIMEOUT), not the caller's hour"
    );
    assert_eq!(
        d.steps, 0,
        "decided locally once the store's budget ran out"
    );
    assert!(r.down());
}

#[tokio::test(start_paused = true)]
async fn a_share_that_changes_mid_outage_keeps_the_local_count() {
    // Review A4: a roster change (a pod restarts, the first heartbeat) changes this replica's
    // share; it must decide on what it already admitted, not on a fresh counter.
    let r = rig();
    r.store
        .fail_with(Some(StoreError::Transient("down".into())));
    r.store.open(100);
    r.layer.set_roster(Roster {
        replicas: 2,
        rank: Some(0),
    });
    let c = || LimitCheck::for_tests("d", "k", Limit::fixed(10, Unit::Minute), 1);
    let mut admitted = 0;
    for _ in 0..8 {
        let d = r.layer.decide_by(vec![c()], None).await.expect("answered");
        admitted += usize::from(d.admitted);
    }
    assert_eq!(admitted, 5, "a share of 5 of 10 on 2 replicas");
    // A third replica joins: this one's share is now 4 of 10, of which it has admitted 5.
    r.layer.set_roster(Roster {
        replicas: 3,
        rank: Some(0),
    });
    let d = r.layer.decide_by(vec![c()], None).await.expect("answered");
    assert!(!d.admitted, "the local counter kept its 5");
}

#[tokio::test(start_paused = true)]
async fn in_flight_slots_taken_locally_owe_the_store_nothing() {
    // Slots are not written back (docs/semantics.md): booking them would send a no-op guarded
    // call per counter and keep the episode open (review A13).
    let r = rig();
    r.store
        .fail_with(Some(StoreError::Transient("down".into())));
    let limit = Limit {
        requests_per_unit: 3,
        period: crate::config::Period::from_millis(5_000).expect("5 s"),
        algorithm: crate::config::Algorithm::InFlight,
        burst: 0,
    };
    let mut take = LimitCheck::for_tests("d", "slots", limit, 1);
    take.lease = Some(crate::store::LeaseCall {
        id: Arc::from("r1"),
        release: false,
        reservations: None,
    });
    r.store.open(1);
    let d = r.layer.decide_by(vec![take], None).await.expect("answered");
    assert_eq!(d.steps, 0, "decided locally");
    assert!(d.admitted);
    assert_eq!(r.layer.owed(), 0, "a slot is no debt");
}

#[tokio::test(start_paused = true)]
async fn the_cool_down_runs_on_the_monotonic_clock_not_the_wall_clock() {
    let r = rig();
    let d = r.failed_one().await;
    assert_eq!(d.steps, 0);
    assert!(r.down());
    // NTP steps the wall clock back an hour; the store heals.
    r.clock.set(T0 - Duration::from_secs(3600));
    r.store.fail_with(None);
    r.store.set_probe(true);
    tokio::time::advance(LocalSettings::default().retry_every + MS).await;
    r.layer.probe_now().await;
    assert!(
        !r.down(),
        "the probe ran after retry_every of monotonic time, whatever the wall clock did"
    );
}

/// Counts heartbeats (a roster of one).
#[derive(Debug, Default)]
struct Beats(std::sync::atomic::AtomicUsize);

impl Membership for Beats {
    fn beat<'a>(
        &'a self,
        _id: &'a str,
        _lease: Duration,
    ) -> BoxFuture<'a, Result<Roster, StoreError>> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Box::pin(async {
            Ok(Roster {
                replicas: 1,
                rank: Some(0),
            })
        })
    }
}

/// Review B2: heartbeats run on their own. A Cluster's write-back pass held by masters that hang
/// (each of 50 write-backs waits its whole 100 ms budget: a 5 s pass) must not delay them past the
/// 3 s lease, or the other replicas drop this one from their roster and take larger shares.
#[tokio::test(start_paused = true)]
async fn heartbeats_never_wait_behind_the_write_back_pass() {
    let clock = ManualClock::new(T0);
    let store = Arc::new(FakeStore::gated(Arc::new(clock.clone())));
    let beats = Arc::new(Beats::default());
    let signals = StoreSignals::new("test");
    let layer = LocalFallback::new(
        Arc::clone(&store) as Arc<dyn crate::store::WriteBack>,
        Some(Arc::clone(&beats) as Arc<dyn Membership>),
        LocalSettings {
            // Cluster: a write-back that fails suspects its slot, and the pass goes on.
            whole_store: false,
            ..LocalSettings::default()
        },
        Arc::new(clock.clone()),
        &signals,
    );
    for i in 0..50 {
        let c = LimitCheck::for_tests("d", &format!("k{i}"), Limit::fixed(100, Unit::Minute), 1);
        let d = layer.decide_by(vec![c], None).await.expect("answered");
        assert_eq!(d.steps, 0, "decided locally");
    }
    assert!(layer.owed() >= 50, "50 counters owed");
    // The store holds every call.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = beats.0.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(6)).await;
    let beaten = beats.0.load(Ordering::Relaxed) - before;
    assert!(
        beaten >= 5,
        "{beaten} heartbeats in 6 s while the write-backs hung (lease: 3 s)"
    );
}

/// Review B3: a request that first settles its counters' debts (two write-backs, 95 ms of the
/// 100 ms budget) and whose own call then answers 10 ms later (past its caller's time, well
/// inside the store's budget) is decided locally, but the store is not marked down: only a
/// call that ran the store's whole budget says the store hangs.
#[tokio::test(start_paused = true)]
async fn write_backs_before_a_call_never_count_against_the_stores_budget() {
    let r = rig_with(LocalSettings {
        retry_every: Duration::ZERO,
        ..LocalSettings::default()
    });
    let k = |v: &str| LimitCheck::for_tests("d", v, Limit::fixed(100, Unit::Minute), 1);
    // Debts on k1 and k2: decided locally while the store fails.
    r.store
        .fail_with(Some(StoreError::Transient("down".into())));
    r.store.open(1); // the first call fails; the second request skips the store
    for v in ["k1", "k2"] {
        let d = r.layer.decide_by(vec![k(v)], None).await.expect("answered");
        assert_eq!(d.steps, 0);
    }
    r.store.fail_with(None);
    // A probe finds it back (it answers probes at once).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!r.down(), "the store is back");
    assert_eq!(r.layer.owed(), 2, "k1 and k2 owed");
    let calls = r.store.calls();
    let store = Arc::clone(&r.store);
    tokio::spawn(async move {
        for (wait, n) in [(50, 1), (45, 2), (10, 3)] {
            tokio::time::sleep(wait * MS).await;
            store.wait_calls(calls + n).await;
            store.open(1);
        }
    });
    let d = r
        .layer
        .decide_by(vec![k("k1"), k("k2")], None)
        .await
        .expect("answered");
    assert_eq!(d.steps, 0, "out of time: decided locally");
    assert!(
        !r.down(),
        "the store answered every call within its own budget: it is not down"
    );
}

/// Review B4: while one request writes a counter's debt back, another request on the same
/// counter waits for that write-back (within its own time) instead of deciding locally and
/// owing more, so a hot key's episode ends once the store is back.
#[tokio::test(start_paused = true)]
async fn a_request_waits_for_its_counters_write_back_instead_of_deciding_locally() {
    let r = owing_one_after_an_outage().await;
    let calls = r.store.calls();
    // A settles the debt first (its write-back held 5 ms by the store), B arrives meanwhile.
    let a = r.start(None);
    r.store.wait_calls(calls + 1).await;
    let b = r.start(None);
    settle_tasks().await;
    tokio::time::sleep(5 * MS).await;
    r.store.open(3); // A's write-back, then A's and B's own calls
    let (a, b) = (a.await.expect("task"), b.await.expect("task"));
    let (a, b) = (a.expect("answered"), b.expect("answered"));
    assert!(a.steps > 0, "A decided by the store: {a:?}");
    assert!(
        b.steps > 0,
        "B waited for A's write-back and was decided by the store: {b:?}"
    );
    assert_eq!(r.layer.owed(), 0, "nothing owed: the episode can end");
    assert_eq!(
        b.outcomes[0].remaining.min(a.outcomes[0].remaining),
        100 - 3
    );
}

/// Review B7: a call the store charged in one fixed window whose answer arrives in the next is
/// taken off the debt of the window it was asked in, not off the next one (which would then be
/// written back a refund and under-count by the late hit).
#[tokio::test(start_paused = true)]
async fn a_late_answer_is_taken_off_the_window_it_was_asked_in() {
    let r = rig();
    // One second before the minute's end.
    let minute = 60_000_000u64;
    let now = T0.as_micros() as u64;
    r.clock.set(Duration::from_micros(
        now - now % minute + minute - 1_000_000,
    ));
    let call = r.start(Some(15 * MS));
    r.store.wait_calls(1).await;
    let d = call.await.expect("task").expect("answered");
    assert_eq!(d.steps, 0, "decided locally at its deadline: 1 owed");
    // The store answers once the next window has begun (the fake charges it there).
    r.clock.advance(Duration::from_secs(2));
    r.store.open(1);
    settle_tasks().await;
    r.store.open(2); // the write-back pass, if any, and the check below
    r.layer.write_back_now().await;
    let peek = LimitCheck { hits: 0, ..check() };
    let d = r.layer.decide_by(vec![peek], None).await.expect("answered");
    assert_eq!(
        d.outcomes[0].remaining, 99,
        "the one admitted request counted once in the new window, not refunded there"
    );
}

/// A request cancelled while it writes its counter's debt back (tonic drops the handler at the
/// caller's `grpc-timeout` or on RST_STREAM: Envoy's 20 ms on a busy machine) leaves no attempt
/// behind that never ends: the next request on the counter sends it again under its token and
/// is decided by the store, and nothing stays owed. (Before: every later request waited for the
/// dropped attempt, decided locally, and the debt stayed unwritten until the window closed.)
#[tokio::test(start_paused = true)]
async fn a_write_back_whose_caller_went_away_is_sent_again() {
    let r = owing_one_after_an_outage().await;
    let calls = r.store.calls();
    // A's write-back reaches the store and is held there; A's caller goes away.
    let a = r.start(None);
    r.store.wait_calls(calls + 1).await;
    a.abort();
    assert!(a.await.is_err_and(|e| e.is_cancelled()), "A was cancelled");
    // B: the write-back again (the held one never answers), then its own call.
    r.store.open(2);
    let b = r.start(None);
    let b = b.await.expect("task").expect("answered");
    assert!(b.steps > 0, "B decided by the store: {b:?}");
    assert_eq!(r.layer.owed(), 0, "nothing owed: the episode can end");
    assert!(!r.deciding(), "the episode ended");
}
