//! What one refill asks of home, and how much: the region's demand over
//! [`POOL_AHEAD_MS`](super::POOL_AHEAD_MS), at least the slices asked for, at most the
//! region's max-min share (`fair.rs`) and, while the board lists no other region holding or
//! taking units (a fresh report), a quarter of what home had left (so the regions share the
//! window's tail); and, when home has less than asked, what it has left. A region whose demand
//! rose (or moved to it from another region: `moved.rs`) takes its refills as fast as they
//! land: once it took as many units as its last refill brought since that refill asked home
//! (less than a second before), and the board lists another region holding or taking units,
//! its rate is read from then, and the next refill takes what the others leave. With the same
//! board, a refill asks at least what the replica's requests waited for while the pool was dry
//! (`wanted`: the pool gives out at most what it held), and a board read goes beside each
//! refill while the pool is dry near a dry home, so the next refill sees a fall another region
//! reported half a round trip sooner; and home caps the refill at the region's share as the
//! reports at home have it when the refill arrives (`fair.rs`, [`fair::FairAsk`]), so a
//! region's refill takes what another region left as that region reports it, not a refill
//! later (`tests/cases/global_moved_model.rs`).

use super::fair::{self, share_left};
use super::{grant_check, Asked, GlobalGrants, Known, PoolState, MIN_REFILL_SLICES, POOL_AHEAD_MS};
use crate::store::LimitCheck;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

/// A region that took all of its last refill since that refill asked reads its rate from then,
/// over at least this long (ms), not over a second (`GlobalGrants::want`).
const FAST_SPAN_MS: u64 = 250;

impl GlobalGrants {
    /// One refill's grant from home: `want` (the first of the pair, capped at home at the
    /// region's share with `fair`; else the second, capped on this replica's board), or what
    /// home has left when less (a second call), or nothing (home is dry for `ahead`, or the
    /// region's share is spent for [`fair::FAIR_RETRY_MS`]). `asked_at` is the pool's clock and
    /// `taken` as it asks, kept when a call to home is made.
    pub(super) async fn ask_home(
        &self,
        check: &LimitCheck,
        (uncapped, capped): (u64, u64),
        (home_left, asked_at): (u64, (u64, u64)),
        fair: Option<&fair::FairAsk>,
    ) -> Asked {
        let mut out = Asked {
            got: 0,
            dry_ms: 0,
            home_left,
            failed: None,
            asked_at: (0, 0),
            capped: false,
            fence: 0,
        };
        let mut ask = if fair.is_some() { uncapped } else { capped };
        for _ in 0..2 {
            let mut grant = grant_check(&check.key, check.window, ask, false);
            // Judged on the admin override in force (`admin.rs`), as the request would be.
            grant.admin_limit = check.admin_limit;
            let answer = match fair {
                Some(f) => self.home.grant_fair(&grant, f).await,
                None => Ok(None),
            };
            let answer = match answer {
                Ok(Some(g)) => Ok(g),
                // A home that cannot cap (none of ours in production): this replica's board's.
                Ok(None) => {
                    ask = ask.min(capped);
                    let Some(r) = self.grant_capped(&mut grant, ask).await else {
                        out.capped = true;
                        out.dry_ms = fair::FAIR_RETRY_MS;
                        break;
                    };
                    r
                }
                Err(e) => Err(e),
            };
            out.asked_at = asked_at;
            let g = match answer {
                Ok(g) => g,
                Err(e) => {
                    out.failed = Some(e);
                    break;
                }
            };
            let Some(o) = g.outcome else {
                break; // no answer for the grant: nothing granted, nothing known
            };
            out.home_left = u64::from(o.remaining);
            out.capped |= g.hits < ask;
            out.fence = out.fence.max(g.fence);
            let left = u64::from(o.remaining);
            if g.hits == 0 {
                // Over its share at home: the others' units (nothing charged). Dry a moment,
                // then it asks again; as long as `ahead` when home has nothing left at all.
                out.dry_ms = if left == 0 {
                    check.slice.map_or(100, |t| t.ahead.millis()).max(1)
                } else {
                    fair::FAIR_RETRY_MS
                };
                break;
            }
            if o.allowed {
                out.got = g.hits;
                break;
            }
            // Home has less than asked: the region takes what is left (a request too large for
            // it is denied, the others go on); only an empty home makes the pool dry.
            if left == 0 || o.retry_after == Duration::MAX {
                out.dry_ms = check.slice.map_or(100, |t| t.ahead.millis()).max(1);
                break;
            }
            ask = left.min(g.hits);
        }
        out
    }

    /// A grant of at most `cap` units, capped on this replica's board (a home that cannot cap
    /// at home); `None`: the board's share is spent, nothing was asked.
    async fn grant_capped(
        &self,
        grant: &mut LimitCheck,
        cap: u64,
    ) -> Option<Result<fair::FairGrant, crate::store::StoreError>> {
        grant.hits = grant.hits.min(cap);
        if grant.hits == 0 {
            return None;
        }
        let hits = grant.hits;
        let d = self.home.decide(std::slice::from_ref(grant)).await;
        Some(d.map(|d| fair::FairGrant {
            hits,
            outcome: d.outcomes.first().copied(),
            fence: 0,
        }))
    }

    /// One refill's ask of home, sized (`want`) on the region's demand and its max-min share,
    /// with the other regions' board read first if this replica has none for the window yet;
    /// the region marked short at home when it gets less than its demand.
    pub(super) async fn sized_ask(
        self: &Arc<Self>,
        check: &LimitCheck,
        k: &Known,
        lock: &PoolState,
        (need, begun): (u64, bool),
    ) -> Asked {
        let (key, window_ms) = (&check.key, super::window_ms(check.window));
        let floor = check
            .slice
            .map_or(1, |t| u64::from(t.max_slice))
            .saturating_mul(MIN_REFILL_SLICES);
        if begun {
            self.boards_before(check, k).await;
        }
        // Known again after the board's round trip: the requests that waited meanwhile count.
        let k = &self.known(key, check.window);
        let sized = self.want(check, k, lock, need);
        let want = sized.want;
        // Demand not met is counted afresh from this ask (what came in since the snapshot
        // `k` was taken stays, from now).
        let now = self.now_ms();
        self.update(key, window_ms, |kn| {
            kn.wanted = kn.wanted.saturating_sub(k.wanted);
            kn.wanted_ms = if kn.wanted > 0 { now } else { 0 };
        });
        let started = tokio::time::Instant::now();
        let fair_ask = self.fair_ask(check, lock);
        let asked = if let Some(f) = &fair_ask {
            // Capped at home, on the reports as home has them when the refill arrives: a
            // region whose demand fell reported it (and gave its units back) meanwhile, and
            // what it left is this refill's, not the next one's. Sent even when this
            // replica's board says the share is spent: home's may say otherwise.
            let at = (k.home_left, (lock.now, lock.taken));
            self.ask_home(check, (sized.uncapped, want), at, Some(f))
                .await
        } else if want == 0 {
            // Over its max-min share (`fair.rs`): home's units are the other regions'. The
            // pool is dry a moment; the report after it reads the board again.
            Asked {
                got: 0,
                dry_ms: fair::FAIR_RETRY_MS,
                home_left: k.home_left,
                failed: None,
                asked_at: (0, 0),
                capped: false,
                fence: 0,
            }
        } else {
            let at = (k.home_left, (lock.now, lock.taken));
            self.ask_home(check, (want, want), at, None).await
        };
        // Short: it asked home for less than its demand, or got less than it asked (capped at
        // home, or home had less). Capped at home, what it asked is `uncapped` (the board's
        // share did not lower it).
        let asked_for = if fair_ask.is_some() {
            sized.uncapped
        } else {
            want
        };
        let short = asked.failed.is_none()
            && (asked_for < sized.wanted || asked.got < asked_for || asked.capped);
        if short {
            self.mark_short(key, check.window); // `moved.rs`: idle pools elsewhere come home
        }
        self.update(key, window_ms, |k| {
            k.demand = super::regions::Demand {
                per_ks: sized.per_ks,
                short,
            };
            k.floor = floor;
        });
        if asked.failed.is_none() && asked.asked_at != (0, 0) {
            // Answered refills only: the panel divides by them.
            let rtt = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
            self.tallies.refill_us.add(rtt);
            self.tallies.last_refill_us.store(rtt, Relaxed);
        }
        asked
    }

    /// The board a refill of `check` is sized on: read first when this replica has none fresh
    /// (`board_for`), and beside the refill while requests wait for it.
    async fn boards_before(self: &Arc<Self>, check: &LimitCheck, k: &Known) {
        let (key, window_ms) = (&check.key, super::window_ms(check.window));
        self.board_for(check).await;
        // Requests waited since the last refill asked: the region is short, and its next
        // refill is sized on the board as home has it when this one arrives there, half a
        // round trip after any read before it (a region whose demand fell reports it as it
        // gives its pool back: read only with this refill's report, after it lands, that
        // report reached the next refill but one, a round trip later). Not instead of the
        // read before a refill (`board_for`): a first refill sent without it (the board
        // read beside) landed before the board, and the next was sized on none, a quarter
        // of home (a region offered four times another's took 12 400 of 30 000).
        // Even right after a read before the refill (that board is half a round trip older
        // than home when this refill arrives there); only near a dry home (where demand
        // moving matters) or at this replica's first refill in the window: one more home
        // call per refill there, none while the limit is far.
        let first = k.home_left == u64::MAX;
        if (k.wanted > 0 || k.starved) && (first || self.near_dry(key, window_ms)) {
            let (me, key) = (Arc::clone(self), key.clone());
            self.background
                .spawn(async move { me.read_board(&key, window_ms).await });
        }
    }

    /// The next refill's size: the region's demand over [`POOL_AHEAD_MS`], at least `need` and
    /// [`MIN_REFILL_SLICES`] slices; at most the region's max-min share of the window left
    /// (`fair.rs`, from the other regions' last reports: capped again at home when home can)
    /// and, unless those list another region holding or taking units, a quarter of what home
    /// had left. Also the demand (a refill asking less is short: `moved.rs`), for the report.
    pub(super) fn want(&self, check: &LimitCheck, k: &Known, pool: &PoolState, need: u64) -> Want {
        let slice = check.slice.map_or(1, |t| u64::from(t.max_slice));
        let floor = slice.saturating_mul(MIN_REFILL_SLICES);
        let fair = self.fair_share(check, pool);
        // The board lists another region holding or taking units: its share caps this refill.
        let checked = matches!(fair, Some((_, busy)) if busy > 0);
        let (demand, per_ks) = if k.at_ms == 0 || pool.now <= k.at_ms {
            (floor.saturating_mul(2), 0)
        } else {
            let taken = u128::from(pool.taken.saturating_sub(k.taken_at));
            // A rate read over less than a second is noise (a burst of slices taken at once):
            // a refill right after another must not size itself on a millisecond.
            let elapsed = u128::from((pool.now - k.at_ms).max(1_000));
            // Unless the region took all of this replica's last refill (and at least
            // [`MIN_REFILL_SLICES`] slices) since that refill asked home: it takes its refills
            // as fast as they land (demand that rose, or moved to it), and its rate is read
            // from then (over [`FAST_SPAN_MS`] at least). Over a second it would read as one
            // refill a second, and its refills would grow by that much per round trip. A burst
            // of slices taken at once, less than a refill, is still read over a second. Only
            // with the others' shares on the board (`checked`): before they report (a window's
            // start), nothing but the quarter rule would cap refills grown that fast.
            let since = u128::from(pool.taken.saturating_sub(k.taken_asked));
            let span = u128::from(pool.now.saturating_sub(k.asked_ms).max(FAST_SPAN_MS));
            let whole = u128::from(k.last_refill.max(floor));
            let fast =
                checked && k.asked_ms > 0 && k.last_refill > 0 && since >= whole && span < elapsed;
            let per = |ms: u128| {
                let slow = taken * ms / elapsed;
                let rate = if fast {
                    slow.max(since * ms / span)
                } else {
                    slow
                };
                u64::try_from(rate).unwrap_or(u64::MAX)
            };
            (per(u128::from(POOL_AHEAD_MS)), per(1_000_000))
        };
        let demand = if checked {
            demand.max(self.waited(k))
        } else {
            demand
        };
        let per_ks = reported(check, k, pool, per_ks);
        // A quarter of what home had left, unless a fresh board lists another region holding
        // or taking units: its
        // max-min share (`fair.rs`) then holds the others' claims, and a region whose demand
        // rose takes what the others leave in one refill (demand that moved: `moved.rs`). An
        // empty or stale board is no evidence that no other region takes units (each region's
        // first refill in a window, before any report of the window, reads an empty board).
        let quarter = if checked || k.home_left == u64::MAX {
            u64::MAX
        } else {
            k.home_left.div_ceil(4)
        };
        let wanted = demand.max(floor).max(need).max(1);
        let uncapped = wanted.min(quarter).max(need).max(1);
        let mut want = uncapped;
        if let Some((left, _)) = fair {
            // Over its share: nothing, not even `need` (the others' units).
            want = want.min(left);
        }
        self.trace_sized(
            check,
            (want, uncapped, wanted),
            (pool.have, k.home_left),
            fair,
        );
        Want {
            want,
            uncapped,
            wanted,
            per_ks,
        }
    }

    /// The demand this replica's waiting requests say: what they waited for since the last
    /// refill asked, over [`POOL_AHEAD_MS`] (read over [`FAST_SPAN_MS`] at least). The pool
    /// gives out at most what it held, so a region whose demand rose past its refills (or
    /// moved to it) reads as taking only those; its waiting requests say what it asks. C, idle
    /// until demand moved to it, read its refills
    /// (40 units each) as its demand and took what home had left in three round trips,
    /// not one (`tests/cases/global_moved_model.rs`). Only with the others' shares on the
    /// board (`checked`), as the fast rate above: before they report (a window's start),
    /// only the quarter rule would cap it, and a region offered four times another's
    /// took a quarter of home at its second refill, another at its third, past its share
    /// (12 400 of a 30 000 that three regions each wanted more than a third of).
    fn waited(&self, k: &Known) -> u64 {
        if k.wanted == 0 {
            return 0;
        }
        let span = self.now_ms().saturating_sub(k.wanted_ms).max(FAST_SPAN_MS);
        let unmet = u128::from(k.wanted) * u128::from(POOL_AHEAD_MS) / u128::from(span);
        u64::try_from(unmet).unwrap_or(u64::MAX)
    }

    /// What home caps this region's refill of `check` by (`fair.rs`): who asks and what it
    /// was granted; `None` without a window that ends (a token bucket) or a board to report to.
    fn fair_ask(&self, check: &LimitCheck, pool: &PoolState) -> Option<fair::FairAsk> {
        let (_, end) = check.window?;
        let r = self.reporting.get()?;
        (end != u64::MAX).then(|| fair::FairAsk {
            region: r.region.clone(),
            mine: pool.have,
            end_ms: end / 1000,
        })
    }

    /// This region's max-min share of `check`'s window still to be granted, and how many other
    /// regions the board lists holding units or taking them; `None` when no board was read in
    /// the window in the last
    /// [`FRESH_MS`](super::fair::FRESH_MS), or the limit has no window (a token bucket).
    fn fair_share(&self, check: &LimitCheck, pool: &PoolState) -> Option<(u64, usize)> {
        let (start, end) = check.window?;
        if end == u64::MAX {
            return None;
        }
        let w = super::window_ms(check.window);
        let others = self
            .boards
            .get(&check.key, w, start / 1000, self.now_ms())?;
        let limit = check
            .admin_limit
            .unwrap_or(check.key.limit.requests_per_unit);
        let left = share_left(
            u64::from(limit),
            pool.have,
            &others,
            self.now_ms(),
            end / 1000,
        );
        // Reports that claim something, and fresh: an idle one (a pool given back, no rate)
        // says nothing of who takes units now, nor one older than `FRESH_MS` (its region may
        // be dead or cut off).
        let now = self.now_ms();
        let busy = others
            .iter()
            .filter(|r| now.saturating_sub(r.at_unix_ms) <= fair::FRESH_MS)
            .filter(|r| r.pool > 0 || r.demand.per_ks > 0 || r.demand.short)
            .count();
        Some((left, busy))
    }
}

impl GlobalGrants {
    /// A refill's size and the board it was sized on, at debug (`sluice::store::global::ask`).
    fn trace_sized(
        &self,
        check: &LimitCheck,
        (want, uncapped, wanted): (u64, u64, u64),
        (have, home_left): (u64, u64),
        fair: Option<(u64, usize)>,
    ) {
        tracing::debug!(
            want,
            uncapped,
            wanted,
            have,
            home_left,
            fair = ?fair,
            board = %self.board_text(check),
            "refill sized"
        );
    }

    /// The board a refill is sized on, for the debug log: `region:granted/per_ks/short@age_ms`.
    fn board_text(&self, check: &LimitCheck) -> String {
        let Some((start, _)) = check.window else {
            return String::new();
        };
        let (w, now) = (super::window_ms(check.window), self.now_ms());
        match self.boards.get(&check.key, w, start / 1000, now) {
            None => "none".into(),
            Some(all) => all
                .iter()
                .map(|r| {
                    format!(
                        "{}:{}/{}/{}@{}",
                        r.region,
                        r.pool.saturating_add(r.taken),
                        r.demand.per_ks,
                        u8::from(r.demand.short),
                        now.saturating_sub(r.at_unix_ms)
                    )
                })
                .collect::<Vec<_>>()
                .join(" "),
        }
    }
}

/// One refill's size, as [`GlobalGrants::want`] decides it.
pub(super) struct Want {
    pub want: u64,
    /// `want` before the share on this replica's board capped it: what a refill asks when
    /// home caps it at the share as the reports at home have it (`FairAsk`).
    pub uncapped: u64,
    /// The region's demand (at least `need` and the floor): a refill that asks less is short.
    pub wanted: u64,
    /// The region's rate, per 1 000 s (its demand, reported at home).
    pub per_ks: u64,
}

/// Reported at home: the region's rate over the window so far, or since this
/// replica's last refill when higher (a replica's first refill in a window has no
/// rate of its own; a region's demand that rose is seen from its last refill).
/// Early in a window, the rate of the window before (carried in `k.demand`) until
/// this one has its own.
fn reported(check: &LimitCheck, k: &Known, pool: &PoolState, per_ks: u64) -> u64 {
    check.window.map_or(per_ks, |(start, _)| {
        let into = pool.now.saturating_sub(start / 1000);
        let avg = u128::from(pool.taken) * 1_000_000 / u128::from(into.max(1_000));
        let carried = if into < POOL_AHEAD_MS {
            k.demand.per_ks
        } else {
            0
        };
        per_ks
            .max(u64::try_from(avg).unwrap_or(u64::MAX))
            .max(carried)
    })
}
