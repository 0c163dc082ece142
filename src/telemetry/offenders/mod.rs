//! The heavy-hitters view behind `GET /debug/offenders`: which descriptor values were denied most
//! in the last few minutes, per domain, so an operator can tell which client caused a spike.
//! Each domain keeps a ring of epoch-aligned time buckets, each a Space-Saving summary (Metwally
//! et al.) of at most `capacity` entries, so memory is bounded by the settings
//! ([`OffenderSettings::memory_bound_bytes`]) and never grows with the number of distinct values.

use crate::clock::Clock;
use std::cmp::Ordering as CmpOrdering;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
#[cfg(test)]
use std::time::Duration;

/// Appended to a descriptor or domain cut at `max_descriptor_bytes`, so a truncated value is
/// never mistaken for a complete one in the report.
pub const TRUNCATION_MARKER: &str = "…";

mod settings;

pub use settings::OffenderSettings;

/// The top offenders of one domain, as served by `/debug/offenders`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct OffenderReport {
    pub domain: String,
    pub window_seconds: u64,
    pub offenders: Vec<Offender>,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Offender {
    pub descriptor: String,
    /// Denied hits counted (Space-Saving estimate; never below the true count).
    pub denied: u64,
    /// Upper bound on the overestimate: the true count is in [denied - max_error, denied].
    pub max_error: u64,
}

/// A string as it will be stored: a borrowed prefix plus, when cut, the marker. Comparing and
/// writing through this keeps the hot path free of allocations for values already tracked.
#[derive(Debug, Clone, Copy)]
struct Key<'a> {
    head: &'a str,
    marked: bool,
}

impl<'a> Key<'a> {
    fn new(s: &'a str, max: usize) -> Self {
        if s.len() <= max {
            return Self {
                head: s,
                marked: false,
            };
        }
        // Settings too small to fit the marker still must not exceed the bound.
        match max.checked_sub(TRUNCATION_MARKER.len()) {
            Some(room) => Self {
                head: floor_char_boundary(s, room),
                marked: true,
            },
            None => Self {
                head: floor_char_boundary(s, max),
                marked: false,
            },
        }
    }

    fn len(&self) -> usize {
        self.head.len()
            + if self.marked {
                TRUNCATION_MARKER.len()
            } else {
                0
            }
    }

    fn matches(&self, s: &str) -> bool {
        s.len() == self.len()
            && s.starts_with(self.head)
            && (!self.marked || s.ends_with(TRUNCATION_MARKER))
    }

    fn cmp_str(&self, s: &str) -> CmpOrdering {
        let marker: &[u8] = if self.marked {
            TRUNCATION_MARKER.as_bytes()
        } else {
            &[]
        };
        self.head
            .bytes()
            .chain(marker.iter().copied())
            .cmp(s.bytes())
    }

    /// Overwrites `s` in place: an evicted entry's buffer is reused, and grown only to the exact
    /// length needed (never doubled), so capacities stay within `max_descriptor_bytes`.
    fn write_into(&self, s: &mut String) {
        s.clear();
        let need = self.len();
        if s.capacity() < need {
            s.reserve_exact(need);
        }
        s.push_str(self.head);
        if self.marked {
            s.push_str(TRUNCATION_MARKER);
        }
    }

    fn to_owned_exact(self) -> String {
        let mut s = String::new();
        self.write_into(&mut s);
        s
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> &str {
    // Index 0 is always a boundary, so this ends.
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    s.get(..i).unwrap_or_default()
}

#[derive(Debug)]
struct Entry {
    descriptor: String,
    count: u64,
    /// Space-Saving error: the count this entry inherited when it took an evicted slot.
    error: u64,
}

/// One time bucket: a Space-Saving summary over `entries[..live]`. Entries past `live` are
/// spares from an earlier use of the bucket, kept for their string buffers.
#[derive(Debug)]
struct Bucket {
    /// Epoch bucket index (`now / bucket`) the summary belongs to.
    index: u64,
    live: usize,
    /// Whether an entry was ever replaced: until then an absent value truly has count 0.
    evicted: bool,
    entries: Vec<Entry>,
}

impl Bucket {
    fn empty() -> Self {
        Self {
            index: 0,
            live: 0,
            evicted: false,
            entries: Vec::new(),
        }
    }

    fn reset(&mut self, index: u64) {
        self.index = index;
        self.live = 0;
        self.evicted = false;
    }

    fn is_live(&self, now_index: u64, buckets: usize) -> bool {
        // A bucket ahead of `now` (the wall clock stepped back) is not shown; the next write to
        // its slot resets it. Losing a few minutes of a debug view beats keeping stale data
        // alive until the clock catches up.
        self.live > 0 && self.index <= now_index && now_index - self.index < buckets as u64
    }

    fn live_entries(&self) -> &[Entry] {
        self.entries.get(..self.live).unwrap_or_default()
    }

    /// The most an untracked value can have been denied in this bucket.
    fn absent_bound(&self) -> u64 {
        if !self.evicted {
            return 0;
        }
        self.live_entries()
            .iter()
            .map(|e| e.count)
            .min()
            .unwrap_or(0)
    }

    /// Space-Saving update. One linear pass finds both the value and the minimum: with K in
    /// the tens, scanning a contiguous Vec costs about what hashing the descriptor would, and it
    /// needs no index (a stream-summary's hash map and linked buckets would cost memory per
    /// entry and churn allocations on every eviction). The cost is O(K) per denial, so K should
    /// stay in the hundreds at most.
    fn add(&mut self, key: Key<'_>, hits: u64, capacity: usize) {
        let mut min_at = 0;
        let mut min_count = u64::MAX;
        for (i, e) in self.entries.iter_mut().take(self.live).enumerate() {
            if key.matches(&e.descriptor) {
                e.count = e.count.saturating_add(hits);
                return;
            }
            if e.count < min_count {
                min_count = e.count;
                min_at = i;
            }
        }
        if self.live < capacity {
            if self.live == self.entries.len() {
                if self.entries.len() == self.entries.capacity() {
                    // Grow geometrically but never past K, so the Vec's capacity is within the bound.
                    let len = self.entries.len();
                    self.entries
                        .reserve_exact(len.max(4).min(capacity.saturating_sub(len)).max(1));
                }
                self.entries.push(Entry {
                    descriptor: String::new(),
                    count: 0,
                    error: 0,
                });
            }
            if let Some(e) = self.entries.get_mut(self.live) {
                key.write_into(&mut e.descriptor);
                e.count = hits;
                e.error = 0;
                self.live += 1;
            }
        } else if let Some(e) = self.entries.get_mut(min_at) {
            key.write_into(&mut e.descriptor);
            e.error = min_count;
            e.count = min_count.saturating_add(hits);
            self.evicted = true;
        }
    }

    #[cfg(any(test, feature = "test-util"))]
    fn heap_bytes(&self) -> usize {
        self.entries.capacity() * size_of::<Entry>()
            + self
                .entries
                .iter()
                .map(|e| e.descriptor.capacity())
                .sum::<usize>()
    }
}

#[derive(Debug)]
struct Ring {
    /// `buckets` slots; bucket index `i` lives at `i % buckets`.
    buckets: Vec<Bucket>,
}

impl Ring {
    fn new(buckets: usize) -> Self {
        let mut ring = Vec::with_capacity(buckets);
        ring.resize_with(buckets, Bucket::empty);
        Self { buckets: ring }
    }

    fn record(&mut self, now_index: u64, key: Key<'_>, hits: u64, capacity: usize) {
        let n = self.buckets.len().max(1) as u64;
        if let Some(b) = self.buckets.get_mut((now_index % n) as usize) {
            if b.index != now_index {
                b.reset(now_index);
            }
            b.add(key, hits, capacity);
        }
    }

    fn has_live(&self, now_index: u64) -> bool {
        let n = self.buckets.len();
        self.buckets.iter().any(|b| b.is_live(now_index, n))
    }

    fn top(&self, now_index: u64, n: usize) -> Option<Vec<Offender>> {
        let slots = self.buckets.len();
        let live: Vec<&Bucket> = self
            .buckets
            .iter()
            .filter(|b| b.is_live(now_index, slots))
            .collect();
        if live.is_empty() {
            return None;
        }
        let absent: Vec<u64> = live.iter().map(|b| b.absent_bound()).collect();
        let total_absent = absent.iter().fold(0u64, |a, &b| a.saturating_add(b));
        // (descriptor, count, error, that bucket's absent bound)
        let mut rows: Vec<(&str, u64, u64, u64)> = live
            .iter()
            .zip(&absent)
            .flat_map(|(b, &bound)| {
                b.live_entries()
                    .iter()
                    .map(move |e| (e.descriptor.as_str(), e.count, e.error, bound))
            })
            .collect();
        rows.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let mut merged: Vec<(&str, u64, u64)> = Vec::new();
        for group in rows.chunk_by(|a, b| a.0 == b.0) {
            let Some(&(descriptor, ..)) = group.first() else {
                continue;
            };
            let (count, error, present_bound) = group.iter().fold((0u64, 0u64, 0u64), |acc, r| {
                (
                    acc.0.saturating_add(r.1),
                    acc.1.saturating_add(r.2),
                    acc.2.saturating_add(r.3),
                )
            });
            // In a bucket that evicted and does not hold this value, it may still have had up
            // to that bucket's minimum: adding it keeps `denied` an upper bound on the truth.
            let unseen = total_absent.saturating_sub(present_bound);
            merged.push((
                descriptor,
                count.saturating_add(unseen),
                error.saturating_add(unseen),
            ));
        }
        merged.sort_unstable_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        merged.truncate(n);
        Some(
            merged
                .into_iter()
                .map(|(descriptor, denied, max_error)| Offender {
                    descriptor: descriptor.to_owned(),
                    denied,
                    max_error,
                })
                .collect(),
        )
    }

    #[cfg(any(test, feature = "test-util"))]
    fn heap_bytes(&self) -> usize {
        self.buckets.capacity() * size_of::<Bucket>()
            + self.buckets.iter().map(Bucket::heap_bytes).sum::<usize>()
    }
}

#[derive(Debug)]
struct DomainSlot {
    name: String,
    /// Newest bucket index recorded, readable without the ring's lock: deciding whether a slot
    /// can be given to a new domain must not lock every ring.
    newest: AtomicU64,
    ring: Mutex<Ring>,
}

impl DomainSlot {
    fn is_stale(&self, now_index: u64, buckets: usize) -> bool {
        self.newest
            .load(Ordering::Relaxed)
            .saturating_add(buckets as u64)
            <= now_index
    }

    fn lock(&self) -> MutexGuard<'_, Ring> {
        // The ring holds only counters: whatever a panicking holder left is still a usable
        // (at worst slightly off) summary, and a debug view must not take the service down.
        self.ring.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Per-domain heavy hitters of denied descriptors. `Send + Sync`: the domain table is behind an
/// `RwLock` (written only when a domain is added or its slot reused) and each domain's ring
/// behind its own `Mutex`, so denials in different domains do not contend.
pub struct Offenders {
    settings: OffenderSettings,
    clock: Arc<dyn Clock>,
    /// Sorted by name, so lookups are a binary search and [`Offenders::domains`] needs no sort.
    domains: RwLock<Vec<DomainSlot>>,
    dropped: AtomicU64,
}

impl fmt::Debug for Offenders {
    // Dumping every entry of every bucket would be both huge and a lock on the hot path.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Offenders")
            .field("settings", &self.settings)
            .field("clock", &self.clock)
            .field("dropped", &self.dropped())
            .finish_non_exhaustive()
    }
}

impl Offenders {
    pub fn new(settings: OffenderSettings, clock: Arc<dyn Clock>) -> Self {
        Self {
            settings: settings.normalized(),
            clock,
            domains: RwLock::new(Vec::new()),
            dropped: AtomicU64::new(0),
        }
    }

    /// The settings in use (normalized, see [`OffenderSettings::normalized`]).
    pub fn settings(&self) -> OffenderSettings {
        self.settings
    }

    /// Denied hits not recorded because `max_domains` domains already had denials in the window.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    fn now_index(&self) -> u64 {
        let bucket = self.settings.bucket.as_nanos().max(1);
        u64::try_from(self.clock.now().as_nanos() / bucket).unwrap_or(u64::MAX)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<DomainSlot>> {
        self.domains.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records `hits` denied hits for `descriptor` (already rendered by the caller as "k=v,k2=v2") in `domain`.
    pub fn record(&self, domain: &str, descriptor: &str, hits: u64) {
        if hits == 0 {
            return;
        }
        let s = &self.settings;
        let domain = Key::new(domain, s.max_descriptor_bytes);
        let descriptor = Key::new(descriptor, s.max_descriptor_bytes);
        let now = self.now_index();

        {
            let table = self.read();
            match table.binary_search_by(|slot| domain.cmp_str(&slot.name).reverse()) {
                Ok(i) => {
                    if let Some(slot) = table.get(i) {
                        slot.lock().record(now, descriptor, hits, s.capacity);
                        slot.newest.fetch_max(now, Ordering::Relaxed);
                    }
                    return;
                }
                // Full with nobody to evict: say so without taking the write lock, which would
                // stall every domain while a flood of denials in an untracked one goes on.
                Err(_)
                    if table.len() >= s.max_domains
                        && !table.iter().any(|d| d.is_stale(now, s.buckets)) =>
                {
                    self.dropped.fetch_add(hits, Ordering::Relaxed);
                    return;
                }
                Err(_) => {}
            }
        }

        let mut table = self.domains.write().unwrap_or_else(PoisonError::into_inner);
        if let Ok(i) = table.binary_search_by(|slot| domain.cmp_str(&slot.name).reverse()) {
            // Another thread added it between our two locks.
            if let Some(slot) = table.get_mut(i) {
                record_exclusive(slot, now, descriptor, hits, s.capacity);
            }
            return;
        }
        let slot = if table.len() < s.max_domains {
            if table.len() == table.capacity() {
                // Geometric growth capped at max_domains keeps the table within the bound.
                let len = table.len();
                table.reserve_exact(len.max(4).min(s.max_domains.saturating_sub(len)).max(1));
            }
            Some(DomainSlot {
                name: domain.to_owned_exact(),
                newest: AtomicU64::new(now),
                ring: Mutex::new(Ring::new(s.buckets)),
            })
        } else {
            // Reuse a quiet domain's slot, buffers and all, so domains coming and going over a
            // long uptime neither leak nor lock newcomers out.
            table
                .iter()
                .position(|d| d.is_stale(now, s.buckets))
                .map(|i| table.remove(i))
                .map(|mut slot| {
                    domain.write_into(&mut slot.name);
                    let ring = slot.ring.get_mut().unwrap_or_else(PoisonError::into_inner);
                    for b in &mut ring.buckets {
                        b.reset(0);
                    }
                    slot
                })
        };
        let Some(mut slot) = slot else {
            self.dropped.fetch_add(hits, Ordering::Relaxed);
            return;
        };
        record_exclusive(&mut slot, now, descriptor, hits, s.capacity);
        // Searched again: removing a reused slot may have shifted the insertion point.
        let (Ok(at) | Err(at)) =
            table.binary_search_by(|d| d.name.as_str().cmp(slot.name.as_str()));
        table.insert(at, slot);
    }

    /// The top `n` offenders of `domain` over the live buckets, most denied first (ties:
    /// descriptor string ascending), or None if the domain has no recorded denials in the window.
    pub fn top(&self, domain: &str, n: usize) -> Option<OffenderReport> {
        let key = Key::new(domain, self.settings.max_descriptor_bytes);
        let now = self.now_index();
        let table = self.read();
        let i = table
            .binary_search_by(|slot| key.cmp_str(&slot.name).reverse())
            .ok()?;
        let slot = table.get(i)?;
        let offenders = slot.lock().top(now, n)?;
        Some(OffenderReport {
            domain: slot.name.clone(),
            window_seconds: self.settings.window_seconds(),
            offenders,
        })
    }

    /// Domains with denials in the window, sorted.
    pub fn domains(&self) -> Vec<String> {
        let now = self.now_index();
        self.read()
            .iter()
            .filter(|slot| slot.lock().has_live(now))
            .map(|slot| slot.name.clone())
            .collect()
    }

    #[cfg(any(test, feature = "test-util"))]
    /// Current heap bytes held, by the structure's own accounting (string capacities + container
    /// capacities * element size).
    pub fn heap_bytes(&self) -> usize {
        let table = self.read();
        table.capacity() * size_of::<DomainSlot>()
            + table
                .iter()
                .map(|slot| slot.name.capacity() + slot.lock().heap_bytes())
                .sum::<usize>()
    }
}

fn record_exclusive(slot: &mut DomainSlot, now: u64, descriptor: Key<'_>, hits: u64, k: usize) {
    let ring = slot.ring.get_mut().unwrap_or_else(PoisonError::into_inner);
    ring.record(now, descriptor, hits, k);
    let newest = slot.newest.get_mut();
    *newest = (*newest).max(now);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use std::collections::HashMap;

    /// A multiple of 60 s, so minute buckets start exactly here.
    const T0: Duration = Duration::from_secs(1_700_000_040);
    const MINUTE: Duration = Duration::from_secs(60);
    const NS: Duration = Duration::from_nanos(1);

    fn tracker(settings: OffenderSettings) -> (Offenders, ManualClock) {
        let clock = ManualClock::new(T0);
        (Offenders::new(settings, Arc::new(clock.clone())), clock)
    }

    fn counts(o: &Offenders, domain: &str) -> Vec<(String, u64, u64)> {
        o.top(domain, usize::MAX)
            .map(|r| {
                r.offenders
                    .into_iter()
                    .map(|x| (x.descriptor, x.denied, x.max_error))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn row(d: &str, denied: u64, err: u64) -> (String, u64, u64) {
        (d.to_owned(), denied, err)
    }

    /// Largest number of entries any bucket of any domain holds (live, allocated, capacity).
    fn largest_bucket(o: &Offenders) -> (usize, usize, usize) {
        let table = o.read();
        let mut most = (0, 0, 0);
        for slot in table.iter() {
            for b in &slot.lock().buckets {
                most.0 = most.0.max(b.live);
                most.1 = most.1.max(b.entries.len());
                most.2 = most.2.max(b.entries.capacity());
            }
        }
        most
    }

    struct XorShift(u64);

    impl XorShift {
        fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            x
        }
    }

    #[test]
    fn is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Offenders>();
    }

    #[test]
    fn counts_are_exact_below_capacity() {
        let (o, _) = tracker(OffenderSettings::default());
        for i in 0..10u64 {
            let d = format!("remote_address=10.0.0.{i}");
            for _ in 0..=i {
                o.record("edge", &d, 2);
            }
        }
        let got = counts(&o, "edge");
        assert_eq!(got.len(), 10);
        for (i, (d, denied, err)) in got.iter().enumerate() {
            let v = 9 - i as u64;
            assert_eq!(d, &format!("remote_address=10.0.0.{v}"));
            assert_eq!((*denied, *err), (2 * (v + 1), 0));
        }

        // Exactly K distinct values fill the summary without evicting: still exact.
        let (o, _) = tracker(OffenderSettings::default());
        for i in 0..64 {
            o.record("edge", &format!("v={i:02}"), 1 + i % 3);
        }
        let got = counts(&o, "edge");
        assert_eq!(got.len(), 64);
        assert!(got.iter().all(|(d, denied, err)| {
            let i: u64 = d[2..].parse().unwrap_or(u64::MAX);
            *denied == 1 + i % 3 && *err == 0
        }));
        // Zero hits are no denial.
        o.record("quiet", "v=1", 0);
        assert_eq!(o.top("quiet", 5), None);
    }

    #[test]
    fn space_saving_bounds_hold_on_a_random_stream() {
        let settings = OffenderSettings {
            capacity: 16,
            buckets: 3,
            ..OffenderSettings::default()
        };
        let (o, clock) = tracker(settings);
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        // Exact truth: (bucket index, descriptor) -> hits.
        let mut truth: HashMap<(u64, String), u64> = HashMap::new();
        let mut checks = 0;
        for step in 0..30_000u32 {
            clock.advance(Duration::from_millis(rng.next() % 60));
            // Skewed: low values far more often than high ones.
            let x = rng.next() % 1000;
            let d = format!("user={}", x * x * x / 1_000_000);
            let hits = 1 + rng.next() % 3;
            o.record("api", &d, hits);
            let idx = (clock.now().as_nanos() / MINUTE.as_nanos()) as u64;
            *truth.entry((idx, d)).or_default() += hits;

            if step % 997 == 996 {
                checks += 1;
                let now = (clock.now().as_nanos() / MINUTE.as_nanos()) as u64;
                let mut window: HashMap<&str, u64> = HashMap::new();
                for ((idx, d), n) in &truth {
                    if now - idx < 3 {
                        *window.entry(d.as_str()).or_default() += n;
                    }
                }
                let report = counts(&o, "api");
                assert!(!report.is_empty());
                for (d, denied, err) in &report {
                    let real = window.get(d.as_str()).copied().unwrap_or(0);
                    assert!(
                        denied - err <= real && real <= *denied,
                        "{d}: true {real} outside [{denied} - {err}, {denied}]"
                    );
                }
                // Whatever Space-Saving guarantees to keep is there: the most denied value.
                let (heaviest, _) = window
                    .iter()
                    .max_by_key(|(d, n)| (**n, std::cmp::Reverse(**d)))
                    .map(|(d, n)| (d.to_string(), *n))
                    .unwrap_or_default();
                assert!(report.iter().any(|r| r.0 == heaviest));
            }
        }
        assert!(checks > 20);
        assert!(largest_bucket(&o).2 <= 16);
    }

    #[test]
    fn old_denials_age_out() {
        let (o, clock) = tracker(OffenderSettings::default());
        o.record("edge", "a", 1);
        clock.advance(2 * MINUTE);
        o.record("edge", "b", 1);
        clock.set(T0 + 5 * MINUTE - NS);
        assert_eq!(counts(&o, "edge"), vec![row("a", 1, 0), row("b", 1, 0)]);
        clock.set(T0 + 5 * MINUTE);
        assert_eq!(counts(&o, "edge"), vec![row("b", 1, 0)]);
        assert_eq!(o.domains(), vec!["edge".to_owned()]);
        clock.set(T0 + 7 * MINUTE - NS);
        assert_eq!(counts(&o, "edge"), vec![row("b", 1, 0)]);
        clock.set(T0 + 7 * MINUTE);
        assert_eq!(o.top("edge", 10), None);
        assert!(o.domains().is_empty());
    }

    #[test]
    fn bucket_boundaries_are_epoch_aligned() {
        let (o, clock) = tracker(OffenderSettings::default());
        clock.set(T0 + MINUTE - NS);
        o.record("edge", "last-ns", 1);
        clock.set(T0 + MINUTE);
        o.record("edge", "next-bucket", 1);
        clock.set(T0 + 5 * MINUTE - NS);
        assert_eq!(
            counts(&o, "edge"),
            vec![row("last-ns", 1, 0), row("next-bucket", 1, 0)]
        );
        clock.set(T0 + 5 * MINUTE);
        assert_eq!(counts(&o, "edge"), vec![row("next-bucket", 1, 0)]);

        // A write to a slot last used `buckets` indexes ago starts it afresh.
        clock.set(T0 + 6 * MINUTE);
        o.record("edge", "wrapped", 3);
        assert_eq!(counts(&o, "edge"), vec![row("wrapped", 3, 0)]);
        assert_eq!(o.top("edge", 1).map(|r| r.window_seconds), Some(300));

        // The clock stepping back hides the newer buckets; writes then reuse their slots.
        clock.set(T0 - 10 * MINUTE);
        assert_eq!(o.top("edge", 10), None);
        o.record("edge", "back", 1);
        assert_eq!(counts(&o, "edge"), vec![row("back", 1, 0)]);
    }

    #[test]
    fn long_values_are_cut_at_a_char_boundary_and_marked() {
        let settings = OffenderSettings {
            max_descriptor_bytes: 10,
            ..OffenderSettings::default()
        };
        let (o, _) = tracker(settings);
        // "ab" + four 3-byte euros = 14 bytes: 7 bytes of room before the marker end mid-char.
        o.record("edge", "ab€€€€", 1);
        o.record("edge", "ab€€ and more", 2);
        o.record("edge", "ab€zz", 1);
        o.record("edge", "0123456789", 1);
        o.record("edge", "ab€…", 1);
        let got = counts(&o, "edge");
        // The two long values merge under their shared prefix; so does a genuine "ab€…".
        assert_eq!(
            got,
            vec![
                row("ab€…", 4, 0),
                row("0123456789", 1, 0),
                row("ab€zz", 1, 0)
            ]
        );
        assert!(got.iter().all(|r| r.0.len() <= 10));

        // Domain names are cut the same way, and found again by their long name.
        o.record("a-very-long-domain", "x", 1);
        assert_eq!(
            o.top("a-very-long-domain", 1).map(|r| r.domain),
            Some("a-very-…".to_owned())
        );
        assert!(o.domains().contains(&"a-very-…".to_owned()));

        // Too little room for the marker: cut without it.
        let (o, _) = tracker(OffenderSettings {
            max_descriptor_bytes: 2,
            ..OffenderSettings::default()
        });
        o.record("d", "éa", 1);
        o.record("d", "aéb", 1);
        assert_eq!(counts(&o, "d"), vec![row("a", 1, 0), row("é", 1, 0)]);
    }

    #[test]
    fn max_domains_is_respected_and_quiet_slots_are_reused() {
        let settings = OffenderSettings {
            max_domains: 2,
            ..OffenderSettings::default()
        };
        let (o, clock) = tracker(settings);
        o.record("b", "x", 1);
        o.record("a", "x", 1);
        o.record("c", "x", 5);
        o.record("c", "y", 2);
        assert_eq!(o.domains(), vec!["a".to_owned(), "b".to_owned()]);
        assert_eq!(o.top("c", 10), None);
        assert_eq!(o.dropped(), 7);

        // "b" stays active; "a" goes quiet, so "c" takes its slot.
        clock.advance(3 * MINUTE);
        o.record("b", "x", 1);
        clock.advance(2 * MINUTE);
        o.record("c", "z", 1);
        assert_eq!(o.domains(), vec!["b".to_owned(), "c".to_owned()]);
        assert_eq!(counts(&o, "c"), vec![row("z", 1, 0)]);
        assert_eq!(counts(&o, "b"), vec![row("x", 1, 0)]);
        assert_eq!(o.top("a", 10), None);
        assert_eq!(o.dropped(), 7);
        assert!(o.read().capacity() <= 2);

        let (o, _) = tracker(OffenderSettings {
            max_domains: 0,
            ..OffenderSettings::default()
        });
        o.record("a", "x", 3);
        assert!(o.domains().is_empty());
        assert_eq!((o.dropped(), o.heap_bytes()), (3, 0));
    }

    #[test]
    fn top_orders_by_denials_then_descriptor_and_honours_n() {
        let (o, _) = tracker(OffenderSettings::default());
        o.record("edge", "b", 3);
        o.record("edge", "d", 1);
        o.record("edge", "a", 1);
        o.record("edge", "c", 5);
        o.record("edge", "a", 2);
        let names = |n| {
            o.top("edge", n)
                .map(|r| r.offenders.into_iter().map(|x| x.descriptor).collect())
                .unwrap_or_else(Vec::new)
        };
        assert_eq!(names(10), vec!["c", "a", "b", "d"]);
        assert_eq!(names(2), vec!["c", "a"]);
        assert_eq!(
            o.top("edge", 0),
            Some(OffenderReport {
                domain: "edge".to_owned(),
                window_seconds: 300,
                offenders: Vec::new(),
            })
        );
        assert_eq!(o.top("elsewhere", 3), None);
    }

    #[test]
    fn merges_buckets_and_bounds_values_missing_from_a_full_one() {
        let (o, clock) = tracker(OffenderSettings {
            capacity: 2,
            ..OffenderSettings::default()
        });
        o.record("edge", "a", 5);
        o.record("edge", "b", 1);
        clock.advance(MINUTE);
        o.record("edge", "a", 2);
        o.record("edge", "c", 4);
        o.record("edge", "d", 1); // evicts a (2): d = 3 with error 2
                                  // Bucket 2 evicted and its minimum is 3: a may have had up to 3 there.
        assert_eq!(
            counts(&o, "edge"),
            vec![
                row("a", 8, 3), // 5 + at most 3 in bucket 2 (truly 2)
                row("b", 1 + 3, 3),
                row("c", 4, 0),
                row("d", 3, 2),
            ]
        );
        assert_eq!(largest_bucket(&o).0, 2);
    }

    #[test]
    fn heap_stays_within_the_bound_after_a_flood() {
        let settings = OffenderSettings {
            max_domains: 3,
            ..OffenderSettings::default()
        };
        let (o, clock) = tracker(settings);
        let bound = settings.memory_bound_bytes();
        let mut rng = XorShift(42);
        for i in 0..40_000u64 {
            if i % 5_000 == 4_999 {
                clock.advance(MINUTE);
            }
            let len = 200 + (rng.next() % 200) as usize;
            let d: String = std::iter::repeat_n('x', len).collect::<String>() + &i.to_string();
            o.record(&format!("domain-{}", i % 4), &d, 1);
            o.record(&format!("domain-{}", i % 4), &format!("ü-{i}"), 1);
        }
        let used = o.heap_bytes();
        assert!(used <= bound, "{used} > {bound}");
        // Every slot saturated with full-length strings: the bound is generous, not loose.
        assert!(used * 10 >= bound * 9, "{used} vs {bound}");
        assert_eq!(largest_bucket(&o), (64, 64, 64));

        // A second, different flood reuses the buffers: not one more byte.
        for i in 0..20_000u64 {
            if i % 5_000 == 4_999 {
                clock.advance(MINUTE);
            }
            let d = format!("{}{i:06}", "y".repeat(300));
            o.record(&format!("domain-{}", i % 3), &d, 1);
        }
        assert_eq!(o.heap_bytes(), used);
    }

    #[test]
    fn acceptance_heavy_hitter_among_a_flood_of_distinct_values() {
        let settings = OffenderSettings::default();
        let (o, clock) = tracker(settings);
        let heavy = "remote_address=198.51.100.66";
        let mut heavy_true = 0u64;
        let mut attack = 0u64;
        let mut record = 0u64;
        // 100 000 denials: 50 000 distinct values, each twice (the two passes interleave the
        // whole set), and the heavy hitter every 20th record (~5% of the traffic).
        while attack < 100_000 {
            record += 1;
            if record % 20 == 19 {
                o.record("edge", heavy, 1);
                heavy_true += 1;
            } else {
                let v = attack % 50_000;
                o.record(
                    "edge",
                    &format!(
                        "remote_address=10.{}.{}.{}",
                        v >> 16,
                        (v >> 8) & 255,
                        v & 255
                    ),
                    1,
                );
                attack += 1;
            }
            if record % 1_000 == 999 {
                assert!(largest_bucket(&o).2 <= settings.capacity);
            }
        }
        assert_eq!(heavy_true, 5_263);
        let report = o.top("edge", 1).map(|r| r.offenders).unwrap_or_default();
        assert_eq!(report.len(), 1);
        let top = &report[0];
        assert_eq!(top.descriptor, heavy);
        assert!(top.denied - top.max_error <= heavy_true && heavy_true <= top.denied);
        let (live, allocated, capacity) = largest_bucket(&o);
        assert_eq!((live, allocated, capacity), (64, 64, 64));

        // The same attack spread over more buckets than the ring holds.
        clock.advance(MINUTE);
        let start = clock.now();
        for i in 0..105_263u64 {
            clock.set(start + Duration::from_millis(3 * i));
            if i % 20 == 19 {
                o.record("edge", heavy, 1);
            } else {
                o.record("edge", &format!("v={}", i % 50_000), 1);
            }
        }
        let report = o.top("edge", 3).map(|r| r.offenders).unwrap_or_default();
        assert_eq!(report.first().map(|r| r.descriptor.as_str()), Some(heavy));
        assert!(largest_bucket(&o).2 <= settings.capacity);
    }

    #[test]
    fn concurrent_recorders_lose_nothing() {
        let (o, _) = tracker(OffenderSettings::default());
        std::thread::scope(|s| {
            for t in 0..4 {
                let o = &o;
                s.spawn(move || {
                    for i in 0..5_000 {
                        o.record(["a", "b"][(i + t) % 2], &format!("v={}", i % 10), 1);
                    }
                });
            }
        });
        for d in ["a", "b"] {
            let got = counts(&o, d);
            assert_eq!(got.len(), 10);
            assert!(got.iter().all(|r| r.1 == 1_000 && r.2 == 0), "{got:?}");
        }
    }

    #[test]
    fn a_poisoned_domain_lock_still_serves() {
        let (o, _) = tracker(OffenderSettings::default());
        o.record("edge", "a", 1);
        let poisoned = std::thread::scope(|s| {
            s.spawn(|| {
                let table = o.read();
                let _guard = table.first().map(|slot| slot.ring.lock());
                panic!("poison the ring");
            })
            .join()
            .is_err()
        });
        assert!(poisoned);
        o.record("edge", "a", 1);
        assert_eq!(counts(&o, "edge"), vec![row("a", 2, 0)]);
        assert!(o.heap_bytes() > 0);
    }

    #[test]
    fn report_serializes_as_documented() {
        let (o, _) = tracker(OffenderSettings::default());
        o.record("edge", "tenant=acme,path=/login", 7);
        let json = serde_json::to_value(o.top("edge", 5)).unwrap_or_default();
        assert_eq!(
            json,
            serde_json::json!({
                "domain": "edge",
                "window_seconds": 300,
                "offenders": [{"descriptor": "tenant=acme,path=/login", "denied": 7, "max_error": 0}],
            })
        );
    }

    #[test]
    fn settings_are_normalized_and_the_default_bound_is_documented() {
        let zero = OffenderSettings {
            capacity: 0,
            bucket: Duration::ZERO,
            buckets: 0,
            ..OffenderSettings::default()
        };
        let n = zero.normalized();
        assert_eq!(
            (n.capacity, n.bucket, n.buckets),
            (1, Duration::from_secs(1), 1)
        );
        let (o, _) = tracker(zero);
        o.record("d", "a", 1);
        o.record("d", "b", 1);
        assert_eq!(counts(&o, "d"), vec![row("b", 2, 1)]);
        assert_eq!(o.settings().window_seconds(), 1);
        if size_of::<usize>() == 8 {
            assert_eq!(OffenderSettings::default().memory_bound_bytes(), 6_436_944);
        }
    }
}
