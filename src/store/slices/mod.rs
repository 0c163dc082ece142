//! Leased limits (`leased:` on a descriptor): each replica spends *slices* of a hot limit's
//! current window, reserved from the store, and decides that limit locally while its slice
//! lasts. A grant is an ordinary charge of the slice's size on the limit's own counter, so the
//! store never grants more than is left: however many replicas spend slices, the total admitted
//! in a window never exceeds the limit (a slice unspent at the window's end is the only loss).
//!
//! Why a layer over the [`Decider`]: the leased checks of a request are taken from the slices
//! first; only the rest (the per-consumer limits below a leased resource) go down to the store,
//! in the one call the request makes. So a resource + consumer request on a leased resource
//! costs the consumer's counter alone, on its own hash tag, and an API-wide leased limit costs
//! the store one call per slice.
//!
//! - **Never over.** Grants and returns are decisions on the counter itself, pinned to the
//!   window the slice belongs to (`LimitCheck::window`), so a slice returned late never lands in
//!   the next window. Decisions that are not sliced on the same counter (a refund, a check-only
//!   request, an operator's override, a quota-mode or `stop_over` check) go to the store as
//!   they always did and see what the slices took.
//! - **Slices adapt.** A grant asks for the replica's demand over `ahead` (its rate since the
//!   last grant), at most `max_slice`, at most a quarter of what the store had left at the last
//!   grant (slices shrink as the window fills), at least the request's hits. At a window's end a
//!   replica holds at most its last grant unspent: stranded quota per window ≤ Σ over replicas of
//!   their last grant ≤ replicas × `max_slice`.
//! - **Refills ahead.** Below half of its last grant a slice is refilled in the background; a
//!   request that finds it empty waits for the refill in flight (one per slice: the requests
//!   queue on its gate and find the slice filled), never a second call.
//! - **Counting.** Under envoyproxy counting a leased check is charged whatever the other checks
//!   say (as a recorded hit); under `all_or_nothing` a request another limit denies gives its
//!   units back to the slice. A request the slices deny is not sent to the store, except for its
//!   recording checks (charged whatever the verdict).
//! - **Token buckets.** A leased token bucket's slice is a batch of its tokens (an ordinary
//!   charge of that many on the one bucket, given back as a refund): no window to pin, so its
//!   slices never end ([`UNPINNED`]); they go back when idle, evicted or at shutdown.
//! - **Bounded.** At most `max_counters` slices are held; a new one evicts the least recently
//!   used (its unspent units go back to the store). On shutdown every slice goes back.
//! - **Outage.** A grant that fails sends the check down as an ordinary one: the stack's failure
//!   mode decides it (under `FAILURE_MODE=local`, its local layer). What a slice holds is spent
//!   through an outage without the store.

mod admin;
mod decider;
mod slice;
mod take;

pub use decider::SlicedDecider;

use super::{CounterKey, CounterStore, LimitCheck, Tally};
use crate::clock::Clock;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Slices one replica holds at most by default (`LEASED_MAX_COUNTERS`).
pub const DEFAULT_MAX_SLICES: usize = 10_000;

/// What the slices report (`sluice_slice_*`).
#[derive(Debug, Default)]
pub struct SliceTallies {
    /// Grants the store answered (script calls made for slices).
    pub grants: Tally,
    /// Units granted.
    pub granted: Tally,
    /// Units given back (a denied all-or-nothing request is not counted: it stays local).
    pub returned: Tally,
    /// Units left unspent in slices whose window ended.
    pub stranded: Tally,
    /// Requests that waited on a refill.
    pub waited: Tally,
    /// Slices evicted to make room.
    pub evictions: Tally,
    /// Slices held now.
    pub held: std::sync::atomic::AtomicU64,
}

/// One replica's slice of one counter's window.
#[derive(Debug)]
struct Slice {
    /// The window `[start, end)` in Unix microseconds the units belong to.
    window: (u64, u64),
    /// Units this replica may still spend.
    left: u64,
    /// What the store had left after the last grant (for `remaining`, and to shrink grants).
    store_left: u64,
    /// The last grant's size (the refill-ahead mark is half of it).
    last_grant: u64,
    /// Units spent since the last grant, and when it was made (the replica's rate).
    spent: u64,
    since_us: u64,
    /// The store had nothing left at the last grant: no refill until `retry_us`.
    dry_until_us: u64,
    /// That dry spell is a global limit's region cut off from home (its grant denied for want
    /// of home): the denials it gives are a fallback's, as the decision log marks them.
    cut_off: bool,
    /// A token bucket's: when it would be full again, as of the last grant (its `reset`).
    full_at_us: u64,
    /// Where the slice's refill is.
    refill: Refill,
    /// For eviction.
    touched_us: u64,
    /// A global limit's: the next window's pool was asked to be filled ahead (once per window,
    /// in its last seconds: `take.rs`).
    next_ahead: bool,
    /// A global limit's: the last reset record its units count after (the pool's `cleared`
    /// at its last grant): a reset's clear up to it leaves the slice whole (`admin.rs`).
    cleared: u64,
}

/// Where a slice's refill is: one runs at a time, and a failed one makes the next request short
/// of units go down to the store (`unreachable`) instead of starting another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refill {
    /// None runs; the last one (if any) got its answer.
    Idle,
    /// One runs; requests short of units wait for it.
    Running,
    /// The last one failed (the store did not answer): the next request short of units takes
    /// the store's answer, and the slice is idle again.
    Failed,
}

/// A counter's slice, and the signal its refill sends when done (one refill in flight at a
/// time; every request short of units waits for that one). A waiter judges the wake-up by the
/// slice's state ([`Entry::settled_for`]): a refill of a window that has passed settles nothing
/// of the next.
#[derive(Debug)]
struct Entry {
    slice: Mutex<Slice>,
    done: tokio::sync::watch::Sender<u64>,
    /// A global limit's: granted by the region's pool (`store/global`), not the store.
    global: bool,
}

type Slot = CounterKey;

/// The slices of one replica, over the store that grants them.
#[derive(Debug)]
pub struct Slices {
    store: Arc<dyn CounterStore>,
    /// What grants a global limit's slices: the region's pool of the home counter.
    global: Option<Arc<dyn CounterStore>>,
    /// The home store itself: a global limit's checks that are not taken from slices (a
    /// refund, a check-only request, an override, ...) are decided there, on the one global
    /// counter, never on a regional one.
    home: Option<Arc<dyn CounterStore>>,
    clock: Arc<dyn Clock>,
    map: Mutex<HashMap<Slot, Arc<Entry>>>,
    max: usize,
    /// `FAILURE_MODE=local`: a slice is all a replica may spend while the store does not
    /// answer (a check whose grant fails is denied here, not decided by the local layer).
    outage_denies: bool,
    /// When the last sweep ran (µs): idle slices go back, ended windows are dropped.
    last_sweep_us: std::sync::atomic::AtomicU64,
    /// Where refills and give-backs run: the runtime the slices were built on, never the
    /// serving thread of the request that started them (it ends at shutdown, cancelling them).
    background: super::Background,
    pub tallies: Arc<SliceTallies>,
}

/// A slice untouched this long (µs) goes back to the store at the next sweep: its replica's
/// demand moved elsewhere, another replica may spend it.
const IDLE_US: u64 = 1_000_000;
/// Slices one eviction looks at.
const EVICT_SAMPLE: usize = 16;

/// Whether a check is decided from a slice (see the module docs for what is not).
pub(super) fn sliced(c: &LimitCheck) -> bool {
    c.slice.is_some()
        && c.hits > 0
        && !c.refund
        && !c.quota
        && !c.stop_over
        // An admin override on a global limit is sliced too, its grants judged at home on the
        // override (`store/global/admin.rs`): decided at home, each request would wait on it.
        && (c.admin_limit.is_none() || c.slice.is_some_and(|t| t.global))
        && c.lease.is_none()
        && !c.key.overridden
        && slice_window(c).is_some()
}

/// A global limit's check not decided from a slice: decided at home, on the one global
/// counter (a regional counter of the same key would be a limit per region).
pub(super) fn global_elsewhere(c: &LimitCheck) -> bool {
    c.slice.is_some_and(|t| t.global) && !sliced(c)
}

/// The "window" of a token bucket's slices: it has none (its tokens are taken from and given
/// back to the one bucket, whenever), so its slices never end and are never stranded.
const UNPINNED: (u64, u64) = (0, u64::MAX);

/// The window a check's slice belongs to: a leased fixed window's, pinned by the plan; every
/// token bucket's slices share [`UNPINNED`].
fn slice_window(c: &LimitCheck) -> Option<(u64, u64)> {
    match c.key.limit.algorithm {
        crate::config::Algorithm::TokenBucket => Some(UNPINNED),
        _ => c.window,
    }
}

impl Slices {
    /// At most `max` slices; `outage_denies` under `FAILURE_MODE=local`.
    pub fn new(
        store: Arc<dyn CounterStore>,
        clock: Arc<dyn Clock>,
        terms: (usize, bool),
    ) -> Arc<Self> {
        Self::granted_by(store, None, clock, terms)
    }

    /// The home store, when global limits have one.
    pub fn home(&self) -> Option<&Arc<dyn CounterStore>> {
        self.home.as_ref()
    }

    /// [`Slices::new`] with global limits' slices granted by `global`'s first (the region's
    /// pool of the home counter, `store/global`), their other checks decided by its second
    /// (the home store).
    pub fn granted_by(
        store: Arc<dyn CounterStore>,
        global: Option<(Arc<dyn CounterStore>, Arc<dyn CounterStore>)>,
        clock: Arc<dyn Clock>,
        (max, outage_denies): (usize, bool),
    ) -> Arc<Self> {
        let sweeps = global.is_some();
        let (global, home) = global.unzip();
        let me = Arc::new(Self {
            store,
            global,
            home,
            clock,
            map: Mutex::new(HashMap::new()),
            max: max.max(1),
            outage_denies,
            last_sweep_us: std::sync::atomic::AtomicU64::new(0),
            background: super::Background::here(),
            tallies: Arc::default(),
        });
        if sweeps {
            me.sweep_in_background();
        }
        me
    }

    /// With global limits: a sweep every second even when no request comes, so a replica whose
    /// demand stopped gives its slices back to the region's pool (and the pool, once idle,
    /// goes back home) instead of holding them to the window's end.
    fn sweep_in_background(self: &Arc<Self>) {
        let me = Arc::downgrade(self);
        self.background.spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_micros(IDLE_US)).await;
                let Some(me) = me.upgrade() else { break };
                let now = me.now_us();
                me.sweep_if_due(now);
            }
        });
    }

    /// The store that grants (and takes back) `entry`'s units: a global limit's only from the
    /// region's pool (`None` without one: never from a regional counter).
    fn grants(&self, global: bool) -> Option<&Arc<dyn CounterStore>> {
        match (&self.global, global) {
            (Some(g), true) => Some(g),
            (None, true) => None,
            _ => Some(&self.store),
        }
    }

    /// At most once a second: slices idle for [`IDLE_US`] go back to the store, slices of
    /// ended windows are dropped (their units stranded). One pass over at most `max` slices.
    pub(super) fn sweep_if_due(&self, now: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let last = self.last_sweep_us.load(Relaxed);
        if now < last.saturating_add(1_000_000)
            || self
                .last_sweep_us
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_err()
        {
            return;
        }
        self.sweep(now);
    }

    /// After a reload or an xDS push: a changed limit is a new counter, so the old one's slices
    /// go idle; one sweep once they are idle gives them back, even when no leased request comes
    /// to run it (the limit was removed, or its traffic stopped).
    pub fn sweep_once_idle(self: &Arc<Self>) {
        let me = Arc::clone(self);
        self.background.spawn(async move {
            tokio::time::sleep(Duration::from_micros(IDLE_US + 100_000)).await;
            let now = me.now_us();
            me.last_sweep_us
                .fetch_max(now, std::sync::atomic::Ordering::Relaxed);
            me.sweep(now);
        });
    }

    fn sweep(&self, now: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let mut back = Vec::new();
        {
            let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
            map.retain(|key, e| {
                let s = e.slice.lock().unwrap_or_else(|p| p.into_inner());
                if s.window.1 <= now {
                    self.tallies.stranded.add(s.left);
                    return false;
                }
                let idle =
                    now.saturating_sub(s.touched_us) >= IDLE_US && s.refill != Refill::Running;
                if idle {
                    back.push((key.clone(), Arc::clone(e)));
                }
                !idle
            });
            self.tallies.held.store(map.len() as u64, Relaxed);
        }
        for (key, e) in back {
            self.give_back_later(&key, &e);
        }
    }

    /// A check whose slice could not be refilled (the store did not answer, or not in time).
    fn unreachable(&self, entry: &Arc<Entry>) -> Take {
        if !self.outage_denies {
            return Take::Down;
        }
        let s = entry.slice.lock().unwrap_or_else(|p| p.into_inner());
        Take::Done(Taken {
            outage: true,
            ..s.taken(entry, false)
        })
    }

    pub(super) fn now_us(&self) -> u64 {
        u64::try_from(self.clock.now().as_micros()).unwrap_or(u64::MAX)
    }

    /// The entry of `check`'s counter in its window, created (evicting one if full) if new.
    fn entry(&self, check: &LimitCheck, window: (u64, u64), now: u64) -> Arc<Entry> {
        let global = check.slice.is_some_and(|t| t.global);
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = map.get(&check.key) {
            if e.global == global {
                return Arc::clone(e);
            }
            // A reload moved the limit between `leased` and `global` (the same counter key):
            // its units go back where they came from, and the slice starts over from the
            // other grants.
            if let Some(old) = map.remove(&check.key) {
                self.give_back_later(&check.key, &old);
            }
        }
        let slot = check.key.clone();
        if map.len() >= self.max {
            self.evict(&mut map, now);
        }
        let e = Arc::new(Entry {
            slice: Mutex::new(Slice::fresh(window, now)),
            done: tokio::sync::watch::Sender::new(0),
            global,
        });
        map.insert(slot, Arc::clone(&e));
        self.tallies
            .held
            .store(map.len() as u64, std::sync::atomic::Ordering::Relaxed);
        e
    }

    /// Makes room for one slice: of up to [`EVICT_SAMPLE`] slices, the least recently used
    /// goes (an ended window's units are stranded, a live one's go back). Bounded work per new
    /// slice, whatever a caller's values make of the map (ended windows are also dropped by
    /// the sweep).
    fn evict(&self, map: &mut HashMap<Slot, Arc<Entry>>, now: u64) {
        let oldest = map
            .iter()
            .take(EVICT_SAMPLE)
            .map(|(slot, e)| {
                let s = e.slice.lock().unwrap_or_else(|p| p.into_inner());
                let ended = s.window.1 <= now;
                (slot, if ended { 0 } else { s.touched_us.max(1) })
            })
            .min_by_key(|(_, t)| *t)
            .map(|(slot, _)| slot.clone());
        let Some(slot) = oldest else {
            return;
        };
        if let Some(e) = map.remove(&slot) {
            let ended = e.slice.lock().unwrap_or_else(|p| p.into_inner()).window.1 <= now;
            if ended {
                let left =
                    std::mem::take(&mut e.slice.lock().unwrap_or_else(|p| p.into_inner()).left);
                self.tallies.stranded.add(left);
            } else {
                self.tallies.evictions.add(1);
                self.give_back_later(&slot, &e);
            }
        }
    }

    /// Returns an evicted slice's units in the background.
    fn give_back_later(&self, key: &CounterKey, e: &Arc<Entry>) {
        let (left, window) = {
            let mut s = e.slice.lock().unwrap_or_else(|p| p.into_inner());
            (std::mem::take(&mut s.left), s.window)
        };
        if left == 0 {
            return;
        }
        let Some(store) = self.grants(e.global).map(Arc::clone) else {
            return;
        };
        let check = grant_check(key, window, left, true);
        let returned = self.tallies.returned.clone();
        self.background.spawn(async move {
            if store.decide(std::slice::from_ref(&check)).await.is_ok() {
                returned.add(left);
            }
        });
    }

    /// Units this replica holds unspent in slices of the window that contains `at`.
    pub fn held_in(&self, at: Duration) -> u64 {
        let at = u64::try_from(at.as_micros()).unwrap_or(u64::MAX);
        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.values()
            .map(|e| {
                let s = e.slice.lock().unwrap_or_else(|p| p.into_inner());
                if s.window.0 <= at && at < s.window.1 {
                    s.left
                } else {
                    0
                }
            })
            .sum()
    }

    /// Gives every slice's unspent units back to the store (a replica that stops): the other
    /// replicas can spend them. Returns the units given back.
    pub async fn give_back_all(&self) -> u64 {
        let now = self.now_us();
        let mut entries: Vec<(Slot, Arc<Entry>)> = {
            let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
            map.drain().collect()
        };
        // Slices with no refill out go back first: a wait for one cut short by the caller's
        // bound then costs only the slices still waiting.
        entries.sort_by_cached_key(|(_, e)| {
            e.slice.lock().unwrap_or_else(|p| p.into_inner()).refill == Refill::Running
        });
        let mut total = 0;
        // One deadline for every refill still out, not one each (the caller bounds the whole
        // give-back more tightly still: SIGTERM's 2 s).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        for (key, e) in entries {
            // A refill still out lands in the slice first (what the store granted comes back).
            let pending = {
                let s = e.slice.lock().unwrap_or_else(|p| p.into_inner());
                (s.refill == Refill::Running).then(|| e.done.subscribe())
            };
            if let Some(mut rx) = pending {
                let window = e.slice.lock().unwrap_or_else(|p| p.into_inner()).window;
                let settled = async {
                    while rx.changed().await.is_ok() {
                        if e.settled_for(window) {
                            break;
                        }
                    }
                };
                let _ = tokio::time::timeout_at(deadline, settled).await;
            }
            let (left, window) = {
                let mut s = e.slice.lock().unwrap_or_else(|p| p.into_inner());
                (std::mem::take(&mut s.left), s.window)
            };
            if left == 0 || window.1 <= now {
                continue;
            }
            let check = grant_check(&key, window, left, true);
            let Some(grants) = self.grants(e.global) else {
                continue;
            };
            if grants.decide(std::slice::from_ref(&check)).await.is_ok() {
                self.tallies.returned.add(left);
                total += left;
            }
        }
        total
    }
}

/// The charge (or, `back`, the refund) of `hits` on `key`'s counter in `window`, as a grant or
/// a return makes it: an ordinary all-or-nothing charge, never cached as a denial (another
/// replica's return can give the counter room).
fn grant_check(key: &CounterKey, window: (u64, u64), hits: u64, back: bool) -> LimitCheck {
    charge_check(key, (window != UNPINNED).then_some(window), hits, back)
}

/// [`grant_check`] with the window as the check carries it (`None`: a token bucket's).
pub(crate) fn charge_check(
    key: &CounterKey,
    window: Option<(u64, u64)>,
    hits: u64,
    back: bool,
) -> LimitCheck {
    LimitCheck {
        key: key.clone(),
        hits,
        refund: back,
        shadow: false,
        quota: false,
        record: false,
        stop_over: false,
        admin_limit: None,
        window,
        lease: None,
        leased: true,
        slice: None,
        candidate: false,
    }
}

/// What taking a check's hits from its slice came to.
#[derive(Debug)]
pub(super) struct Taken {
    entry: Arc<Entry>,
    allowed: bool,
    /// This replica's units left plus what the store had left at the last grant.
    remaining: u64,
    window_end: u64,
    /// When the answer's limit resets, and (denied) when to retry, in Unix µs.
    reset_at: u64,
    retry_at: u64,
    /// Denied because the store did not answer a refill (`FAILURE_MODE=local`): a fallback's
    /// answer, as the decision log marks it (never compared by a replay).
    outage: bool,
}

/// How a check fared against its slice: decided, or sent down as an ordinary check (its
/// grant failed, did not come in time, or the window moved under it).
pub(super) enum Take {
    Done(Taken),
    Down,
}
