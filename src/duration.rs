//! The one table of duration suffixes, and the two grammars built on it: Go's
//! `time.ParseDuration` for settings (as envoyproxy/ratelimit reads its env vars), and the
//! config's `period:` (a whole number and one suffix, so a window is an exact count of ms).

/// Every suffix sluice reads, in nanoseconds. `w` is the config's only: Go has no weeks.
const SUFFIXES: [(&str, u64); 10] = [
    ("ns", 1),
    ("us", 1_000),
    ("µs", 1_000),
    ("μs", 1_000),
    ("ms", 1_000_000),
    ("s", 1_000_000_000),
    ("m", 60_000_000_000),
    ("h", 3_600_000_000_000),
    ("d", 86_400_000_000_000),
    ("w", 604_800_000_000_000),
];

fn suffix_nanos(suffix: &str) -> Option<u64> {
    SUFFIXES.iter().find(|(s, _)| *s == suffix).map(|&(_, n)| n)
}

/// A duration as Go's `time.ParseDuration` writes them (`15s`, `500ms`, `1m30s`, `1.5h`, units
/// ns/us/µs/ms/s/m/h, plus `d` for days); a bare number means seconds.
pub fn parse_go(s: &str) -> Result<std::time::Duration, String> {
    use std::time::Duration;
    let bad = || format!("invalid duration {s:?} (examples: 15s, 500ms, 1m30s)");
    let t = s.trim();
    if t.is_empty() {
        return Err(bad());
    }
    if let Ok(secs) = t.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    let mut total = Duration::ZERO;
    let mut rest = t;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        let (num, tail) = rest.split_at(num_len);
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let value: f64 = num.parse().map_err(|_| bad())?;
        let nanos = suffix_nanos(unit).filter(|_| unit != "w").ok_or_else(bad)?;
        let part = Duration::try_from_secs_f64(value * nanos as f64 / 1e9).map_err(|_| bad())?;
        total = total.checked_add(part).ok_or_else(bad)?;
        rest = tail;
    }
    Ok(total)
}

/// `d` in the largest Go unit that writes it exactly (`100ms`, `15s`, `24h`), so a default
/// kept as a `Duration` constant is also what `--help` shows and what [`parse_go`] reads back.
pub fn format_go(d: std::time::Duration) -> String {
    let nanos = d.as_nanos();
    const UNITS: [(&str, u128); 6] = [
        ("h", 3_600_000_000_000),
        ("m", 60_000_000_000),
        ("s", 1_000_000_000),
        ("ms", 1_000_000),
        ("us", 1_000),
        ("ns", 1),
    ];
    if nanos == 0 {
        return "0s".into();
    }
    let (unit, size) = UNITS
        .into_iter()
        .find(|(_, size)| nanos % size == 0)
        .unwrap_or(("ns", 1));
    format!("{}{unit}", nanos / size)
}

/// A config period in milliseconds: `500ms`, `10s`, `5m`, `1h`, `2d`, `1w` (a whole number and
/// one suffix of a millisecond or more); the error names what is wrong.
pub fn parse_period_millis(s: &str) -> Result<u64, String> {
    let split = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("period '{s}' needs a unit suffix (ms, s, m, h, d or w)"))?;
    let (num, suffix) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("period '{s}' must start with a whole number"))?;
    let factor = suffix_nanos(suffix)
        .filter(|&nanos| nanos >= 1_000_000)
        .map(|nanos| nanos / 1_000_000)
        .ok_or_else(|| {
            format!("period '{s}' has an unknown suffix '{suffix}' (use ms, s, m, h, d or w)")
        })?;
    n.checked_mul(factor).ok_or_else(|| {
        format!("period '{s}' must be longer than zero and shorter than 584 million years")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn format_go_writes_what_parse_go_reads_back() {
        for (d, text) in [
            (Duration::from_millis(100), "100ms"),
            (Duration::from_secs(15), "15s"),
            (Duration::from_secs(90), "90s"),
            (Duration::from_secs(86_400), "24h"),
            (Duration::from_micros(1_500), "1500us"),
            (Duration::ZERO, "0s"),
        ] {
            assert_eq!(format_go(d), text);
            assert_eq!(parse_go(text), Ok(d), "{text}");
        }
    }
}
