//! Admin writes on global limits reach every region. A global limit's counter lives at home
//! and its pools in every region, so with a home store ([`GlobalAdmin`]):
//!
//! - **overrides live at home** (those a region's store held from before it had a home store
//!   are still read, and deleted there too: an upgrade loses none): every replica of every
//!   region polls home's generation and
//!   applies the same overrides (a per-region table would make "acme: 50 a minute" a limit
//!   per region, set by whichever region's operator wrote it). An overridden global limit is
//!   still decided from slices in the region (decided at home, each request would wait a
//!   round trip, past Envoy's 20 ms), their grants judged at home on the override; when an
//!   override changes, each replica gives its slices of the counter back to the pool and the
//!   pools it knows back home, so what is spent next is granted on the limit in force (what
//!   the region spends in between, until its next poll, was granted on the old one). A
//!   `deny` override denies at once, whatever the slices hold.
//! - **a reset resets the region's store and home**, and leaves a record at home
//!   ([`ResetRecord`]): each replica, when it sees the record, empties the pools it knows of
//!   the reset counters and drops its slices of them, without giving them back (home forgot
//!   what they were charged: a refund would take units off the fresh count, and the regions
//!   could admit past the limit after the reset).

use super::{window_ms, GlobalGrants, PoolOp};
use crate::store::admin::{CounterAdmin, OverrideId, ResetCount, ResetRecord, StoredOverride};
use crate::store::{BoxFuture, CounterKey, StoreError};
use std::sync::Arc;

/// The admin side of a region with a home store: resets reach both, overrides live at home.
#[derive(Debug)]
pub struct GlobalAdmin {
    pub region: Arc<dyn CounterAdmin>,
    pub home: Arc<dyn CounterAdmin>,
}

impl CounterAdmin for GlobalAdmin {
    fn reset<'a>(
        &'a self,
        domain: &'a str,
        prefix: &'a [(String, String)],
        domain_tag: bool,
    ) -> BoxFuture<'a, Result<ResetCount, StoreError>> {
        Box::pin(async move {
            // Recorded before home's reset (every replica empties its pools early) and after
            // (what the pools were refilled with from the old count meanwhile is dropped).
            // Home's reset fences each counter it resets at the first record's successor: a
            // give-back from a pool not cleared for a later record is refused at home, in the
            // same call that would apply it, so units drained before the reset never come off
            // the fresh count; a refill carries its fence into the pool it lands in, which
            // drops one charged before a fence it has seen (docs/semantics.md). Home first: a
            // region whose store is home's too (one Redis) would otherwise lose the counters to
            // the unfenced regional reset before home's could fence them.
            let first = self.home.record_reset(domain, prefix, true).await?;
            let home = self
                .home
                .reset_fenced(domain, prefix, domain_tag, first.saturating_add(1))
                .await?;
            let here = self.region.reset(domain, prefix, domain_tag).await?;
            self.home.record_reset(domain, prefix, false).await?;
            Ok(ResetCount {
                counters: here.counters.saturating_add(home.counters),
                counted: here.counted && home.counted,
            })
        })
    }

    /// Home's, and those left in the region's store from before it had a home store (read,
    /// never written any more: an upgrade loses none; home's wins for the same id; they go
    /// at their expiry or a delete).
    fn overrides(&self) -> BoxFuture<'_, Result<(u64, Vec<StoredOverride>), StoreError>> {
        Box::pin(async move {
            let (generation, mut all) = self.home.overrides().await?;
            match self.region.overrides().await {
                Ok((_, left)) => {
                    let ids: std::collections::HashSet<OverrideId> =
                        all.iter().map(|o| o.id.clone()).collect();
                    all.extend(left.into_iter().filter(|o| !ids.contains(&o.id)));
                }
                // Not read: the table in force stays (home's alone would lift them).
                Err(e) => return Err(e),
            }
            Ok((generation, all))
        })
    }

    fn generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        self.home.generation()
    }

    fn put_override<'a>(
        &'a self,
        o: &'a StoredOverride,
        now_ms: u64,
        max: usize,
    ) -> BoxFuture<'a, Result<Option<StoredOverride>, StoreError>> {
        self.home.put_override(o, now_ms, max)
    }

    /// At home, and in the region's store (one left there from before the home store).
    fn delete_override<'a>(
        &'a self,
        id: &'a OverrideId,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<Option<StoredOverride>, StoreError>> {
        Box::pin(async move {
            let home = self.home.delete_override(id, now_ms).await?;
            let here = self.region.delete_override(id, now_ms).await?;
            Ok(home.or(here))
        })
    }

    fn resets(&self) -> BoxFuture<'_, Result<Vec<ResetRecord>, StoreError>> {
        self.home.resets()
    }
}

impl GlobalGrants {
    /// The records this replica has not applied yet, oldest first. The first call only notes
    /// where the records stand: resets from before this replica started reset nothing of its.
    /// Each call also notes below which record the pools it creates may be stamped (under
    /// every reset still under way: [`ResetRecord::stamp_below_open`]).
    pub fn unseen_resets(&self, records: Vec<ResetRecord>) -> Vec<ResetRecord> {
        let latest = records.iter().map(|r| r.seq).max().unwrap_or(0);
        let cap = ResetRecord::stamp_below_open(&records, u64::MAX);
        let mut seen = self.resets_seen.lock().unwrap_or_else(|e| e.into_inner());
        let Some((last, _)) = *seen else {
            *seen = Some((latest, cap));
            // Resets from before this replica started: nothing of its to clear.
            self.pool.stamp(latest.min(cap));
            return Vec::new();
        };
        *seen = Some((latest.max(last), cap));
        records.into_iter().filter(|r| r.seq > last).collect()
    }

    /// Records up to `seq` are applied (their clears done): the pools this replica creates from
    /// now on start cleared for `seq`, or just below a reset still under way
    /// ([`super::RegionPool::stamp`]).
    pub fn resets_applied(&self, seq: u64) {
        let seen = *self.resets_seen.lock().unwrap_or_else(|e| e.into_inner());
        let cap = seen.map_or(0, |(_, cap)| cap);
        self.pool.stamp(seq.min(cap));
    }

    /// Clears the region's pools of the counters `reset` covers that this replica knows: their
    /// units dropped, given nothing back home (home forgot them), what they owe from a
    /// partition forgiven (it was on the count the reset dropped), what was taken counted
    /// afresh. A refill under way still lands (charged at home after the reset, or, if it
    /// was charged just before, at most one refill on the old count). Returns the units dropped.
    /// A pool cleared for `keep_from` (at most the record's seq; [`ResetRecord::keep_from`])
    /// or later is left whole.
    pub async fn forget(self: &Arc<Self>, reset: &ResetRecord, keep_from: u64) -> u64 {
        let pools: Vec<(CounterKey, Option<(u64, u64)>)> = {
            let map = self.known.lock().unwrap_or_else(|e| e.into_inner());
            map.iter()
                .filter(|((key, _), _)| reset.covers(&key.domain, &key.entries))
                .map(|((key, _), k)| (key.clone(), k.window))
                .collect()
        };
        let mut emptied = 0;
        for (key, window) in pools {
            let w = window_ms(window);
            let ttl = Self::ttl_ms(window, self.now_ms());
            let clear = PoolOp::Clear {
                seq: reset.seq,
                keep_from,
            };
            if let Ok(st) = self.pool.run(&key, w, clear, ttl).await {
                emptied += st.ok;
                self.report(&key, window, &st, self.demand_of(&key, w));
            }
            // Sized afresh: what home had left before the reset says nothing now.
            let mut map = self.known.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(k) = map.get_mut(&(key, w)) {
                k.home_left = u64::MAX;
            }
        }
        emptied
    }

    /// An override of `domain`'s counters keyed by `entries` changed: the region's pools of
    /// them that this replica knows go back home (drained and refunded: they were charged
    /// there), so what the region spends next is granted on the limit in force. A pool whose
    /// refill is under way, or that owes home, is left to its idle drain. Returns the units
    /// given back.
    pub async fn give_back_overridden(
        self: &Arc<Self>,
        domain: &str,
        entries: &[(String, String)],
    ) -> u64 {
        let pools: Vec<(CounterKey, Option<(u64, u64)>)> = {
            let map = self.known.lock().unwrap_or_else(|e| e.into_inner());
            map.iter()
                .filter(|((key, _), _)| &*key.domain == domain && &*key.entries == entries)
                .map(|((key, _), k)| (key.clone(), k.window))
                .collect()
        };
        let mut back = 0;
        for (key, window) in pools {
            let ttl = Self::ttl_ms(window, self.now_ms());
            let all = PoolOp::Drain { idle_ms: 0 };
            let Ok(st) = self.pool.run(&key, window_ms(window), all, ttl).await else {
                continue;
            };
            if st.ok == 0 {
                continue;
            }
            let refund = self.refund(&key, window, (st.ok, st.cleared)).await;
            if refund == super::refund::Refund::Back {
                back += st.ok;
            }
            if refund != super::refund::Refund::Failed {
                let demand = self.demand_of(&key, window_ms(window));
                self.report(&key, window, &Self::emptied(&st), demand);
            }
        }
        back
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::admin::{NoReset, OverrideLimit};

    fn record(seq: u64, domain: &str, opens: bool) -> ResetRecord {
        ResetRecord {
            seq,
            domain: domain.into(),
            prefix: vec![("tenant".into(), "acme".into())],
            opens,
        }
    }

    #[test]
    fn a_closing_record_keeps_what_was_cleared_for_its_fence() {
        // a: opened at 3 (home fenced its counters at 4), closed at 6 (home's reset bumps the
        // generation between); b: closed at 9 with its opening record trimmed away; c: opens.
        let records = vec![
            record(3, "a", true),
            record(6, "a", false),
            record(9, "b", false),
            record(10, "c", true),
            // d and e reset at once: neither closing record keeps a pool for its fence.
            record(12, "d", true),
            record(13, "e", true),
            record(15, "d", false),
            record(17, "e", false),
            // f closed twice (an old-format record after): the second keeps nothing.
            record(20, "f", true),
            record(22, "f", false),
            record(24, "f", false),
        ];
        let keep: Vec<u64> = records.iter().map(|r| r.keep_from(&records)).collect();
        assert_eq!(keep, [3, 4, 9, 10, 12, 13, 15, 17, 20, 21, 24]);
    }

    /// A reset still under way (its first record, no second yet) caps the stamp of the pools a
    /// replica creates: below it, whatever later records (of other resets) it has applied, so a
    /// pool refilled from the count that reset is about to forget never refunds past its fence.
    #[tokio::test]
    async fn pools_created_while_a_reset_runs_are_stamped_below_it() {
        use super::super::{MemoryPool, PoolOp, RegionPool};
        let clock: Arc<dyn crate::clock::Clock> = Arc::new(crate::clock::ManualClock::new(
            std::time::Duration::from_secs(1),
        ));
        let pool = Arc::new(MemoryPool::new(Arc::clone(&clock), 10));
        let home = Arc::new(crate::store::fake::FakeStore::new(Arc::clone(&clock)));
        let grants = GlobalGrants::new(Arc::clone(&pool) as _, home, clock);
        // a: reset and closed (1, 2); b: under way (3); c: reset and closed since (4, 5).
        let mut records = vec![
            record(1, "a", true),
            record(2, "a", false),
            record(3, "b", true),
            record(4, "c", true),
            record(5, "c", false),
        ];
        assert_eq!(ResetRecord::stamp_below_open(&records, 5), 2);
        assert_eq!(ResetRecord::stamp_below_open(&records, 1), 1);
        // Started while b's reset runs: records to 5 count as applied, pools stamped 2.
        assert!(grants.unseen_resets(records.clone()).is_empty());
        let key = |v: &str| {
            crate::store::LimitCheck::for_tests(
                "d",
                v,
                crate::config::Limit::fixed(10, crate::config::Unit::Minute),
                1,
            )
            .key
        };
        let look = PoolOp::Take(0);
        let st = pool.run(&key("x"), 0, look, 60_000).await.expect("pool");
        assert_eq!(st.cleared, 2);
        // b's second record: applied, pools now stamped 6.
        records.push(record(6, "b", false));
        let fresh = grants.unseen_resets(records.clone());
        assert_eq!(fresh.iter().map(|r| r.seq).collect::<Vec<_>>(), [6]);
        grants.resets_applied(6);
        let st = pool.run(&key("y"), 0, look, 60_000).await.expect("pool");
        assert_eq!(st.cleared, 6);
        // A record from before the field (no `opens`) reads as closed.
        let old: ResetRecord =
            serde_json::from_str(r#"{"domain":"d","prefix":[]}"#).expect("an old record");
        assert!(!old.opens);
    }

    fn set(id: &str, limit: u32) -> StoredOverride {
        StoredOverride {
            id: OverrideId {
                domain: "api".into(),
                entries: vec![("tenant".into(), id.into())],
                limit_name: String::new(),
            },
            limit: OverrideLimit::Requests(limit),
            expires_unix_ms: 10_000,
            set_by: "ops".into(),
            set_unix_ms: 0,
            reason: String::new(),
        }
    }

    #[tokio::test]
    async fn an_upgrade_keeps_the_regions_overrides_home_wins_and_a_delete_reaches_both() {
        let (region, home) = (Arc::new(NoReset::default()), Arc::new(NoReset::default()));
        // Set in the region before it had a home store.
        region.0.put(&set("acme", 5), 0, 10).expect("put");
        region.0.put(&set("umbrella", 7), 0, 10).expect("put");
        let admin = GlobalAdmin {
            region: region.clone(),
            home: home.clone(),
        };
        admin
            .put_override(&set("acme", 50), 0, 10)
            .await
            .expect("put at home");
        let (_, mut all) = admin.overrides().await.expect("overrides");
        all.sort_by(|a, b| a.id.cmp(&b.id));
        let limits: Vec<(String, OverrideLimit)> = all
            .iter()
            .map(|o| (o.id.entries[0].1.clone(), o.limit))
            .collect();
        assert_eq!(
            limits,
            [
                ("acme".to_string(), OverrideLimit::Requests(50)),
                ("umbrella".to_string(), OverrideLimit::Requests(7)),
            ]
        );
        // Written at home only; a delete reaches the region's leftover too.
        assert_eq!(home.0.all().1.len(), 1);
        let gone = admin.delete_override(&set("umbrella", 0).id, 0).await;
        assert_eq!(
            gone.expect("delete").map(|o| o.limit),
            Some(OverrideLimit::Requests(7))
        );
        let (_, all) = admin.overrides().await.expect("overrides");
        // acme: home's 50 (the region's 5 under it).
        assert_eq!(all.len(), 1, "{all:?}");
    }
}
