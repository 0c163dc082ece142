//! One timer for every request waiting on the store. The layer must stop waiting at each
//! request's deadline, but a Tokio timer per request costs more than the rest of the layer: each
//! one registered ahead of the driver's next wake-up unparks a worker to re-arm it, and every
//! request is registered and cancelled although almost none fires. Here deadlines are rounded
//! down to the millisecond and queued; one task sleeps until the earliest and fires every
//! request due by then, so the timer is re-armed at most once a millisecond while requests wait,
//! and never while the service is idle. Rounding down answers locally up to 1 ms early, never
//! late.
//!
//! Bounded: only deadlines within `HORIZON` are queued and at most `MAX_QUEUED` at once (past
//! either, the caller falls back to its own timer), so a caller's hour-long `grpc-timeout`
//! never keeps an entry alive for an hour.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

/// Deadlines further away than this get their own timer.
const HORIZON: Duration = Duration::from_secs(2);
/// Entries queued at once (each a few dozen bytes); past it, callers get their own timer.
const MAX_QUEUED: usize = 1 << 17;

/// The queue and the task that fires it. Dropping it stops the task.
#[derive(Debug)]
pub struct Alarms {
    shared: Arc<Queue>,
    task: tokio::task::AbortHandle,
}

#[derive(Debug)]
struct Queue {
    /// Milliseconds since `base` → the requests due then.
    due: Mutex<BTreeMap<u64, Vec<oneshot::Sender<()>>>>,
    queued: AtomicUsize,
    /// Times the task woke to ring (what the pruning saves is visible in tests).
    wakes: AtomicUsize,
    /// Wakes the task when a deadline earlier than every queued one arrives.
    sooner: Notify,
    base: Instant,
}

/// What a request awaits: fires at (or up to 1 ms before) its deadline.
pub enum Alarm {
    Queued(oneshot::Receiver<()>),
    Own(tokio::time::Sleep),
}

impl Alarm {
    /// Resolves when the deadline has come.
    pub async fn ring(self) {
        match self {
            // A dropped sender (the queue went away) counts as due: never wait forever.
            Alarm::Queued(rx) => {
                let _ = rx.await;
            }
            Alarm::Own(sleep) => sleep.await,
        }
    }
}

impl Alarms {
    /// Starts the task. Must run inside a Tokio runtime.
    pub fn start() -> Self {
        let shared = Arc::new(Queue {
            due: Mutex::new(BTreeMap::new()),
            queued: AtomicUsize::new(0),
            wakes: AtomicUsize::new(0),
            sooner: Notify::new(),
            base: Instant::now(),
        });
        let task = tokio::spawn(fire(Arc::clone(&shared))).abort_handle();
        Self { shared, task }
    }

    /// An alarm for `at`.
    pub fn at(&self, at: Instant) -> Alarm {
        let q = &self.shared;
        let now = Instant::now();
        if at <= now {
            return Alarm::Own(tokio::time::sleep_until(at));
        }
        if at - now > HORIZON || q.queued.load(Ordering::Relaxed) >= MAX_QUEUED {
            return Alarm::Own(tokio::time::sleep_until(at));
        }
        let tick = q.tick_of(at);
        let (tx, rx) = oneshot::channel();
        let sooner = {
            let mut due = q.due.lock().unwrap_or_else(|e| e.into_inner());
            let sooner = due.first_key_value().is_none_or(|(&first, _)| tick < first);
            due.entry(tick).or_default().push(tx);
            sooner
        };
        q.queued.fetch_add(1, Ordering::Relaxed);
        if sooner {
            q.sooner.notify_one();
        }
        Alarm::Queued(rx)
    }
}

impl Drop for Alarms {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Queue {
    /// The millisecond `at` falls in (rounded down: an alarm may ring early, never late).
    fn tick_of(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.base).as_millis()).unwrap_or(u64::MAX)
    }

    fn instant_of(&self, tick: u64) -> Instant {
        self.base + Duration::from_millis(tick)
    }

    /// Drops the entries of requests already answered from the front of the queue and returns
    /// the earliest tick with a request still waiting. Almost every request is answered long
    /// before its deadline: without this the task would wake once a millisecond under load to
    /// ring nobody; with it, it sleeps until the oldest request still waiting is due (about a
    /// deadline's length, less the store's answer time). Each entry is looked at once here.
    fn prune_answered(&self) -> Option<u64> {
        let mut due = self.due.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let mut first = due.first_entry()?;
            let waiting = first.get_mut();
            let before = waiting.len();
            waiting.retain(|tx| !tx.is_closed());
            self.queued
                .fetch_sub(before - waiting.len(), Ordering::Relaxed);
            if !waiting.is_empty() {
                return Some(*first.key());
            }
            first.remove();
        }
    }
}

/// Sleeps until the earliest queued tick (or until a sooner one is queued) and fires every
/// request due by then.
async fn fire(q: Arc<Queue>) {
    loop {
        let first = q.prune_answered();
        let Some(first) = first else {
            q.sooner.notified().await;
            continue;
        };
        let now_tick = q.tick_of(Instant::now());
        if first > now_tick {
            tokio::select! {
                () = tokio::time::sleep_until(q.instant_of(first)) => {}
                () = q.sooner.notified() => continue,
            }
        }
        let now_tick = q.tick_of(Instant::now());
        let fired = {
            let mut due = q.due.lock().unwrap_or_else(|e| e.into_inner());
            let later = due.split_off(&now_tick.saturating_add(1));
            std::mem::replace(&mut *due, later)
        };
        q.wakes.fetch_add(1, Ordering::Relaxed);
        for tx in fired.into_values().flatten() {
            q.queued.fetch_sub(1, Ordering::Relaxed);
            // The request was answered already (its receiver dropped): nothing to ring.
            let _ = tx.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn each_alarm_rings_at_its_deadline_and_not_before_its_millisecond() {
        let alarms = Alarms::start();
        let t0 = Instant::now();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        // Out of order, one beyond the horizon, one already due.
        for ms in [30u64, 10, 20, 10, 5000, 0] {
            let alarm = alarms.at(t0 + Duration::from_millis(ms));
            let order = Arc::clone(&order);
            tasks.push(tokio::spawn(async move {
                alarm.ring().await;
                let waited = Instant::now() - t0;
                order.lock().unwrap().push((ms, waited));
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let order = order.lock().unwrap().clone();
        assert_eq!(
            order.iter().map(|(ms, _)| *ms).collect::<Vec<_>>(),
            vec![0, 10, 10, 20, 30, 5000]
        );
        for (ms, waited) in order {
            let want = Duration::from_millis(ms);
            assert!(
                waited <= want && want - waited < Duration::from_millis(1),
                "{ms} ms rang after {waited:?}"
            );
        }
        assert_eq!(alarms.shared.queued.load(Ordering::Relaxed), 0);
        assert!(alarms.shared.due.lock().unwrap().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_sooner_deadline_wakes_the_task_that_sleeps_for_a_later_one() {
        let alarms = Alarms::start();
        let t0 = Instant::now();
        let late = alarms.at(t0 + Duration::from_millis(1000));
        // Let the task go to sleep for the 1 s deadline first.
        tokio::task::yield_now().await;
        let soon = alarms.at(t0 + Duration::from_millis(3));
        soon.ring().await;
        assert!(Instant::now() - t0 <= Duration::from_millis(3));
        late.ring().await;
        assert!(Instant::now() - t0 >= Duration::from_millis(999));
    }

    #[tokio::test(start_paused = true)]
    async fn an_answered_request_leaves_nothing_behind_once_its_tick_passes() {
        let alarms = Alarms::start();
        let t0 = Instant::now();
        for _ in 0..100 {
            drop(alarms.at(t0 + Duration::from_millis(7)));
        }
        assert_eq!(alarms.shared.queued.load(Ordering::Relaxed), 100);
        alarms.at(t0 + Duration::from_millis(8)).ring().await;
        assert_eq!(alarms.shared.queued.load(Ordering::Relaxed), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn answered_requests_never_wake_the_task() {
        let alarms = Alarms::start();
        let t0 = Instant::now();
        // A millisecond's worth of requests for each of 10 ms, all answered but the last one.
        for ms in 1..=10u64 {
            for _ in 0..100 {
                drop(alarms.at(t0 + Duration::from_millis(ms)));
            }
        }
        let last = alarms.at(t0 + Duration::from_millis(10));
        assert_eq!(alarms.shared.queued.load(Ordering::Relaxed), 1001);
        last.ring().await;
        assert!(Instant::now() - t0 >= Duration::from_millis(9));
        // One wake-up, for the one request still waiting: not one per millisecond queued.
        assert_eq!(alarms.shared.wakes.load(Ordering::Relaxed), 1);
        assert_eq!(alarms.shared.queued.load(Ordering::Relaxed), 0);
    }
}
