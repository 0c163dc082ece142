//! The decision log's writer: one thread of its own (file writes block; the request path and
//! the Tokio workers never wait on a disk), draining a bounded queue into JSON lines, rotated
//! by size. The log never holds more than `DECISION_LOG_MAX_BYTES` on disk: the file and its
//! `DECISION_LOG_FILES - 1` rotated predecessors (`path.1` the newest), each at most an equal
//! part of the cap; the oldest is deleted when a file rotates. A line that cannot be written
//! (disk full, the file gone) is dropped and counted, and the file opened again at the next
//! line: the log loses lines, never the service requests.

use super::line::Line;
use super::redact::Redact;
use super::Counters;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::time::Duration;

/// A quiet log is on disk within this long (its buffer flushed).
const FLUSH_AFTER: Duration = Duration::from_secs(1);
/// Lines are written to the file in batches of about this many bytes.
const BATCH: usize = 64 * 1024;

/// What the request path (and shutdown) sends the writer.
pub(super) enum Msg {
    Line(Box<Line>),
    /// Write out everything before this, then answer.
    Flush(SyncSender<()>),
}

/// Where and how much.
#[derive(Debug, Clone)]
pub(super) struct Files {
    pub path: PathBuf,
    /// The cap of one file (bytes): the whole cap over the number of files.
    pub per_file: u64,
    pub files: u32,
}

impl Files {
    /// `path.n` (`n` ≥ 1: rotated; 0: the file written now).
    pub fn nth(&self, n: u32) -> PathBuf {
        if n == 0 {
            return self.path.clone();
        }
        let mut p = self.path.clone().into_os_string();
        p.push(format!(".{n}"));
        PathBuf::from(p)
    }
}

pub(super) struct Writer {
    files: Files,
    redact: Redact,
    counters: Counters,
    /// `None` after a write failed: opened again for the next batch.
    file: Option<File>,
    /// Bytes in the file written now, this batch included.
    size: u64,
    /// Lines not written yet, and how many.
    batch: Vec<u8>,
    pending: u64,
}

impl Writer {
    /// Opens (appends to) the log file: an error here is the service's start error.
    pub fn open(files: Files, redact: Redact, counters: Counters) -> std::io::Result<Self> {
        let (file, size) = open(&files.path)?;
        Ok(Self {
            files,
            redact,
            counters,
            file: Some(file),
            size,
            batch: Vec::with_capacity(BATCH),
            pending: 0,
        })
    }

    /// Until every sender is gone: lines written in batches, flushed when the queue is quiet.
    pub fn run(mut self, rx: &Receiver<Msg>) {
        loop {
            match rx.recv_timeout(FLUSH_AFTER) {
                Ok(Msg::Line(line)) => self.add(*line),
                Ok(Msg::Flush(done)) => {
                    self.flush();
                    let _ = done.send(());
                }
                Err(RecvTimeoutError::Timeout) => self.flush(),
                Err(RecvTimeoutError::Disconnected) => {
                    self.flush();
                    return;
                }
            }
        }
    }

    fn add(&mut self, mut line: Line) {
        if self.redact.is_on() {
            for d in &mut line.descriptors {
                for (key, value) in &mut d.entries {
                    *value = self.redact.value(key, std::mem::take(value));
                }
            }
        }
        let start = self.batch.len();
        if serde_json::to_writer(&mut self.batch, &line).is_err() {
            self.batch.truncate(start);
            return self.counters.dropped_write.inc();
        }
        self.batch.push(b'\n');
        let len = (self.batch.len() - start) as u64;
        if self.size > 0 && self.size + len > self.files.per_file {
            // The batch before this line goes to the file it belongs to.
            let line = self.batch.split_off(start);
            self.flush();
            self.rotate();
            self.batch = line;
        }
        self.size += len;
        self.pending += 1;
        if self.batch.len() >= BATCH {
            self.flush();
        }
    }

    /// The batch to the file; its lines counted written, or dropped if the write failed.
    fn flush(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        if self.file.is_none() {
            match open(&self.files.path) {
                Ok((file, size)) => {
                    self.file = Some(file);
                    self.size = size + self.batch.len() as u64;
                }
                Err(_) => return self.drop_batch(),
            }
        }
        let written = self.file.as_mut().map(|f| f.write_all(&self.batch));
        match written {
            Some(Ok(())) => {
                self.counters.lines.inc_by(self.pending);
                self.batch.clear();
                self.pending = 0;
            }
            Some(Err(e)) => {
                // Disk full or the file gone: the batch is lost (part of it may be on disk);
                // the file is opened again for the next.
                tracing::debug!(error = %e, "cannot write the decision log");
                self.file = None;
                self.drop_batch();
            }
            None => self.drop_batch(),
        }
    }

    fn drop_batch(&mut self) {
        self.counters.dropped_write.inc_by(self.pending);
        self.size = self.size.saturating_sub(self.batch.len() as u64);
        self.batch.clear();
        self.pending = 0;
    }

    /// The file written now becomes `path.1`, each older one moves up, the oldest goes.
    fn rotate(&mut self) {
        self.file = None;
        let f = &self.files;
        if f.files <= 1 {
            // One file: it starts again empty.
            let _ = std::fs::remove_file(&f.path);
        } else {
            let _ = std::fs::remove_file(f.nth(f.files - 1));
            for n in (0..f.files - 1).rev() {
                let _ = std::fs::rename(f.nth(n), f.nth(n + 1));
            }
        }
        self.size = 0;
        if let Ok((file, size)) = open(&self.files.path) {
            self.file = Some(file);
            self.size = size;
        }
    }
}

fn open(path: &Path) -> std::io::Result<(File, u64)> {
    let file = OpenOptions::new().create(true).append(true).open(path)?;
    let size = file.metadata()?.len();
    Ok((file, size))
}
