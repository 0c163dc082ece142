//! The consumers a candidate limit would stop most: a Space-Saving summary (Metwally et al.) of
//! at most [`CAPACITY`] entries, so a limit's view never grows with the number of distinct
//! consumers a caller can invent; each count is an estimate never below the true one, with its
//! bound on the overestimate.

/// Consumers one candidate limit keeps at most.
pub const CAPACITY: usize = 32;

/// Bytes of one consumer's description kept at most (longer ones are cut, marked `…`).
pub const MAX_CONSUMER_BYTES: usize = 256;

/// One tracked consumer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Stopped {
    /// The descriptor entries keying the candidate's counter (`key=value, key=value`).
    pub consumer: String,
    /// Hits it would have had denied (an estimate never below the true count).
    pub denied: u64,
    /// The true count is in `[denied - max_error, denied]`.
    pub max_error: u64,
}

/// The summary itself.
#[derive(Debug, Default)]
pub struct Sketch {
    entries: Vec<Stopped>,
}

impl Sketch {
    /// `hits` denied to `consumer`: counted on its entry, else on a free one, else on the
    /// smallest entry's, which it takes over (its count is the new entry's error bound).
    pub fn add(&mut self, consumer: &str, hits: u64) {
        let consumer: std::borrow::Cow<'_, str> = match consumer.len() > MAX_CONSUMER_BYTES {
            true => cut(consumer).into(),
            false => consumer.into(),
        };
        if let Some(e) = self.entries.iter_mut().find(|e| e.consumer == consumer) {
            e.denied = e.denied.saturating_add(hits);
            return;
        }
        let consumer = consumer.into_owned();
        if self.entries.len() < CAPACITY {
            self.entries.push(Stopped {
                consumer,
                denied: hits,
                max_error: 0,
            });
            return;
        }
        if let Some(min) = self.entries.iter_mut().min_by_key(|e| e.denied) {
            let floor = min.denied;
            *min = Stopped {
                consumer,
                denied: floor.saturating_add(hits),
                max_error: floor,
            };
        }
    }

    /// The `n` largest, largest first (ties by name, so the order is stable).
    pub fn top(&self, n: usize) -> Vec<Stopped> {
        let mut all = self.entries.clone();
        all.sort_by(|a, b| b.denied.cmp(&a.denied).then(a.consumer.cmp(&b.consumer)));
        all.truncate(n);
        all
    }
}

fn cut(s: &str) -> String {
    if s.len() <= MAX_CONSUMER_BYTES {
        return s.to_string();
    }
    let mut end = MAX_CONSUMER_BYTES - '…'.len_utf8();
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heavy_consumers_survive_a_flood_of_distinct_ones() {
        let mut s = Sketch::default();
        for round in 0..100u64 {
            s.add("heavy-a", 3);
            s.add("heavy-b", 2);
            // A caller inventing a new value every time never pushes the heavy ones out.
            s.add(&format!("noise-{round}"), 1);
        }
        let top = s.top(2);
        assert_eq!(top[0].consumer, "heavy-a");
        assert!(top[0].denied >= 300 && top[0].denied - top[0].max_error <= 300);
        assert_eq!(top[1].consumer, "heavy-b");
        assert!(s.entries.len() <= CAPACITY);
    }

    #[test]
    fn exact_while_it_has_room_and_long_values_are_cut() {
        let mut s = Sketch::default();
        s.add("x", 5);
        s.add("y", 1);
        s.add("x", 2);
        assert_eq!(
            s.top(5),
            vec![
                Stopped {
                    consumer: "x".into(),
                    denied: 7,
                    max_error: 0
                },
                Stopped {
                    consumer: "y".into(),
                    denied: 1,
                    max_error: 0
                }
            ]
        );
        let long = "é".repeat(400);
        s.add(&long, 1);
        s.add(&long, 1);
        let kept = s.top(5).into_iter().find(|e| e.consumer.ends_with('…'));
        assert!(kept.is_some_and(|e| e.consumer.len() <= MAX_CONSUMER_BYTES && e.denied == 2));
    }
}
