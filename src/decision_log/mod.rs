//! The decision log (`DECISION_LOG=path`, off by default): each decided request's domain,
//! descriptors, hits, time and answer, as JSON lines that `sluice replay` feeds a config
//! again ("who would a limit of 50 have stopped yesterday?").
//!
//! Why it can never slow a request: the request path only samples, moves the request it
//! already owns into a line and offers it to a bounded queue (`try_send`: when the queue is
//! full, in lines or in bytes, the line is dropped and counted, the request goes on).
//! Redaction, encoding and the disk are the writer thread's (`writer.rs`), which holds at most
//! `DECISION_LOG_MAX_BYTES` on disk. Sampling is by the request's entries (with its domain),
//! under a key of this process: the same entries are all in the log or none is (a consumer
//! that sends the same descriptors each time is whole in it), and a caller cannot aim at
//! values that are left out.

pub mod line;
pub mod redact;
mod writer;

use crate::proto::RateLimitRequest;
use line::Line;
use prometheus::IntCounter;
use std::hash::{BuildHasher, Hash, Hasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

/// The most the queue holds in bytes of requests, whatever their number: a request may be
/// 4 MiB within the request caps, and a queue of 65 536 of them would not be bounded.
pub const QUEUE_BYTES: u64 = 64 << 20;
/// The least a file may hold (`DECISION_LOG_MAX_BYTES / DECISION_LOG_FILES`).
pub const MIN_FILE_BYTES: u64 = 64 << 10;
/// The shortest `DECISION_LOG_REDACT_SALT` (a short key is guessed, and with it the values).
pub const MIN_SALT_BYTES: usize = 16;
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
    /// Lines dropped because they were larger than a file may be.
    pub dropped_large: IntCounter,
}

/// `DECISION_LOG_*`, parsed.
#[derive(Clone)]
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

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the salt.
        f.debug_struct("Settings")
            .field("path", &self.path)
            .field("max_bytes", &self.max_bytes)
            .field("files", &self.files)
            .field("sample", &self.sample)
            .field("redact", &self.redact)
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

/// The request path's handle on the log.
#[derive(Debug, Clone)]
pub struct DecisionLog {
    tx: SyncSender<Msg>,
    counters: Counters,
    /// A request is logged when its entries' hash is below this (`u64::MAX`: all).
    sample_below: u64,
    /// The sampling hash's key (this process's own).
    sampling: std::hash::RandomState,
    /// Bytes of the lines in the queue, at most [`QUEUE_BYTES`].
    queued: Arc<AtomicU64>,
}

impl DecisionLog {
    /// Opens the file and starts the writer thread; an error names the file.
    pub fn start(s: Settings, counters: Counters) -> Result<Self, String> {
        let files = s.files.max(1);
        let per_file = s.max_bytes / u64::from(files);
        if per_file < MIN_FILE_BYTES {
            return Err(format!(
                "DECISION_LOG_MAX_BYTES / DECISION_LOG_FILES is {per_file} bytes a file, under \
                 {MIN_FILE_BYTES}: raise the cap or use fewer files"
            ));
        }
        let redact = redact::Redact::new(&s.redact, &s.salt);
        if redact.is_on() && s.salt.len() < MIN_SALT_BYTES {
            return Err(format!(
                "DECISION_LOG_REDACT needs DECISION_LOG_REDACT_SALT of at least \
                 {MIN_SALT_BYTES} bytes: without a secret key a digest of a guessable value \
                 (a user id, an address) is guessed back"
            ));
        }
        let files = Files {
            path: s.path.clone(),
            per_file,
            files,
        };
        writer::remove_stale(&files);
        let queued = Arc::new(AtomicU64::new(0));
        let writer = Writer::open(files, redact, counters.clone(), Arc::clone(&queued))
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
            sampling: std::hash::RandomState::new(),
            queued,
        })
    }

    /// Whether `request`'s consumer is sampled (cheap: one hash of its entries, no allocation).
    pub fn wants(&self, request: &RateLimitRequest) -> bool {
        if self.sample_below == u64::MAX {
            return true;
        }
        let mut h = self.sampling.build_hasher();
        request.domain.hash(&mut h);
        for d in &request.descriptors {
            for e in &d.entries {
                e.key.hash(&mut h);
                e.value.hash(&mut h);
            }
        }
        h.finish() < self.sample_below
    }

    /// Offers a decided request to the writer: never waits (a queue full of lines or of
    /// [`QUEUE_BYTES`] drops the line, counted).
    pub fn record(&self, line: Line) {
        let bytes = weight(&line);
        let before = self.queued.fetch_add(bytes, Ordering::Relaxed);
        if before.saturating_add(bytes) > QUEUE_BYTES {
            self.queued.fetch_sub(bytes, Ordering::Relaxed);
            return self.counters.dropped_queue.inc();
        }
        let lost = match self.tx.try_send(Msg::Line(Box::new(line), bytes)) {
            Ok(()) => return,
            Err(TrySendError::Full(_)) => &self.counters.dropped_queue,
            // The writer is gone (it never stops while a sender lives): counted the same.
            Err(TrySendError::Disconnected(_)) => &self.counters.dropped_write,
        };
        self.queued.fetch_sub(bytes, Ordering::Relaxed);
        lost.inc();
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

/// What a line holds in memory, about: its strings and a little for each of its parts.
fn weight(line: &Line) -> u64 {
    let strings: usize = line
        .descriptors
        .iter()
        .map(|d| {
            64 + d
                .entries
                .iter()
                .map(|(k, v)| k.len() + v.len() + 48)
                .sum::<usize>()
        })
        .sum();
    (strings + line.domain.len() + 128) as u64
}

/// Lines of a log that did not parse: how many, and the first, named `file:line: why`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Skipped {
    pub lines: u64,
    pub first: Option<String>,
}

/// Every line of a log file, in order (a replay's input), and the lines that do not parse
/// (skipped: a log cut by a full disk or a crash, even mid-character, still replays); a file
/// that cannot be read is an error naming it.
pub fn read_lines(path: &std::path::Path) -> Result<(Vec<Line>, Skipped), String> {
    use std::io::BufRead;
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut reader = std::io::BufReader::new(file);
    let (mut out, mut skipped) = (Vec::new(), Skipped::default());
    let mut buf = Vec::new();
    for n in 1.. {
        buf.clear();
        let read = reader
            .read_until(b'\n', &mut buf)
            .map_err(|e| format!("{}:{n}: {e}", path.display()))?;
        if read == 0 {
            break;
        }
        if buf.trim_ascii().is_empty() {
            continue;
        }
        match serde_json::from_slice::<Line>(&buf) {
            Ok(line) => out.push(line),
            Err(e) => {
                skipped.lines += 1;
                skipped.first.get_or_insert_with(|| {
                    format!("{}:{n}: not a decision log line: {e}", path.display())
                });
            }
        }
    }
    Ok((out, skipped))
}

#[cfg(test)]
mod tests;
