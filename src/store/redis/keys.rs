//! Redis key layout. Every counter key is `PREFIX{TAG}REST:LIMIT` where TAG is the domain and the
//! descriptor's first entry, so a resource and all the consumers below it live in one cluster
//! slot and one Lua call can decide them together. Components are percent-escaped so no value a
//! client sends can close the hash tag early or make two counters share a key.

use crate::config::Algorithm;
use crate::store::CounterKey;
use std::fmt::Write;

/// Characters with a meaning in the layout: `{`/`}` delimit the hash tag, `|`, `=` and `:`
/// separate components, and `%` is the escape itself.
fn needs_escape(c: char) -> bool {
    matches!(c, '%' | '{' | '}' | '|' | '=' | ':')
}

/// Appends `s` with every layout character written as `%XX`.
pub fn escape_into(out: &mut String, s: &str) {
    for c in s.chars() {
        if needs_escape(c) {
            let _ = write!(out, "%{:02X}", c as u32);
        } else {
            out.push(c);
        }
    }
}

/// The hash tag (without braces) of a counter: domain and the descriptor's first entry, or the
/// domain alone under `hash_tag: domain`.
pub fn hash_tag(key: &CounterKey) -> String {
    let mut tag = String::with_capacity(64);
    escape_into(&mut tag, &key.domain);
    if key.domain_tag {
        // `|` never follows the domain in a descriptor-scoped tag without `k=v`, so the two
        // scopes never share a key: `{d|}` here, `{d|k=v}` there.
        tag.push('|');
        return tag;
    }
    let tagged = if key.own_tag { key.entries.len() } else { 1 };
    for (k, v) in key.entries.iter().take(tagged) {
        tag.push('|');
        escape_into(&mut tag, k);
        tag.push('=');
        escape_into(&mut tag, v);
    }
    tag
}

/// A key of one window's state beside a counter (a global limit's pool, its regions' reports,
/// its short mark): the counter's key, `#`, `what`, `:` and the window's start in ms. A counter
/// key ends in its limit, which sluice writes: no counter key ends like this, and the hash tag
/// keeps it in the counter's Cluster slot.
pub fn window_key(prefix: &str, key: &CounterKey, what: &str, window_ms: u64) -> String {
    let mut k = counter_key(prefix, key);
    k.push('#');
    k.push_str(what);
    k.push(':');
    k.push_str(&window_ms.to_string());
    k
}

/// The full Redis key of a counter under `prefix` (`CACHE_KEY_PREFIX`, validated brace-free).
pub fn counter_key(prefix: &str, key: &CounterKey) -> String {
    let mut out = String::with_capacity(prefix.len() + 96);
    out.push_str(prefix);
    out.push('{');
    out.push_str(&hash_tag(key));
    out.push('}');
    let rest = if key.domain_tag {
        0
    } else if key.own_tag {
        key.entries.len()
    } else {
        1
    };
    for (k, v) in key.entries.iter().skip(rest) {
        out.push('|');
        escape_into(&mut out, k);
        out.push('=');
        escape_into(&mut out, v);
    }
    // Limit identity: algorithm, quota, period, burst, and whether it came from Envoy's
    // override. The period is written canonically (a unit name, else seconds or ms), so two
    // spellings of one period share a counter and different periods never do.
    let l = key.limit;
    let alg = l.algorithm.key_tag();
    // Lowercased in place (the tag and the digits are already): no allocation per key.
    let start = out.len();
    let _ = write!(out, ":{alg}:{}:{}", l.requests_per_unit, l.period);
    if let Some(written) = out.get_mut(start..) {
        written.make_ascii_lowercase();
    }
    if l.algorithm == Algorithm::TokenBucket {
        let _ = write!(out, ":b{}", l.burst);
    }
    if key.overridden {
        out.push_str(":o");
    }
    // A candidate limit's counter (`CANDIDATE_CONFIG`): never an enforced counter's key, in
    // the enforced counter's slot (so one call decides both on a Cluster).
    if key.candidate {
        out.push_str(":k");
    }
    out
}

/// The Redis Cluster slot of a hash tag as [`hash_tag`] builds it (never empty: it holds the
/// domain, and a tag inside braces is hashed as is).
pub fn tag_slot(tag: &str) -> u16 {
    if tag.is_empty() {
        // `{}` is no hash tag for Redis: the whole key is hashed. Only a bug reaches this.
        return 0;
    }
    crc16_xmodem(tag.as_bytes()) % 16384
}

#[cfg(any(test, feature = "test-util"))]
/// The Redis Cluster slot of a key (CRC16/XMODEM of the hash tag, as Redis computes it).
pub fn slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tagged = bytes.iter().position(|&b| b == b'{').and_then(|open| {
        bytes[open + 1..]
            .iter()
            .position(|&b| b == b'}')
            .filter(|&len| len > 0)
            .map(|len| &bytes[open + 1..open + 1 + len])
    });
    crc16_xmodem(tagged.unwrap_or(bytes)) % 16384
}

fn crc16_xmodem(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// Why a `CACHE_KEY_PREFIX` cannot be used.
pub fn validate_prefix(prefix: &str) -> Result<(), String> {
    if prefix.contains(['{', '}']) {
        return Err(format!(
            "CACHE_KEY_PREFIX {prefix:?} must not contain '{{' or '}}': sluice places the Redis \
             Cluster hash tag itself"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Limit, Period, Unit};
    use proptest::prelude::*;
    use std::sync::Arc;

    fn ck(domain: &str, entries: &[(&str, &str)], rpu: u32, unit: Unit, o: bool) -> CounterKey {
        CounterKey {
            domain: Arc::from(domain),
            entries: entries
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<Vec<_>>()
                .into(),
            limit: Limit::fixed(rpu, unit),
            overridden: o,
            domain_tag: false,
            own_tag: false,
            candidate: false,
        }
    }

    #[test]
    fn layout_is_readable() {
        let k = ck(
            "calc",
            &[("resource", "calc"), ("consumer", "a:b")],
            3,
            Unit::Minute,
            false,
        );
        assert_eq!(
            counter_key("sl_", &k),
            "sl_{calc|resource=calc}|consumer=a%3Ab:fw:3:minute"
        );
        let mut tb = k.clone();
        tb.limit = Limit {
            requests_per_unit: 5,
            period: Period::parse("10s").unwrap_or(Period::from_unit(Unit::Second)),
            algorithm: Algorithm::TokenBucket,
            burst: 2,
        };
        tb.overridden = true;
        assert_eq!(
            counter_key("", &tb),
            "{calc|resource=calc}|consumer=a%3Ab:tb:5:10s:b2:o"
        );
    }

    #[test]
    fn known_slots_match_redis() {
        // Values from the Redis Cluster specification / CLUSTER KEYSLOT.
        assert_eq!(slot("123456789"), 12739);
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        assert_eq!(slot("foo{}{bar}"), slot("foo{}{bar}"));
        assert_eq!(slot("{}x"), crc16_xmodem(b"{}x") % 16384);
    }

    #[test]
    fn prefix_with_braces_is_refused() {
        assert!(validate_prefix("ok_prefix:").is_ok());
        assert!(validate_prefix("bad{").is_err());
    }

    fn component() -> impl Strategy<Value = String> {
        // Layout characters, separators and non-ASCII, heavily weighted.
        prop::collection::vec(
            prop_oneof![
                Just("{".to_string()),
                Just("}".to_string()),
                Just(":".to_string()),
                Just("_".to_string()),
                Just("|".to_string()),
                Just("=".to_string()),
                Just("%".to_string()),
                Just("%7B".to_string()),
                Just("é".to_string()),
                Just("雪".to_string()),
                "[a-z]{0,3}",
            ],
            0..5,
        )
        .prop_map(|v| v.concat())
    }

    fn counter_key_strategy() -> impl Strategy<Value = CounterKey> {
        (
            component(),
            prop::collection::vec((component(), component()), 1..4),
            0u32..4,
            prop_oneof![
                prop::sample::select(Unit::ALL.to_vec()).prop_map(Period::from_unit),
                (1u64..200_000).prop_filter_map("nonzero", Period::from_millis),
            ],
            prop::sample::select(Algorithm::ALL.to_vec()),
            0u32..3,
            (any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>()),
        )
            .prop_map(
                |(d, entries, rpu, period, algorithm, burst, (o, domain_tag, own, cand))| {
                    CounterKey {
                        domain: Arc::from(d.as_str()),
                        entries: entries.into(),
                        limit: Limit {
                            requests_per_unit: rpu,
                            period,
                            algorithm,
                            // Only token_bucket carries a burst (the loader sets 0 elsewhere).
                            burst: if algorithm == Algorithm::TokenBucket {
                                burst
                            } else {
                                0
                            },
                        },
                        overridden: o,
                        domain_tag,
                        // The plan never sets both (`hash_tag: domain` wins).
                        own_tag: own && !domain_tag,
                        candidate: cand,
                    }
                },
            )
    }

    proptest! {
        #[test]
        fn encoding_is_injective(a in counter_key_strategy(), b in counter_key_strategy()) {
            if a != b {
                prop_assert_ne!(counter_key("p:", &a), counter_key("p:", &b));
            } else {
                prop_assert_eq!(counter_key("p:", &a), counter_key("p:", &b));
            }
        }

        #[test]
        fn later_values_never_move_the_slot(
            base in counter_key_strategy(),
            extra in prop::collection::vec((component(), component()), 0..3),
            rpu in 0u32..1000,
        ) {
            let mut base = base;
            base.own_tag = false;
            let mut other = base.clone();
            let mut entries = other.entries.to_vec();
            entries.truncate(1);
            entries.extend(extra);
            other.entries = entries.into();
            other.limit.requests_per_unit = rpu;
            prop_assert_eq!(slot(&counter_key("p:", &base)), slot(&counter_key("p:", &other)));
            // The tag Redis sees is exactly the encoded domain + first entry.
            let full = counter_key("p:", &base);
            let open = full.find('{').unwrap_or(0);
            let close = full[open..].find('}').map(|c| open + c).unwrap_or(0);
            let tag = hash_tag(&base);
            prop_assert_eq!(&full[open + 1..close], tag.as_str());
            prop_assert_eq!(tag_slot(&tag), slot(&full));
        }
    }
}
