use super::*;
use crate::proto::rate_limit_descriptor::Entry;
use crate::proto::RateLimitDescriptor;

fn counters() -> Counters {
    let c = |n: &str| IntCounter::new(n, "test").unwrap();
    Counters {
        lines: c("lines"),
        dropped_queue: c("dropped_queue"),
        dropped_write: c("dropped_write"),
        dropped_large: c("dropped_large"),
    }
}

fn settings(path: PathBuf) -> Settings {
    Settings {
        path,
        max_bytes: 1 << 30,
        files: 4,
        sample: 1.0,
        redact: String::new(),
        salt: Vec::new(),
        queue: 1024,
    }
}

fn request(user: &str) -> RateLimitRequest {
    RateLimitRequest {
        domain: "d".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "user".into(),
                value: user.into(),
            }],
            ..Default::default()
        }],
        hits_addend: 0,
    }
}

fn line(i: u64) -> Line {
    Line::of(
        request(&format!("u{i}")),
        1_000 + i,
        i % 2 == 0,
        &[i % 2 == 1],
    )
}

#[test]
fn lines_reach_the_file_in_order_with_the_named_values_redacted() {
    let dir = tempdir();
    let path = dir.path().join("decisions.log");
    let c = counters();
    let s = Settings {
        redact: "user".into(),
        salt: b"pepper, a long one".to_vec(),
        ..settings(path.clone())
    };
    let log = DecisionLog::start(s, c.clone()).unwrap();
    for i in 0..100 {
        log.record(line(i));
    }
    assert!(log.flush(Duration::from_secs(10)));
    let (back, _) = read_lines(&path).unwrap();
    assert_eq!(back.len(), 100);
    assert_eq!(c.lines.get(), 100);
    for (i, l) in back.iter().enumerate() {
        let want = line(i as u64);
        assert_eq!((l.t, l.ok), (want.t, want.ok));
        let value = &l.descriptors[0].entries[0].1;
        assert!(
            value.starts_with("h:") && !value.contains(&format!("u{i}")),
            "{value}"
        );
    }
    // One consumer, one digest.
    assert_ne!(
        back[0].descriptors[0].entries,
        back[1].descriptors[0].entries
    );
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(!text.contains("\"u1\""), "no raw value on disk");
}

#[test]
fn the_log_is_rotated_and_never_holds_more_than_its_cap() {
    let dir = tempdir();
    let path = dir.path().join("d.log");
    let s = Settings {
        max_bytes: 3 * MIN_FILE_BYTES,
        files: 3,
        // Room for every line: none dropped at the queue.
        queue: 8_192,
        ..settings(path.clone())
    };
    let c = counters();
    let log = DecisionLog::start(s, c.clone()).unwrap();
    for i in 0..5_000 {
        log.record(line(i));
    }
    assert!(log.flush(Duration::from_secs(10)));
    assert_eq!((c.lines.get(), c.dropped_queue.get()), (5_000, 0));
    let files = Files {
        path: path.clone(),
        per_file: MIN_FILE_BYTES,
        files: 3,
    };
    let mut total = 0;
    for n in 0..3 {
        let bytes = std::fs::metadata(files.nth(n)).unwrap().len();
        assert!(bytes <= MIN_FILE_BYTES, "{n}: {bytes}");
        total += bytes;
    }
    assert!(
        total <= 3 * MIN_FILE_BYTES && total > 2 * MIN_FILE_BYTES,
        "{total}"
    );
    assert!(!files.nth(3).exists(), "the oldest goes");
    // The newest lines are in the file written now, whole, in order.
    let (newest, _) = read_lines(&path).unwrap();
    assert_eq!(newest.last().map(|l| l.t), Some(1_000 + 4_999));
    assert!(newest.windows(2).all(|w| w[0].t + 1 == w[1].t));
    let (older, _) = read_lines(&files.nth(1)).unwrap();
    assert_eq!(older.last().map(|l| l.t + 1), newest.first().map(|l| l.t));
}

#[test]
fn a_full_disk_drops_lines_and_counts_them_and_the_log_goes_on() {
    // /dev/full takes the open and fails every write with ENOSPC.
    let c = counters();
    let log = DecisionLog::start(settings("/dev/full".into()), c.clone()).unwrap();
    for i in 0..10 {
        log.record(line(i));
    }
    assert!(log.flush(Duration::from_secs(10)));
    assert_eq!(c.dropped_write.get(), 10);
    assert_eq!(c.lines.get(), 0);
}

#[test]
fn a_full_queue_drops_the_line_at_once_and_counts_it() {
    let c = counters();
    // A writer that never drains: the queue holds two lines.
    let (tx, _rx) = sync_channel(2);
    let log = DecisionLog {
        tx,
        counters: c.clone(),
        sample_below: u64::MAX,
        sampling: Default::default(),
        queued: Default::default(),
    };
    for i in 0..5 {
        log.record(line(i));
    }
    assert_eq!(c.dropped_queue.get(), 3);
}

#[test]
fn sampling_keeps_a_consumer_whole() {
    let log = DecisionLog {
        tx: sync_channel(1).0,
        counters: counters(),
        sample_below: u64::MAX / 4,
        sampling: Default::default(),
        queued: Default::default(),
    };
    let kept: Vec<bool> = (0..400)
        .map(|i| log.wants(&request(&format!("u{i}"))))
        .collect();
    let n = kept.iter().filter(|k| **k).count();
    assert!((50..150).contains(&n), "about a quarter: {n}");
    // The same consumer, the same answer.
    for (i, k) in kept.iter().enumerate() {
        assert_eq!(log.wants(&request(&format!("u{i}"))), *k);
    }
}

#[test]
fn a_log_file_that_cannot_be_opened_is_a_start_error_naming_it() {
    let e = DecisionLog::start(settings("/nonexistent/dir/d.log".into()), counters())
        .err()
        .unwrap();
    assert!(e.contains("/nonexistent/dir/d.log"), "{e}");
}

#[test]
fn lines_that_do_not_parse_are_skipped_counted_and_named() {
    let dir = tempdir();
    let path = dir.path().join("bad.log");
    let good = serde_json::to_string(&line(1)).unwrap();
    // A torn last line (a crash mid-write) and a line of something else: skipped, named.
    std::fs::write(
        &path,
        format!("{good}\n{{\"t\":1}}\n{good}\n{{\"t\":2,\"dom"),
    )
    .unwrap();
    let (lines, skipped) = read_lines(&path).unwrap();
    assert_eq!(lines.len(), 2);
    assert_eq!(skipped.lines, 2);
    let first = skipped.first.unwrap();
    assert!(first.contains("bad.log:2:"), "{first}");
    // A line cut mid-character (not UTF-8 any more) is skipped too; a file of nothing else
    // reads as empty (the replay refuses a log with no line at all, naming the first).
    let mut torn = b"{\"t\":1,\"domain\":\"\xc3".to_vec();
    torn.push(b'\n');
    std::fs::write(&path, torn).unwrap();
    let (lines, skipped) = read_lines(&path).unwrap();
    assert!(lines.is_empty() && skipped.lines == 1);
    assert!(skipped.first.unwrap().contains("bad.log:1:"));
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

#[test]
fn settings_that_break_a_bound_are_start_errors() {
    let dir = tempdir();
    let small = Settings {
        max_bytes: 100 * 1024,
        files: 5,
        ..settings(dir.path().join("a.log"))
    };
    let e = DecisionLog::start(small, counters()).err().unwrap();
    assert!(e.contains("DECISION_LOG_FILES"), "{e}");
    let unsalted = Settings {
        redact: "user".into(),
        salt: b"short".to_vec(),
        ..settings(dir.path().join("b.log"))
    };
    let e = DecisionLog::start(unsalted.clone(), counters())
        .err()
        .unwrap();
    assert!(e.contains("DECISION_LOG_REDACT_SALT"), "{e}");
    assert!(
        !format!("{unsalted:?}").contains("short"),
        "no salt in Debug"
    );
}

#[test]
fn a_line_larger_than_a_file_and_a_queue_full_of_bytes_are_dropped_and_counted() {
    let dir = tempdir();
    let path = dir.path().join("d.log");
    let c = counters();
    let s = Settings {
        max_bytes: 2 * MIN_FILE_BYTES,
        files: 2,
        ..settings(path.clone())
    };
    let log = DecisionLog::start(s, c.clone()).unwrap();
    log.record(line(1));
    log.record(Line::of(request(&"x".repeat(70_000)), 2, true, &[]));
    log.record(line(3));
    assert!(log.flush(Duration::from_secs(10)));
    assert_eq!((c.lines.get(), c.dropped_large.get()), (2, 1));
    assert!(std::fs::metadata(&path).unwrap().len() < MIN_FILE_BYTES);
    // A queue holding its bytes' worth: the next line is dropped at once.
    let (tx, _rx) = sync_channel(1000);
    let full = DecisionLog {
        tx,
        counters: c.clone(),
        sample_below: u64::MAX,
        sampling: Default::default(),
        queued: Arc::new(AtomicU64::new(QUEUE_BYTES)),
    };
    full.record(line(4));
    assert_eq!(c.dropped_queue.get(), 1);
    assert_eq!(
        full.queued.load(Ordering::Relaxed),
        QUEUE_BYTES,
        "given back"
    );
}

#[test]
fn a_torn_last_line_is_ended_before_the_next_is_written() {
    let dir = tempdir();
    let path = dir.path().join("d.log");
    std::fs::write(&path, "{\"t\":1,\"dom").unwrap();
    let log = DecisionLog::start(settings(path.clone()), counters()).unwrap();
    log.record(line(7));
    assert!(log.flush(Duration::from_secs(10)));
    let (lines, skipped) = read_lines(&path).unwrap();
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0].t, 1_007);
    assert_eq!(skipped.lines, 1, "the torn line alone is lost");
}
