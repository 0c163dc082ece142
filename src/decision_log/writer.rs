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
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A quiet log is on disk within this long (its buffer flushed).
const FLUSH_AFTER: Duration = Duration::from_secs(1);
/// Lines are written to the file in batches of about this many bytes.
const BATCH: usize = 64 * 1024;

/// What the request path (and shutdown) sends the writer.
pub(super) enum Msg {
    /// A line, and the bytes it was counted for in the queue (`DecisionLog::record`).
    Line(Box<Line>, u64),
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
    /// Bytes of the lines waiting in the queue (given back as each is taken).
    queued: Arc<AtomicU64>,
    /// When the oldest line of the batch came (it is written within [`FLUSH_AFTER`]).
    oldest: Option<Instant>,
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
    pub fn open(
        files: Files,
        redact: Redact,
        counters: Counters,
        queued: Arc<AtomicU64>,
    ) -> std::io::Result<Self> {
        let (file, size) = open(&files.path)?;
        Ok(Self {
            files,
            redact,
            counters,
            queued,
            oldest: None,
            file: Some(file),
            size,
            batch: Vec::with_capacity(BATCH),
            pending: 0,
        })
    }

    /// Until every sender is gone: lines written in batches, each line within [`FLUSH_AFTER`]
    /// of its coming.
    pub fn run(mut self, rx: &Receiver<Msg>) {
        loop {
            let wait = self
                .oldest
                .map_or(FLUSH_AFTER, |t| FLUSH_AFTER.saturating_sub(t.elapsed()));
            match rx.recv_timeout(wait) {
                Ok(Msg::Line(line, bytes)) => {
                    self.queued.fetch_sub(bytes, Ordering::Relaxed);
                    self.add(*line);
                    if self.oldest.is_some_and(|t| t.elapsed() >= FLUSH_AFTER) {
                        self.flush();
                    }
                }
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
        if len > self.files.per_file {
            // No file may hold it: dropped, so the cap holds whatever a caller sends (and the
            // batch's room it took given back).
            self.batch.truncate(start);
            self.batch.shrink_to(BATCH);
            return self.counters.dropped_large.inc();
        }
        if self.size > 0 && self.size + len > self.files.per_file {
            // The batch before this line goes to the file it belongs to.
            let line = self.batch.split_off(start);
            self.flush();
            self.rotate();
            self.batch = line;
        }
        self.size += len;
        self.pending += 1;
        self.oldest.get_or_insert_with(Instant::now);
        if self.batch.len() >= BATCH {
            self.flush();
        }
    }

    /// The batch to the file; its lines counted written, or dropped if the write failed.
    fn flush(&mut self) {
        self.oldest = None;
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
        let written = self.file.as_mut().map(|f| {
            let before = f.metadata().map(|m| m.len());
            let r = f.write_all(&self.batch);
            if r.is_err() {
                // No torn line left behind: the file back to its last whole line.
                if let Ok(len) = before {
                    let _ = f.set_len(len);
                }
            }
            r
        });
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
        let moved = if f.files <= 1 {
            false
        } else {
            let _ = std::fs::remove_file(f.nth(f.files - 1));
            for n in (1..f.files - 1).rev() {
                let _ = std::fs::rename(f.nth(n), f.nth(n + 1));
            }
            std::fs::rename(&f.path, f.nth(1)).is_ok()
        };
        if !moved {
            // One file, or it could not be moved aside (a directory not writable): it starts
            // again empty, so the cap holds.
            if let Ok(file) = OpenOptions::new().write(true).open(&f.path) {
                let _ = file.set_len(0);
            }
        }
        self.size = 0;
        if let Ok((file, size)) = open(&self.files.path) {
            self.file = Some(file);
            self.size = size;
        }
    }
}

/// The file to append to, and its size; a last line left torn (a crash mid-write) is ended,
/// so the next line starts on a line of its own (best effort: a file that cannot be read, or
/// a disk too full for the newline, is opened all the same).
fn open(path: &Path) -> std::io::Result<(File, u64)> {
    // Read and append first: opening a named pipe for writing alone waits for a reader (a
    // start that never ends); a file that may not be read is opened to append only.
    let file = OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .open(path)
        .or_else(|_| OpenOptions::new().create(true).append(true).open(path))?;
    let mut size = file.metadata()?.len();
    if size > 0 && file.metadata()?.is_file() && ends_torn(path, size) {
        let mut f = &file;
        if f.write_all(b"\n").is_ok() {
            size += 1;
        }
    }
    Ok((file, size))
}

/// Whether the file's last byte is not a newline (a line cut short).
fn ends_torn(path: &Path, size: u64) -> bool {
    let mut last = [0u8];
    let read = File::open(path).and_then(|mut f| {
        f.seek(SeekFrom::Start(size - 1))?;
        f.read_exact(&mut last)
    });
    read.is_ok() && last[0] != b'\n'
}

/// Rotated files numbered past the ones kept (left by a run with more `DECISION_LOG_FILES`)
/// are deleted, so the cap holds for what is on disk.
pub(super) fn remove_stale(files: &Files) {
    for n in files.files..files.files.saturating_add(1000) {
        if std::fs::remove_file(files.nth(n)).is_err() {
            break;
        }
    }
}
