//! The decision log (`DECISION_LOG=path`, off by default): each decided request's domain,
//! descriptors, hits, time and answer, as JSON lines that `sluice replay` feeds a config
//! again ("who would a limit of 50 have stopped yesterday?").
//!
//! Why it can never slow a request: the request path only samples, moves the request it
//! already owns into a line and offers it to a bounded queue (`try_send`: when the queue is
//! full the line is dropped and counted, the request goes on). Redaction, encoding and the
//! disk are the writer thread's (`writer.rs`), which holds at most `DECISION_LOG_MAX_BYTES`
//! on disk. Sampling is by consumer, not by request: a request's descriptors (with its domain)
//! decide whether it is logged, so a consumer's requests are all in the log or none is, and
//! a replay counts what each logged consumer sent exactly.

pub mod line;
pub mod redact;
mod writer;

use crate::proto::RateLimitRequest;
use line::Line;
use prometheus::IntCounter;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::time::Duration;
use writer::{Files, Msg, Writer};

/// The counters the log feeds (`sluice_decision_log_*`, registered with the other metrics).
#[derive(Debug, Clone)]
pub struct Counters {
    /// Lines written to the file.
    pub lines: IntCounter,
    /// Lines dropped because the queue was full.
    pub dropped_queue: IntCounter,
    /// Lines dropped because the file could not be written.
    pub dropped_write: IntCounter,
}

/// `DECISION_LOG_*`, parsed.
#[derive(Debug, Clone)]
pub struct Settings {
    pub path: PathBuf,
    /// The cap on the log's bytes on disk, rotated files included.
    pub max_bytes: u64,
    /// Files the cap is split into (the file written and the rotated ones).
    pub files: u32,
    /// The share of consumers logged (1: every request).
    pub sample: f64,
    /// `DECISION_LOG_REDACT`: keys whose values are logged as digests.
    pub redact: String,
    pub salt: Vec<u8>,
    /// Lines the queue holds at most.
    pub queue: usize,
}

/// The request path's handle on the log.
#[derive(Debug, Clone)]
pub struct DecisionLog {
    tx: SyncSender<Msg>,
    counters: Counters,
    /// A request is logged when its consumer's hash is below this (`u64::MAX`: all).
    sample_below: u64,
}

impl DecisionLog {
    /// Opens the file and starts the writer thread; an error names the file.
    pub fn start(s: Settings, counters: Counters) -> Result<Self, String> {
        let files = s.files.max(1);
        let per_file = (s.max_bytes / u64::from(files)).max(1);
        let files = Files {
            path: s.path.clone(),
            per_file,
            files,
        };
        let redact = redact::Redact::new(&s.redact, &s.salt);
        let writer = Writer::open(files, redact, counters.clone())
            .map_err(|e| format!("cannot open the decision log {}: {e}", s.path.display()))?;
        let (tx, rx) = sync_channel(s.queue.max(1));
        std::thread::Builder::new()
            .name("decision-log".into())
            .spawn(move || writer.run(&rx))
            .map_err(|e| format!("cannot start the decision log's writer: {e}"))?;
        let sample_below = if s.sample >= 1.0 {
            u64::MAX
        } else {
            // Saturating float-to-int: a share of 0.25 logs a quarter of the consumers.
            (s.sample.max(0.0) * u64::MAX as f64) as u64
        };
        Ok(Self {
            tx,
            counters,
            sample_below,
        })
    }

    /// Whether `request`'s consumer is sampled (cheap: one hash of its entries, no allocation).
    pub fn wants(&self, request: &RateLimitRequest) -> bool {
        if self.sample_below == u64::MAX {
            return true;
        }
        let mut h = std::hash::DefaultHasher::new();
        request.domain.hash(&mut h);
        for d in &request.descriptors {
            for e in &d.entries {
                e.key.hash(&mut h);
                e.value.hash(&mut h);
            }
        }
        h.finish() < self.sample_below
    }

    /// Offers a decided request to the writer: never waits (a full queue drops the line).
    pub fn record(&self, line: Line) {
        match self.tx.try_send(Msg::Line(Box::new(line))) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => self.counters.dropped_queue.inc(),
            // The writer is gone (it never stops while a sender lives): counted the same.
            Err(TrySendError::Disconnected(_)) => self.counters.dropped_write.inc(),
        }
    }

    /// Waits (at most `within`) until every line recorded so far is on disk (shutdown, tests).
    pub fn flush(&self, within: Duration) -> bool {
        let (done, wait) = sync_channel(1);
        let deadline = std::time::Instant::now() + within;
        let mut msg = Msg::Flush(done);
        // The queue may be full: try until the deadline (this is never the request path).
        loop {
            match self.tx.try_send(msg) {
                Ok(()) => break,
                Err(TrySendError::Full(m)) if std::time::Instant::now() < deadline => {
                    msg = m;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(_) => return false,
            }
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        wait.recv_timeout(left).is_ok()
    }
}

/// Every line of a log file, in order (a replay's input); a line that does not parse is an
/// error naming the file and line.
pub fn read_lines(path: &std::path::Path) -> Result<Vec<Line>, String> {
    use std::io::BufRead;
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (i, text) in std::io::BufReader::new(file).lines().enumerate() {
        let text = text.map_err(|e| format!("{}:{}: {e}", path.display(), i + 1))?;
        if text.trim().is_empty() {
            continue;
        }
        let line: Line = serde_json::from_str(&text)
            .map_err(|e| format!("{}:{}: not a decision log line: {e}", path.display(), i + 1))?;
        out.push(line);
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
