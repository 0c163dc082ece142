//! `DECISION_LOG_*`: the decision log (`decision_log`), off unless `DECISION_LOG` names a file.

use super::Secret;
use clap::Args;
use std::path::PathBuf;

#[derive(Debug, Clone, Args)]
pub struct DecisionLogArgs {
    /// Write each decided request (domain, descriptors, hits, time, answer) as a JSON line to
    /// this file, off the request path, for `sluice replay`. Off when unset.
    #[arg(long, env = "DECISION_LOG")]
    pub decision_log: Option<PathBuf>,

    /// The most the log holds on disk, rotated files included (bytes; K, M, G suffixes).
    #[arg(
        long,
        env = "DECISION_LOG_MAX_BYTES",
        default_value = "1G",
        value_parser = parse_bytes
    )]
    pub decision_log_max_bytes: u64,

    /// Files the cap is split into: the file written and the rotated ones (`path.1` newest).
    #[arg(long, env = "DECISION_LOG_FILES", default_value_t = 5,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub decision_log_files: u32,

    /// The share of requests logged, 0 to 1, by a hash (keyed by this process) of the
    /// request's domain and entries: requests with the same entries are all logged or none.
    #[arg(long, env = "DECISION_LOG_SAMPLE", default_value = "1", value_parser = super::parse_ratio)]
    pub decision_log_sample: f64,

    /// Descriptor keys whose values are logged as digests (HMAC-SHA256 under
    /// DECISION_LOG_REDACT_SALT), separated by commas; `*` for every value.
    #[arg(long, env = "DECISION_LOG_REDACT", default_value = "")]
    pub decision_log_redact: String,

    /// The key of the redaction digests, at least 16 bytes, required with
    /// DECISION_LOG_REDACT (keep it secret: with it, a guessed value can be checked).
    #[arg(long, env = "DECISION_LOG_REDACT_SALT", hide_env_values = true)]
    pub decision_log_redact_salt: Option<Secret>,

    /// Lines waiting for the writer at most; when full, lines are dropped and counted
    /// (`sluice_decision_log_dropped_total{reason="queue_full"}`), never a request delayed.
    #[arg(long, env = "DECISION_LOG_QUEUE", default_value_t = 65_536,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub decision_log_queue: u32,
}

impl DecisionLogArgs {
    /// The log's settings, when it is on.
    pub fn settings(&self) -> Option<crate::decision_log::Settings> {
        let path = self.decision_log.clone()?;
        Some(crate::decision_log::Settings {
            path,
            max_bytes: self.decision_log_max_bytes,
            files: self.decision_log_files,
            sample: self.decision_log_sample,
            redact: self.decision_log_redact.clone(),
            salt: self
                .decision_log_redact_salt
                .as_ref()
                .map(|s| s.expose().as_bytes().to_vec())
                .unwrap_or_default(),
            queue: usize::try_from(self.decision_log_queue).unwrap_or(usize::MAX),
        })
    }
}

/// A byte count: digits with an optional `K`, `M` or `G` (powers of 1024), at least 4 KiB.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (digits, unit) = match t.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => (&t[..i], t[i..].trim().to_ascii_uppercase()),
        None => (t, String::new()),
    };
    let shift = match unit.trim_end_matches(['B', 'I']).trim() {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        _ => {
            return Err(format!(
                "invalid size {s:?} (bytes, or a number with K, M or G)"
            ))
        }
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("invalid size {s:?} (bytes, or a number with K, M or G)"))?;
    let bytes = n
        .checked_mul(1 << shift)
        .ok_or_else(|| format!("size {s:?} is too large"))?;
    if bytes < 4096 {
        return Err(format!("size {s:?} is below 4K"));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_parse_with_their_units_and_nonsense_is_refused() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("64K"), Ok(64 << 10));
        assert_eq!(parse_bytes("100M"), Ok(100 << 20));
        assert_eq!(parse_bytes("1G"), Ok(1 << 30));
        assert_eq!(parse_bytes("2 GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes("10mb"), Ok(10 << 20));
        for bad in ["", "K", "1T", "-5M", "1.5G", "100", "99999999999999999999G"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }
}
