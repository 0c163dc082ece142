//! Counter stores. One async [`CounterStore`] trait decides a whole request at once (every limit
//! that applies to it), atomically, by one charging rule ([`charged`]): all or nothing, except
//! checks that record usage (envoyproxy counting, `record_usage`), charged whatever the verdict.
//! The memory
//! store (`memory`) and the Redis store (`redis`) implement it with the same algorithm math; the
//! circuit breaker (`breaker`) and the deny cache (`local_cache`) are wrappers generic over the
//! store they wrap. The contract is two methods; what the layers and the metrics need besides
//! (health, breaker state, running totals, denial finality) is handed over when the stack is
//! built ([`StoreSignals`], [`DenialFinality`]).

pub mod admin;
mod background;
pub mod breaker;
mod chain;
pub mod demand;
#[cfg(any(test, feature = "test-util"))]
pub mod fake;
pub mod fallback;
pub mod global;
pub mod lease_effect;
pub mod local_cache;
pub mod memory;
pub mod redis;
mod signals;
pub mod slices;

mod admission;
pub use admission::{charged, enforced_len, Admission};
pub use background::Background;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

pub use crate::algorithm::Outcome;
use crate::algorithm::{LimitParams, Mode};
use crate::config::{Limit, Reservations};
pub use chain::{LocalChain, StoreChain};
pub use lease_effect::{LeaseChange, LeaseEffect};
pub use signals::{DenialFinality, LocalTallies, StoreSignals, Tally};

/// A boxed future, so the trait stays object safe (`Arc<dyn CounterStore>`).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Identity of one counter: the domain, the descriptor entries that select it (with the wildcard
/// pattern in place of the value under `share_threshold`; only the path down to the node for a
/// resource limit), and the limit itself (quota, period, algorithm, burst), so a changed limit
/// or an Envoy `limit` override never reuses a counter kept for another limit.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CounterKey {
    pub domain: Arc<str>,
    /// Shared: the checks of one descriptor share one list, and cloning a check (the plan
    /// hands the store its own copy) costs no allocation.
    pub entries: Arc<[(String, String)]>,
    pub limit: Limit,
    /// True when the limit came from the request's `limit` override.
    pub overridden: bool,
    /// The domain's `hash_tag: domain`: the Redis hash tag is the domain alone, so every counter
    /// of the domain shares one Cluster slot (one atomic call per request, on one node).
    pub domain_tag: bool,
    /// The counter's Redis hash tag is its own entries, not the descriptor's first entry: a
    /// limit below a leased resource is decided apart from the resource (`store/slices`), so it
    /// spreads over a Cluster's slots instead of sharing the resource's.
    pub own_tag: bool,
    /// A candidate limit's counter (`CANDIDATE_CONFIG`): kept apart from every enforced
    /// counter, so trying a limit never touches what is enforced.
    pub candidate: bool,
}

/// One limit to decide for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitCheck {
    pub key: CounterKey,
    /// Hits to charge; 0 checks without charging.
    pub hits: u64,
    /// Give `hits` back instead of charging them (Envoy's `is_negative_hits`).
    pub refund: bool,
    /// A shadow limit is evaluated and charged with the request but never denies it.
    pub shadow: bool,
    /// A quota-mode limit (envoyproxy's `quota_mode`): its denial alone does not deny the
    /// request; the request is denied when every quota limit of it denies (see [`Admission`]).
    /// A quota limit that denies is not charged, even when the request is admitted (unless it
    /// records usage).
    pub quota: bool,
    /// Recorded whatever the verdict (envoyproxy counting, or `record_usage: true`): the hits
    /// are charged even when they do not fit, on a denied request too, and the limit denies
    /// only when its count after them is above the limit. See [`charged`].
    pub record: bool,
    /// envoyproxy's `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT` (set on every check of such a
    /// request): if any recording check would exceed its limit, only those are charged.
    pub stop_over: bool,
    /// An operator's override (the admin API) of this counter's limit: the algorithms decide
    /// with this many instead of `key.limit`'s, on the same counter (the key keeps the
    /// configured limit, so the override applies mid-window to what was counted).
    pub admin_limit: Option<u32>,
    /// A calendar limit's window `[start, end)` in Unix microseconds, computed by the service
    /// from its clock (`config/calendar.rs`); `None`: windows aligned to the Unix epoch.
    pub window: Option<(u64, u64)>,
    /// On an `in_flight` limit or a rate limit with `reservations`: the request the
    /// descriptor's trailing id entry names, and whether this is its stream-done call (which
    /// frees the slot or settles the reservation) or its request-time call (which takes one or
    /// reserves `hits`). `None` on other limits, and on a descriptor that names no request
    /// (an `in_flight` check: allowed while a slot is free; a plain charge on a rate limit).
    pub lease: Option<LeaseCall>,
    /// The counter is an `in_flight` limit's or a rate limit's with `reservations`: another
    /// request's stream-done call can give it room at any moment, so its denials are never
    /// cached (whether or not this request names one).
    pub leased: bool,
    /// The limit's `leased` terms: decided from this replica's slice of the window when the
    /// stack has slices (`slices.rs`), else as any check.
    pub slice: Option<crate::config::Leasing>,
    /// A candidate limit's check (`CANDIDATE_CONFIG`): decided in the same store call as the
    /// request's enforced checks but as a request of its own ([`Admission`] and [`charged`]
    /// take the candidate checks apart), so it never changes the answer.
    /// A request's candidate checks come after all its enforced ones ([`enforced_len`]).
    pub candidate: bool,
}

/// A request's own entry on an `in_flight` limit or a rate limit with `reservations`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseCall {
    /// The request id (at most `MAX_LEASE_ID_BYTES`).
    pub id: Arc<str>,
    /// The stream-done call: frees the id's slot, or settles its reservation at the check's
    /// hits (never denied).
    pub release: bool,
    /// On a rate limit with `reservations`: its terms (`None` on an `in_flight` limit).
    pub reservations: Option<Reservations>,
}

impl LeaseCall {
    /// The reservation terms as the algorithm takes them, if this is a reservation.
    pub fn terms(&self) -> Option<crate::algorithm::Terms> {
        self.reservations.map(|r| crate::algorithm::Terms {
            lease_us: r.lease.millis().saturating_mul(1000),
            max: r.max,
        })
    }
}

impl LimitCheck {
    pub fn params(&self) -> LimitParams {
        let l = self.key.limit;
        // An override (`unlimited` included) never grows what the stores keep per admitted
        // request past what a config may: a sliding_log's entries, an in_flight's slots.
        let admin = self.admin_limit.map(|n| match l.algorithm {
            crate::config::Algorithm::SlidingLog => n.min(crate::config::MAX_SLIDING_LOG_LIMIT),
            crate::config::Algorithm::InFlight => n.min(crate::config::MAX_IN_FLIGHT),
            _ => n,
        });
        let (limit, burst) = match admin {
            None => (l.requests_per_unit, l.burst),
            // A token bucket's burst follows its rate in proportion.
            Some(n) if l.requests_per_unit > 0 => {
                let burst = u64::from(l.burst) * u64::from(n) / u64::from(l.requests_per_unit);
                (n, u32::try_from(burst).unwrap_or(u32::MAX))
            }
            Some(n) if l.algorithm == crate::config::Algorithm::TokenBucket => {
                (n, n.saturating_sub(1))
            }
            Some(n) => (n, 0),
        };
        let (period_us, window_start) = match self.window {
            Some((start, end)) if end > start => (end - start, Some(start)),
            _ => (l.period.millis().saturating_mul(1000), None),
        };
        LimitParams {
            limit,
            period_us,
            algorithm: l.algorithm,
            burst,
            window_start,
        }
    }

    pub fn mode(&self) -> Mode {
        if self.refund {
            Mode::Refund
        } else if self.record {
            Mode::Record
        } else {
            Mode::Charge
        }
    }
}

/// The verdict on a whole request: one outcome per check, in order, and whether the request was
/// admitted (by [`Admission`]) and therefore charged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Decision {
    pub admitted: bool,
    pub outcomes: Vec<Outcome>,
    /// Answered by the local deny cache, without asking the backing store.
    pub local: bool,
    /// Atomic steps the backend took: one script call per Cluster slot group, 1 on memory or
    /// standalone Redis, 0 when answered locally (for the trace span).
    pub steps: usize,
    /// When and by what it was decided, for the decision log (`decision_log`).
    pub at: DecidedAt,
    /// What each check did to its lease entries (see [`LeaseEffect`]): one per check when the
    /// request has an `in_flight` limit or a reservation, else empty (no allocation).
    pub leases: Vec<LeaseEffect>,
    /// The candidate checks (`CANDIDATE_CONFIG`) were not decided: their call failed apart
    /// from the enforced ones' (a Cluster request whose candidates live in another slot).
    /// Their outcomes mean nothing; the enforced answer stands.
    pub beside_lost: bool,
    /// The enforced answer needed no store call (the deny cache or leased slices gave it, or
    /// `FAILURE_MODE=local` stands between): the candidate checks were left out of it, for the
    /// service to decide apart, off the answer path. Their outcomes are absent.
    pub beside_apart: bool,
}

/// When a decision was made, as the decision log records it: a replay decides each request at
/// that instant and in that order, and leaves out what the store never decided.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DecidedAt {
    /// The store keeps its own time (Redis), or nothing was decided: the service's time is
    /// logged.
    #[default]
    Unknown,
    /// The memory store: its clock's reading (Unix µs) and its count of decisions, both taken
    /// under the locks of the counters it decided (so `seq` orders decisions of one counter
    /// made in the same microsecond).
    Store { us: u64, seq: u64 },
    /// `FAILURE_MODE=local`'s own store answered: the store was down or slow.
    Fallback,
}

/// Why a store could not decide.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// Worth retrying: the backend is down, slow or overloaded.
    #[error("counter store unavailable: {0}")]
    Transient(String),
    /// Retrying will not help: misconfiguration or a bug.
    #[error("counter store error: {0}")]
    Permanent(String),
    /// Part of a request was decided and charged, the rest failed (a Cluster request whose
    /// other slots' masters did not answer): what stays charged must not be charged again by
    /// whoever decides the request instead (review A3).
    #[error("{}", .0.cause)]
    Partial(Box<Partial>),
}

/// What a request that failed in part left in the store: per check, in the request's order.
#[derive(Debug, Clone)]
pub struct Partial {
    /// Why the rest failed (never itself `Partial`).
    pub cause: StoreError,
    /// Checks whose charge stays in the store (their slot answered; not undone).
    pub charged: Vec<bool>,
    /// Checks whose slot failed.
    pub failed: Vec<bool>,
}

impl StoreError {
    /// Worth retrying (a `Partial` failure is what its cause is).
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Transient(_) => true,
            StoreError::Permanent(_) => false,
            StoreError::Partial(p) => p.cause.is_transient(),
        }
    }

    /// Which checks stay charged in the store, if the request failed only in part.
    pub fn partial(&self) -> Option<&Partial> {
        match self {
            StoreError::Partial(p) => Some(p),
            _ => None,
        }
    }

    /// The same failure for a request of which `checks` were the `idx` checks of a larger one
    /// (a layer that sent only some checks down): the masks mapped back to the larger request.
    pub fn widened(self, idx: &[usize], len: usize) -> StoreError {
        match self {
            StoreError::Partial(p) => {
                let widen = |m: &[bool]| {
                    let mut out = vec![false; len];
                    for (&i, &b) in idx.iter().zip(m) {
                        if let Some(o) = out.get_mut(i) {
                            *o = b;
                        }
                    }
                    out
                };
                StoreError::Partial(Box::new(Partial {
                    charged: widen(&p.charged),
                    failed: widen(&p.failed),
                    cause: p.cause,
                }))
            }
            e => e,
        }
    }
}

#[cfg(any(test, feature = "test-util"))]
impl LimitCheck {
    /// Tests only (`test-util`): `hits` on the counter `domain` / `k=value` under `limit`, with
    /// no flags (not a refund, not shadow, not quota).
    pub fn for_tests(domain: &str, value: &str, limit: Limit, hits: u64) -> Self {
        LimitCheck {
            key: CounterKey {
                domain: Arc::from(domain),
                entries: Arc::from(vec![("k".to_string(), value.to_string())]),
                limit,
                overridden: false,
                domain_tag: false,
                own_tag: false,
                candidate: false,
            },
            hits,
            refund: false,
            shadow: false,
            quota: false,
            record: false,
            stop_over: false,
            admin_limit: None,
            window: None,
            lease: None,
            leased: false,
            slice: None,
            candidate: false,
        }
    }
}

/// A place where counters live: a backend (memory, Redis), or a layer wrapping another store
/// (the circuit breaker, the local deny cache). Two verbs: decide a request, probe the backend.
pub trait CounterStore: Send + Sync + std::fmt::Debug {
    /// Decides all `checks` of one request atomically: [`Admission`] says whether the request is
    /// admitted and [`charged`] which checks are written (all or nothing, except recording
    /// checks). Checks on the same counter see each other's hits.
    fn decide<'a>(
        &'a self,
        checks: &'a [LimitCheck],
    ) -> BoxFuture<'a, Result<Decision, StoreError>>;

    /// Contacts the backend (one cheap round trip) and returns whether it answered; the result
    /// also goes to the stack's health signal. Called periodically by the health task.
    fn probe(&self) -> BoxFuture<'_, bool>;

    /// A replica's slice of `check`'s counter was spent from in its window's last seconds: a
    /// global limit's next window's pool is filled ahead (`store/global`). Nothing elsewhere.
    fn ahead_of_window(&self, _check: &LimitCheck) {}

    /// A request found its replica's slice of `check`'s counter short and waits for a grant:
    /// demand the grants did not meet, which a global limit's refill is sized on
    /// (`store/global/ask.rs`: the pool gives out at most what it held). Nothing elsewhere.
    fn wanted(&self, _check: &LimitCheck) {}

    /// The reset record the units of this store's last grant of `check` count after (a global
    /// limit's pool: its `cleared`; else 0): a slice keeps them through that reset's clear.
    fn cleared(&self, _check: &LimitCheck) -> u64 {
        0
    }

    /// A home store's refund of units a region's pool drained, applied only if no reset fenced
    /// its counter past `cleared`, the pool's last clear ([`admin::CounterAdmin::reset_fenced`],
    /// read in the same call): never off the fresh count. `Ok(false)`: refused. A store that
    /// is never a home store (the embedded one) has no fences and applies it.
    fn refund_fenced<'a>(
        &'a self,
        check: &'a LimitCheck,
        _cleared: u64,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            self.decide(std::slice::from_ref(check)).await?;
            Ok(true)
        })
    }

    /// A home store's grant of a global limit's refill, capped in the same call at the region's
    /// max-min share ([`global::FairAsk`]); `Ok(None)`: it cannot (the caller caps it).
    fn grant_fair<'a>(
        &'a self,
        _check: &'a LimitCheck,
        _ask: &'a global::FairAsk,
    ) -> BoxFuture<'a, Result<Option<global::FairGrant>, StoreError>> {
        Box::pin(async { Ok(None) })
    }
}

impl<S: CounterStore + ?Sized> CounterStore for Arc<S> {
    fn refund_fenced<'a>(
        &'a self,
        check: &'a LimitCheck,
        cleared: u64,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        (**self).refund_fenced(check, cleared)
    }

    fn grant_fair<'a>(
        &'a self,
        check: &'a LimitCheck,
        ask: &'a global::FairAsk,
    ) -> BoxFuture<'a, Result<Option<global::FairGrant>, StoreError>> {
        (**self).grant_fair(check, ask)
    }

    fn decide<'a>(
        &'a self,
        checks: &'a [LimitCheck],
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        (**self).decide(checks)
    }

    fn probe(&self) -> BoxFuture<'_, bool> {
        (**self).probe()
    }

    fn ahead_of_window(&self, check: &LimitCheck) {
        (**self).ahead_of_window(check);
    }

    fn wanted(&self, check: &LimitCheck) {
        (**self).wanted(check);
    }

    fn cleared(&self, check: &LimitCheck) -> u64 {
        (**self).cleared(check)
    }
}

/// What `FAILURE_MODE=local`'s layer ([`fallback::LocalFallback`]) requires of the store under
/// it, and nobody else calls: charging usage decided elsewhere. Every check records its hits
/// (or gives them back), whatever the verdict, and a call with a `token` already applied
/// within `ttl` changes nothing, so a retry after a lost reply never charges twice. The layers
/// between (breaker, deny cache) pass it through.
pub trait WriteBack: CounterStore {
    fn write_back<'a>(
        &'a self,
        checks: &'a [LimitCheck],
        token: &'a str,
        ttl: std::time::Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
}

impl<S: WriteBack + ?Sized> WriteBack for Arc<S> {
    fn write_back<'a>(
        &'a self,
        checks: &'a [LimitCheck],
        token: &'a str,
        ttl: std::time::Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        (**self).write_back(checks, token, ttl)
    }
}

/// How the service asks a stack for a request's decision: with the caller's deadline. Only
/// `FAILURE_MODE=local`'s layer uses it (it answers in time itself, taking the checks so a call
/// that outlives its caller keeps them); every other stack decides as its store does
/// ([`Plain`]), and the caller's deadline cuts the call.
pub trait Decider: Send + Sync + std::fmt::Debug {
    fn decide_by(
        &self,
        checks: Vec<LimitCheck>,
        deadline: Option<tokio::time::Instant>,
    ) -> BoxFuture<'_, Result<Decision, StoreError>>;
}

/// A stack without a layer that answers in time: its store decides.
#[derive(Debug)]
pub struct Plain(pub Arc<dyn CounterStore>);

impl Decider for Plain {
    fn decide_by(
        &self,
        checks: Vec<LimitCheck>,
        _deadline: Option<tokio::time::Instant>,
    ) -> BoxFuture<'_, Result<Decision, StoreError>> {
        Box::pin(async move { self.0.decide(&checks).await })
    }
}

/// A built store stack: the store to decide with and the signals its parts report to.
#[derive(Debug, Clone)]
pub struct StoreStack {
    pub store: Arc<dyn CounterStore>,
    /// How the service decides a request: `store` itself ([`Plain`]), or the local layer.
    pub decider: Arc<dyn Decider>,
    pub signals: StoreSignals,
    /// The quota service's demand boards, in the same place as the counters.
    pub demand: Arc<dyn demand::DemandBoard>,
    /// The admin side of the counters (resets, overrides), in the same place as they.
    pub admin: Arc<dyn admin::CounterAdmin>,
    /// The local deny cache, when the stack has one (dropped after admin writes).
    pub forget: Option<Arc<dyn admin::Forget>>,
    /// This replica's slices of leased limits, when the stack decides them from slices.
    pub slices: Option<Arc<slices::Slices>>,
    /// Where the region's pools of global limits live: beside the counters.
    pub pool: Arc<dyn global::RegionPool>,
    /// The grants of global limits' slices (the pool, refilled from home), when a home store
    /// is set.
    pub global: Option<Arc<global::GlobalGrants>>,
}

impl StoreStack {
    /// `store` reporting to `signals` (which its parts were built with), with demand boards in
    /// this process (right for one replica; a Redis stack is built with its own).
    pub fn new(store: Arc<dyn CounterStore>, signals: StoreSignals) -> Self {
        Self {
            decider: Arc::new(Plain(Arc::clone(&store))),
            store,
            signals,
            demand: Arc::new(demand::MemoryBoard::default()),
            admin: Arc::new(admin::NoReset::default()),
            forget: None,
            slices: None,
            pool: Arc::new(global::MemoryPool::new(
                Arc::new(crate::clock::SystemClock),
                slices::DEFAULT_MAX_SLICES,
            )),
            global: None,
        }
    }

    /// The same stack with its region's pools in `pool`.
    pub fn with_pool(mut self, pool: Arc<dyn global::RegionPool>) -> Self {
        self.pool = pool;
        self
    }

    /// The same stack with global limits: their slices granted by the region's pool, refilled
    /// from `home` (the home store). Call before [`StoreStack::with_slices`].
    pub fn with_home(
        mut self,
        home: Arc<dyn CounterStore>,
        clock: Arc<dyn crate::clock::Clock>,
    ) -> Self {
        let grants = global::GlobalGrants::new(Arc::clone(&self.pool), home, clock);
        self.signals.global = Arc::clone(&grants.tallies);
        self.global = Some(grants);
        self
    }

    /// The same stack deciding leased limits from this replica's slices (at most `max` of
    /// them; `outage_denies` under `FAILURE_MODE=local`), granted by its store; its signals
    /// report them.
    pub fn with_slices(
        mut self,
        clock: Arc<dyn crate::clock::Clock>,
        terms: (usize, bool),
    ) -> Self {
        // Global limits' slices are granted by the region's pool (`store/global`).
        let global = self.global.as_ref().map(|g| {
            let grants = Arc::new(Arc::clone(g)) as Arc<dyn CounterStore>;
            (grants, Arc::clone(g.home()))
        });
        let slices = slices::Slices::granted_by(Arc::clone(&self.store), global, clock, terms);
        self.signals.slices = Arc::clone(&slices.tallies);
        self.decider = Arc::new(slices::SlicedDecider::new(
            Arc::clone(&slices),
            Arc::clone(&self.decider),
        ));
        self.slices = Some(slices);
        self
    }

    /// The same stack with `admin` for resets and overrides.
    pub fn with_admin(mut self, admin: Arc<dyn admin::CounterAdmin>) -> Self {
        self.admin = admin;
        self
    }

    /// The same stack with its deny cache named, to drop after admin writes.
    pub fn with_forget(mut self, forget: Arc<dyn admin::Forget>) -> Self {
        self.forget = Some(forget);
        self
    }

    /// The same stack deciding through `decider` (the local layer over `store`).
    pub fn with_decider(mut self, decider: Arc<dyn Decider>) -> Self {
        self.decider = decider;
        self
    }

    /// The same stack with `board` for demand boards.
    pub fn with_board(mut self, board: Arc<dyn demand::DemandBoard>) -> Self {
        self.demand = board;
        self
    }

    /// The embedded store on `clock`, holding at most `max_counters` counters.
    pub fn memory(clock: Arc<dyn crate::clock::Clock>, max_counters: usize) -> Self {
        let signals = StoreSignals::new("memory");
        let board = demand::MemoryBoard::new(Arc::clone(&clock), demand::DEFAULT_MAX_POSTINGS);
        let store = Arc::new(
            memory::MemoryStore::with_max_counters(Arc::clone(&clock), max_counters)
                .reporting_to(&signals),
        );
        let admin = Arc::new(memory::MemoryAdmin::new(Arc::clone(&store)));
        let pool = global::MemoryPool::new(Arc::clone(&clock), slices::DEFAULT_MAX_SLICES);
        Self::new(store, signals)
            .with_board(Arc::new(board))
            .with_admin(admin)
            .with_pool(Arc::new(pool))
    }
}
