//! The lease metrics: `in_flight` slots in use and reservations outstanding per domain (gauges),
//! leases that ended without their release, and releases that found nothing to release.
//!
//! Why a ledger and not a count: slots and reservations live in the store, shared by every
//! replica, and walking the store's keys to count them is what the design forbids. Each store
//! call says what it did ([`LeaseEffect`]): an entry added with its lease, an entry released
//! with the lease it had left. A replica books +1 where an entry it added ends and -1 where an
//! entry it released would have ended; what is booked for the future is its share of the
//! entries alive now. So the figures add up across replicas: `sum by (domain)` is the fleet's
//! (one replica's share is negative while it holds releases of entries another replica took).
//! An entry nobody releases leaves the gauge when its lease ends, as it leaves the store. A
//! replica that restarts forgets what it booked: the sum is off by at most what it held, and
//! for at most one lease.
//!
//! Bounded: a ledger per (domain, kind), the domains being the config's; bookings are kept in
//! buckets of 1 s, or of a 1/1024th of the lease (a power of two seconds) for leases over
//! 17 minutes, so a ledger holds at most about 1 024 buckets per lease length in use.

use crate::store::{LeaseChange, LeaseEffect};
use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

/// Which lease entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeaseKind {
    /// `in_flight` slots.
    InFlight,
    /// Reservations on a rate limit.
    Reservation,
}

impl LeaseKind {
    const ALL: [Self; 2] = [Self::InFlight, Self::Reservation];

    fn label(self) -> &'static str {
        match self {
            LeaseKind::InFlight => "in_flight",
            LeaseKind::Reservation => "reservations",
        }
    }
}

/// Per domain, per kind (in [`LeaseKind::ALL`] order): bucket end (ms since the epoch) ->
/// entries booked to end in it. Looked up by `&str`, so a booking allocates nothing.
type Ledgers = HashMap<Box<str>, [BTreeMap<u64, i64>; 2]>;

#[derive(Debug)]
pub struct LeaseMetrics {
    slots: IntGaugeVec,
    reservations: IntGaugeVec,
    expired: IntCounterVec,
    unmatched: IntCounterVec,
    ledgers: Mutex<Ledgers>,
}

impl LeaseMetrics {
    pub fn register(r: &Registry) -> prometheus::Result<Self> {
        let gauge = |name: &str, help: &str| -> prometheus::Result<IntGaugeVec> {
            let g = IntGaugeVec::new(Opts::new(name, help), &["domain"])?;
            r.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let counter = |name: &str, help: &str| -> prometheus::Result<IntCounterVec> {
            let c = IntCounterVec::new(Opts::new(name, help), &["domain", "kind"])?;
            r.register(Box::new(c.clone()))?;
            Ok(c)
        };
        Ok(Self {
            slots: gauge(
                "sluice_in_flight_slots",
                "`in_flight` slots held, per domain: this replica's share (sum the replicas).",
            )?,
            reservations: gauge(
                "sluice_reservations_outstanding",
                "Reservations made and not settled, their lease not ended, per domain: this \
                 replica's share (sum the replicas).",
            )?,
            expired: counter(
                "sluice_leases_expired_total",
                "Slots and reservations whose lease ended without their stream-done call, by \
                 domain and kind (counted by the call that drops them from the store).",
            )?,
            unmatched: counter(
                "sluice_lease_releases_unmatched_total",
                "Stream-done calls that found nothing to release, by domain and kind: a settle \
                 without a reservation (never made, or its lease ended), a free without a slot \
                 (Envoy frees after every request, denied ones too).",
            )?,
            ledgers: Mutex::default(),
        })
    }

    /// Books what one store call did on one lease limit whose lease is `lease`; `now` is this
    /// replica's clock.
    pub fn record(
        &self,
        domain: &str,
        kind: LeaseKind,
        effect: LeaseEffect,
        lease: Duration,
        now: Duration,
    ) {
        if effect.expired > 0 {
            self.expired
                .with_label_values(&[domain, kind.label()])
                .inc_by(u64::from(effect.expired));
        }
        let (left_us, delta) = match effect.change {
            LeaseChange::None => return,
            LeaseChange::Unmatched => {
                self.unmatched
                    .with_label_values(&[domain, kind.label()])
                    .inc();
                return;
            }
            LeaseChange::Added { left_us } => (left_us, 1),
            LeaseChange::Released { left_us } => (left_us, -1),
        };
        let end = now.saturating_add(Duration::from_micros(left_us));
        let at = bucket(end, lease);
        let mut ledgers = self.lock();
        let kinds = match ledgers.get_mut(domain) {
            Some(l) => l,
            None => ledgers.entry(Box::from(domain)).or_default(),
        };
        let ledger = &mut kinds[kind as usize];
        let n = ledger.entry(at).or_insert(0);
        *n += delta;
        if *n == 0 {
            ledger.remove(&at);
        }
    }

    /// Sets the gauges as of `now`, dropping what ended.
    pub fn update(&self, now: Duration) {
        let now_ms = u64::try_from(now.as_millis()).unwrap_or(u64::MAX);
        let mut ledgers = self.lock();
        for (domain, kinds) in ledgers.iter_mut() {
            for (kind, ledger) in LeaseKind::ALL.into_iter().zip(kinds.iter_mut()) {
                let live = ledger.split_off(&now_ms.saturating_add(1));
                *ledger = live;
                let held: i64 = ledger.values().sum();
                let gauge = match kind {
                    LeaseKind::InFlight => &self.slots,
                    LeaseKind::Reservation => &self.reservations,
                };
                gauge.with_label_values(&[domain]).set(held);
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ledgers> {
        self.ledgers.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The end of the bucket (ms since the epoch) an entry ending at `end` is booked in: `end`
/// rounded up to the bucket width, the same for the replica that adds and the one that
/// releases (both know the limit's lease).
fn bucket(end: Duration, lease: Duration) -> u64 {
    let width_s = (lease.as_secs() / 1024).max(1).next_power_of_two();
    let width = width_s.saturating_mul(1000);
    let end_ms = u64::try_from(end.as_millis()).unwrap_or(u64::MAX);
    end_ms.div_ceil(width).saturating_mul(width)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(r: &Registry, name: &str) -> i64 {
        r.gather()
            .iter()
            .find(|f| f.name() == name)
            .and_then(|f| {
                f.get_metric()
                    .first()
                    .map(|m| m.get_gauge().get_value() as i64)
            })
            .unwrap_or(0)
    }

    #[test]
    fn replicas_add_up_and_an_unreleased_entry_leaves_when_its_lease_ends() {
        let (a, b) = (Registry::new(), Registry::new());
        let (ma, mb) = (
            LeaseMetrics::register(&a).expect("a"),
            LeaseMetrics::register(&b).expect("b"),
        );
        let lease = Duration::from_secs(5);
        let t0 = Duration::from_secs(1_000);
        let added = |left: u64| LeaseEffect {
            change: LeaseChange::Added { left_us: left },
            expired: 0,
        };
        // Replica a takes two slots; replica b frees one of them 2 s later.
        ma.record("ai", LeaseKind::InFlight, added(5_000_000), lease, t0);
        ma.record("ai", LeaseKind::InFlight, added(5_000_000), lease, t0);
        let freed = LeaseEffect {
            change: LeaseChange::Released { left_us: 3_000_000 },
            expired: 0,
        };
        let t2 = t0 + Duration::from_secs(2);
        mb.record("ai", LeaseKind::InFlight, freed, lease, t2);
        ma.update(t2);
        mb.update(t2);
        let sum = |ra: &Registry, rb: &Registry| {
            value(ra, "sluice_in_flight_slots") + value(rb, "sluice_in_flight_slots")
        };
        assert_eq!(sum(&a, &b), 1, "two taken, one freed");
        assert_eq!(value(&b, "sluice_in_flight_slots"), -1, "b's share");
        // The other one is never freed: it leaves with its lease.
        let t5 = t0 + lease;
        ma.update(t5);
        mb.update(t5);
        assert_eq!(sum(&a, &b), 0);
        assert!(
            ma.lock().values().flatten().all(BTreeMap::is_empty),
            "nothing kept"
        );
    }

    #[test]
    fn long_leases_share_buckets_so_a_ledger_stays_small() {
        let r = Registry::new();
        let m = LeaseMetrics::register(&r).expect("metrics");
        let lease = Duration::from_secs(86_400);
        for s in 0..86_400u64 {
            let e = LeaseEffect {
                change: LeaseChange::Added {
                    left_us: 86_400_000_000,
                },
                expired: 0,
            };
            m.record(
                "ai",
                LeaseKind::Reservation,
                e,
                lease,
                Duration::from_secs(s),
            );
        }
        let buckets: usize = m.lock().values().flatten().map(BTreeMap::len).sum();
        assert!(
            buckets <= 1_100,
            "{buckets} buckets for a day of reservations"
        );
        m.update(Duration::from_secs(86_399));
        assert_eq!(value(&r, "sluice_reservations_outstanding"), 86_400);
    }
}
