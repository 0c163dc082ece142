//! A bounded hash table for the memory store's counters: open addressing with linear probing and
//! backward-shift deletion. There are no tombstones, so a table that has reached its size never
//! rehashes or grows again, however many counters come and go: the memory of a full store is
//! fixed (std's `HashMap` may double its table after many removals even at a constant count).
//! It starts small and grows (by 4) up to the size its cap needs, so memory follows live counters.

/// A counter's 128-bit keyed fingerprint (two 64-bit halves: no 16-byte alignment in the slot).
pub type Fingerprint = [u64; 2];

/// Most of the table's slots in use: linear probing stays short (about 2.5 probes to find a
/// counter, 8.5 to learn it is absent).
const LOAD_NUM: usize = 3;
const LOAD_DEN: usize = 4;
const MIN_SLOTS: usize = 16;
/// Each growth multiplies the table's size by (up to) this.
const GROWTH: usize = 4;

#[derive(Debug)]
pub struct Table<V> {
    slots: Vec<Option<(Fingerprint, V)>>,
    len: usize,
    /// Slots of the table at its cap; it never grows past them.
    max_slots: usize,
}

impl<V> Table<V> {
    /// A table for at most `cap` entries.
    pub fn new(cap: usize) -> Self {
        let max_slots = (cap * LOAD_DEN).div_ceil(LOAD_NUM).max(1);
        let mut t = Table {
            slots: Vec::new(),
            len: 0,
            max_slots,
        };
        t.resize(t.next_size(0));
        t
    }

    /// The next table size above `current`: the full size divided by a power of 4 (at least
    /// [`MIN_SLOTS`]), so growing to the full size keeps the old table (a quarter of it) alive
    /// for a moment, never half of it: the peak stays within the documented bytes per counter.
    fn next_size(&self, current: usize) -> usize {
        let mut s = self.max_slots;
        while s / GROWTH > current && s / GROWTH >= MIN_SLOTS {
            s /= GROWTH;
        }
        s
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The home slot of `fp`: a multiply-shift onto any table size, not only powers of two, so
    /// the table's size can match its cap exactly.
    fn home(&self, fp: Fingerprint) -> usize {
        ((u128::from(fp[0]) * self.slots.len() as u128) >> 64) as usize
    }

    fn find(&self, fp: Fingerprint) -> Option<usize> {
        let n = self.slots.len();
        let mut i = self.home(fp);
        for _ in 0..n {
            match &self.slots[i] {
                None => return None,
                Some((f, _)) if *f == fp => return Some(i),
                Some(_) => i = if i + 1 == n { 0 } else { i + 1 },
            }
        }
        None
    }

    pub fn get(&self, fp: Fingerprint) -> Option<&V> {
        let i = self.find(fp)?;
        self.slots[i].as_ref().map(|(_, v)| v)
    }

    pub fn get_mut(&mut self, fp: Fingerprint) -> Option<&mut V> {
        let i = self.find(fp)?;
        self.slots[i].as_mut().map(|(_, v)| v)
    }

    /// Inserts a new entry (the caller checked it is absent and that the cap has room). Returns
    /// false, inserting nothing, when the table is at its largest and full.
    pub fn insert(&mut self, fp: Fingerprint, v: V) -> bool {
        if (self.len + 1) * LOAD_DEN > self.slots.len() * LOAD_NUM
            && self.slots.len() < self.max_slots
        {
            self.resize(self.next_size(self.slots.len()));
        }
        if self.len >= self.slots.len() {
            return false;
        }
        self.place(fp, v);
        true
    }

    fn place(&mut self, fp: Fingerprint, v: V) {
        let n = self.slots.len();
        let mut i = self.home(fp);
        while self.slots[i].is_some() {
            i = if i + 1 == n { 0 } else { i + 1 };
        }
        self.slots[i] = Some((fp, v));
        self.len += 1;
    }

    pub fn remove(&mut self, fp: Fingerprint) -> Option<V> {
        let mut hole = self.find(fp)?;
        let removed = self.slots[hole].take().map(|(_, v)| v);
        self.len -= 1;
        // Backward shift: pull later entries of the probe run into the hole when their home
        // slot does not lie after it, so every entry stays reachable without tombstones.
        let n = self.slots.len();
        let mut j = hole;
        loop {
            j = if j + 1 == n { 0 } else { j + 1 };
            let Some((f, _)) = &self.slots[j] else {
                break;
            };
            let home = self.home(*f);
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.slots[hole] = self.slots[j].take();
                hole = j;
            }
        }
        removed
    }

    fn resize(&mut self, slots: usize) {
        let old = std::mem::take(&mut self.slots);
        self.slots = Vec::with_capacity(slots);
        self.slots.resize_with(slots, || None);
        self.len = 0;
        for (fp, v) in old.into_iter().flatten() {
            self.place(fp, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fingerprints crowded onto few home slots, so probe runs wrap and shift.
    fn fp(i: u64) -> Fingerprint {
        [i.wrapping_mul(0x9E37_79B9_7F4A_7C15) % (u64::MAX / 4), i]
    }

    #[test]
    fn entries_come_and_go_without_growing_past_the_cap() {
        let mut t = Table::new(100);
        let mut live = std::collections::BTreeMap::new();
        let mut x: u64 = 1;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let k = x % 300;
            if live.contains_key(&k) {
                assert_eq!(t.remove(fp(k)), live.remove(&k), "step {step}");
            } else if live.len() < 100 {
                assert!(t.insert(fp(k), step));
                live.insert(k, step);
            }
            assert_eq!(t.len(), live.len());
            assert!(t.slots.len() <= 134, "{} slots", t.slots.len());
        }
        for k in 0..300 {
            assert_eq!(t.get(fp(k)), live.get(&k), "key {k}");
        }
    }

    #[test]
    fn a_table_at_its_largest_refuses_more() {
        let mut t: Table<u8> = Table::new(0); // one slot at least
        assert!(t.insert(fp(1), 1));
        assert!(!t.insert(fp(2), 2));
        assert_eq!(t.len(), 1);
    }
}
