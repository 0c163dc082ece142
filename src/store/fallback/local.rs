//! Deciding without the store: a request's checks as this replica decides them alone (the same
//! counters, held to this replica's share of the limit or of what the store last said was
//! left), and the debt each local charge leaves for the write-back.

use super::{Roster, Shared};
use crate::config::Algorithm;
use crate::store::{charged, CounterStore, Decision, LimitCheck};
use std::sync::Arc;
use std::time::Duration;

impl Shared {
    /// The check as this replica decides it alone: the same counter and algorithm, against its
    /// share (of what the store last said was left in this window, or of the whole limit).
    pub(super) fn local_check(&self, c: &LimitCheck, roster: Roster, now_us: u64) -> LimitCheck {
        let mut local = c.clone();
        // The local store identifies a counter without its limit's size (the share changes with
        // the roster: a replica joining mid-outage must not start every counter afresh), so the
        // configured size is part of the entries instead.
        let mut entries = c.key.entries.to_vec();
        let configured = c.key.limit;
        entries.push((
            "\u{0}of".into(),
            format!("{}:{}", configured.requests_per_unit, configured.burst),
        ));
        let limit = &mut local.key.limit;
        if limit.algorithm == Algorithm::TokenBucket {
            // A bucket refills: its share is a share of its rate and of its burst.
            limit.requests_per_unit = roster.share(limit.requests_per_unit);
            limit.burst = roster.share(limit.burst);
        } else {
            match self.shares.learned(&c.key, now_us) {
                Some(l) if !c.refund => {
                    limit.requests_per_unit =
                        roster.share(l.remaining.min(limit.requests_per_unit));
                    // A fixed window: its own counter, so what it admits now counts against the
                    // share of what was left at that answer, not against an earlier outage's
                    // local counter; what was learned ends with the window, and so do the hits.
                    // Any other limit keeps one local counter (review A5): its slots and
                    // sliding hits outlive what was learned, and must still count after it.
                    if limit.algorithm == Algorithm::FixedWindow {
                        entries.push((
                            "\u{0}learned".into(),
                            format!("{}@{}", l.remaining, l.until_us),
                        ));
                    }
                }
                _ => limit.requests_per_unit = roster.share(limit.requests_per_unit),
            }
        }
        local.key.entries = Arc::from(entries);
        local
    }

    /// When the hits of `c` charged now stop mattering: the end of a fixed window (its pinned
    /// window's, a calendar's or a leased limit's, if it has one), one period from now for the
    /// others.
    pub(super) fn until_us(c: &LimitCheck, now_us: u64) -> u64 {
        let period = c.key.limit.period.millis().saturating_mul(1000).max(1);
        match (c.key.limit.algorithm, c.window) {
            (Algorithm::FixedWindow, Some((_, end))) => end,
            (Algorithm::FixedWindow, None) => (now_us / period + 1).saturating_mul(period),
            _ => now_us.saturating_add(period),
        }
    }

    pub(super) async fn decide_locally(&self, checks: &[LimitCheck], now_us: u64) -> Decision {
        self.decide_locally_after(checks, now_us, None).await
    }

    /// [`Shared::decide_locally`] for a request the store charged in part: checks `stays`
    /// says the store holds are decided locally as the others, but owe nothing.
    pub(super) async fn decide_locally_after(
        &self,
        checks: &[LimitCheck],
        now_us: u64,
        stays: Option<&[bool]>,
    ) -> Decision {
        let roster = self.shares.roster();
        let local: Vec<LimitCheck> = checks
            .iter()
            .map(|c| self.local_check(c, roster, now_us))
            .collect();
        let mut d = match self.local.decide(&local).await {
            Ok(d) => d,
            // The memory store does not fail; if it ever did, deny rather than admit blind.
            Err(_) => Decision {
                at: crate::store::DecidedAt::Unknown,
                admitted: false,
                outcomes: vec![
                    crate::store::Outcome {
                        allowed: false,
                        remaining: 0,
                        reset: Duration::ZERO,
                        retry_after: Duration::MAX,
                    };
                    checks.len()
                ],
                local: false,
                steps: 0,
                beside_lost: false,
                beside_apart: false,
                leases: Vec::new(),
            },
        };
        let allowed: Vec<bool> = d.outcomes.iter().map(|o| o.allowed).collect();
        for (i, (c, was)) in checks
            .iter()
            .zip(charged(checks, &allowed, d.admitted))
            .enumerate()
        {
            let in_store = stays.is_some_and(|s| s.get(i).copied().unwrap_or(false));
            // A pinned window the plan chose may have closed by now (planned at its last
            // instant): its hits count nowhere, and must not push a live debt out of a full
            // ledger.
            let until = Self::until_us(c, now_us);
            if was && owes(c) && !in_store && until > now_us {
                let hits = i64::try_from(c.hits).unwrap_or(i64::MAX);
                let hits = if c.refund { -hits } else { hits };
                self.ledger.add(&c.key, hits, until, c.window, now_us);
            }
        }
        d.steps = 0;
        d.at = crate::store::DecidedAt::Fallback;
        self.tallies.decided(checks, d.admitted);
        self.started_local(d.admitted);
        d
    }
}

/// Whether a check decided locally leaves a debt to write back: hits on a rate. An `in_flight`
/// slot is not a count the store could be given (its slots are not written back: see
/// docs/semantics.md), so it owes nothing.
pub(super) fn owes(c: &LimitCheck) -> bool {
    c.hits > 0 && c.key.limit.algorithm != Algorithm::InFlight
}
