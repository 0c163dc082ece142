//! Calendar windows (issue 39 item 5), on every store, with the manual clock: a monthly budget
//! in America/New_York resets at local midnight on Dec 1, a daily limit has a 25-hour day when
//! DST ends, a billing month anchored on the 31st runs to the last of February (29 in 2028), a
//! week starts on its Monday, and `USE_CALENDAR_MONTH_RATE_LIMIT` gives UTC months while
//! `unit: month` without it stays envoyproxy's 30 days. `durationUntilReset` is exactly the
//! time to the boundary; on Redis so is the key's TTL.

use crate::cases::store::{make_store, Backend};
use crate::support::{code, one, reset_secs, rules_of, TestServer};
use sluice::app::Ingredients;
use sluice::clock::ManualClock;
use sluice::proto::rate_limit_response::Code;
use sluice::server::ServerConfig;
use sluice::{LoadOptions, RuleSet};
use std::sync::Arc;
use std::time::Duration;

const RULES: &str = "\
domain: cal
descriptors:
  - key: budget
    rate_limit:
      unit: month
      requests_per_unit: 3
      calendar: {time_zone: America/New_York}
  - key: daily
    rate_limit:
      unit: day
      requests_per_unit: 100
      calendar: {time_zone: America/New_York}
  - key: billing
    rate_limit:
      unit: month
      requests_per_unit: 100
      calendar: {anchor_day: 31}
  - key: weekly
    rate_limit:
      unit: week
      requests_per_unit: 100
      calendar: {week_start: monday, time_zone: UTC}
  - key: envoyproxy_month
    rate_limit: {unit: month, requests_per_unit: 100}
";

/// Unix seconds of an RFC 3339 time.
fn at(s: &str) -> Duration {
    let ts: jiff::Timestamp = s.parse().expect("RFC 3339");
    Duration::from_secs(u64::try_from(ts.as_second()).expect("after 1970"))
}

async fn server(kind: &str, rules: RuleSet) -> (TestServer, ManualClock, Backend) {
    let (store, clock, backend) = make_store(kind).await;
    let base = Ingredients::for_tests(rules, Arc::new(clock.clone()));
    let config = ServerConfig::from_ingredients(Ingredients {
        store: crate::support::stack(store, "test"),
        ..base
    });
    (
        TestServer::start_config(config, clock.clone()).await,
        clock,
        backend,
    )
}

/// The status of one request on `key=value` at `now`.
async fn ask(
    s: &TestServer,
    clock: &ManualClock,
    now: &str,
    key: &str,
    value: &str,
) -> (Code, i64) {
    clock.set(at(now));
    let r = s.call(one("cal", &[(key, value)])).await;
    (code(&r), reset_secs(&r.statuses[0]).expect("a reset"))
}

async fn calendars(kind: &str) {
    let (s, clock, backend) = server(kind, rules_of(&[("cal.yaml", RULES)])).await;
    // Nov 30 23:59:30 EST is 2026-12-01T04:59:30Z: 30 s to the month's end.
    let nov30 = "2026-12-01T04:59:30Z";
    for _ in 0..3 {
        assert_eq!(
            ask(&s, &clock, nov30, "budget", "acme").await,
            (Code::Ok, 30)
        );
    }
    assert_eq!(
        ask(&s, &clock, nov30, "budget", "acme").await,
        (Code::OverLimit, 30)
    );
    if let Backend::Redis(redis) = &backend {
        let ttl: i64 = redis
            .cli(&["PTTL", &month_key(redis, "acme")])
            .trim()
            .parse()
            .expect("PTTL");
        // Less the hour of slack the script adds to every TTL under a test's manual clock
        // (head.lua: a key must not expire in real time while the test's clock stands still).
        // The window ends in 30 s; its key is kept a minute past that (a pinned window's
        // grace on the store's clock, docs/semantics.md "Clocks"), never charged after it.
        let ttl = ttl - 3_600_000;
        assert!(
            (89_000..=90_000).contains(&ttl),
            "the key ends at the boundary plus a minute of grace: {ttl} ms"
        );
    }
    // Local midnight on Dec 1: a fresh month, to Jan 1 00:00 EST.
    let dec1 = "2026-12-01T05:00:00Z";
    let jan = (at("2027-01-01T05:00:00Z") - at(dec1)).as_secs() as i64;
    assert_eq!(
        ask(&s, &clock, dec1, "budget", "acme").await,
        (Code::Ok, jan)
    );
    // The day DST ends in New York has 25 hours.
    let fall_back = "2026-11-01T04:00:00Z"; // Nov 1 00:00 EDT
    assert_eq!(
        ask(&s, &clock, fall_back, "daily", "a").await,
        (Code::Ok, 25 * 3600)
    );
    let spring = "2026-03-08T05:00:00Z"; // Mar 8 00:00 EST
    assert_eq!(
        ask(&s, &clock, spring, "daily", "b").await,
        (Code::Ok, 23 * 3600)
    );
    // A billing month anchored on the 31st runs to Feb 28, and to Feb 29 in 2028.
    let to = |from: &str, end: &str| (at(end) - at(from)).as_secs() as i64;
    let feb = "2027-02-10T00:00:00Z";
    assert_eq!(
        ask(&s, &clock, feb, "billing", "c").await,
        (Code::Ok, to(feb, "2027-02-28T00:00:00Z"))
    );
    let feb28 = "2027-02-28T12:00:00Z";
    assert_eq!(
        ask(&s, &clock, feb28, "billing", "c").await,
        (Code::Ok, to(feb28, "2027-03-31T00:00:00Z")),
        "Feb 28 starts the next billing month"
    );
    let leap = "2028-02-10T00:00:00Z";
    assert_eq!(
        ask(&s, &clock, leap, "billing", "d").await,
        (Code::Ok, to(leap, "2028-02-29T00:00:00Z"))
    );
    // 2026-11-26 is a Thursday: the week ends on Monday Nov 30.
    let thu = "2026-11-26T10:00:00Z";
    assert_eq!(
        ask(&s, &clock, thu, "weekly", "e").await,
        (Code::Ok, to(thu, "2026-11-30T00:00:00Z"))
    );
    // Without a calendar, `unit: month` is envoyproxy's 30 days from the epoch: asked on
    // 2026-11-26 it resets on 2026-12-03.
    let (_, reset) = ask(&s, &clock, thu, "envoyproxy_month", "f").await;
    assert_eq!(reset, to(thu, "2026-12-03T00:00:00Z"));
    s.stop().await;
}

/// The Redis key of `budget=value`'s window (the only key of it).
fn month_key(redis: &crate::support::redis::RedisServer, value: &str) -> String {
    let keys = redis.cli(&["KEYS", &format!("*budget={value}*")]);
    let mut found: Vec<&str> = keys
        .lines()
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .collect();
    found.sort_unstable();
    assert_eq!(found.len(), 1, "{keys}");
    assert!(found[0].contains("month@america/new_york"), "{}", found[0]);
    found[0].to_string()
}

test_with_all_stores!(calendar_windows_on, kind => calendars);

/// envoyproxy's `USE_CALENDAR_MONTH_RATE_LIMIT=true`: `unit: month` is a UTC calendar month.
async fn utc_months(kind: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("m.yaml"),
        "domain: cal\ndescriptors:\n  - key: m\n    rate_limit: {unit: month, requests_per_unit: 2}\n",
    )
    .expect("write");
    let opts = LoadOptions {
        calendar_months: true,
        global_store: false,
        ..LoadOptions::default()
    };
    let rules = sluice::load_path(dir.path(), &opts).expect("loads");
    let (s, clock, _backend) = server(kind, rules).await;
    let thu = "2026-11-26T10:00:00Z";
    let (c, reset) = ask(&s, &clock, thu, "m", "x").await;
    assert_eq!(c, Code::Ok);
    assert_eq!(
        reset,
        (at("2026-12-01T00:00:00Z") - at(thu)).as_secs() as i64
    );
    s.stop().await;
}

test_with_all_stores!(use_calendar_month_rate_limit_gives_utc_months_on, kind => utc_months);

#[test]
fn calendar_blocks_that_cannot_hold_are_load_errors_naming_the_line() {
    let bad = |limit: &str| {
        let yaml = format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {limit}\n");
        sluice::config::load_sources(&[("c.yaml".into(), yaml)])
            .expect_err("refused")
            .to_string()
    };
    for (limit, says) in [
        (
            "{unit: minute, requests_per_unit: 1, calendar: {}}",
            "give one of those units",
        ),
        (
            "{period: 30d, requests_per_unit: 1, calendar: {}}",
            "not a `period`",
        ),
        (
            "{unit: month, requests_per_unit: 1, algorithm: sliding_window, calendar: {}}",
            "no calendar meaning",
        ),
        (
            "{unit: month, requests_per_unit: 1, calendar: {time_zone: Mars/Olympus}}",
            "not an IANA time zone",
        ),
        (
            "{unit: day, requests_per_unit: 1, calendar: {anchor_day: 15}}",
            "applies to `unit: month`",
        ),
        (
            "{unit: month, requests_per_unit: 1, calendar: {anchor_day: 32}}",
            "from 1 to 31",
        ),
        (
            "{unit: week, requests_per_unit: 1, calendar: {week_start: funday}}",
            "day of the week",
        ),
        ("{unlimited: true, calendar: {}}", "calendar when unlimited"),
    ] {
        let e = bad(limit);
        assert!(e.contains("c.yaml:4"), "{limit}: {e}");
        assert!(e.contains(says), "{limit}: {e}");
    }
}

const BUDGETS: &str = r#"
domain: ai
descriptors:
  - key: user
    rate_limit:
      unit: month
      requests_per_unit: 1000
      calendar: {time_zone: America/New_York}
    reservations: {lease: 5m, id_key: request_id, done_key: request_done}
"#;

/// A token budget per calendar month: a reservation's window is the calendar month (its reset
/// the month's end), a settle gives back within it, and one settled after the boundary gives
/// nothing back into the new month, which starts full.
async fn monthly_token_budgets(kind: &str) {
    use super::reservations::{reserve, settle, two_replicas};
    let (a, b, clock, _backend) = two_replicas(kind, BUDGETS).await;
    clock.set(at("2026-12-01T04:59:00Z")); // Nov 30 23:59 EST
    let r = a.call(reserve("acme", "r1", 300)).await;
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 700);
    assert_eq!(reset_secs(&r.statuses[0]), Some(60), "the month's end");
    let r = b.call(settle("acme", "r1", 100)).await;
    assert_eq!(
        r.statuses[0].limit_remaining, 900,
        "200 given back within the month"
    );
    let r = a.call(reserve("acme", "r2", 500)).await;
    assert_eq!(r.statuses[0].limit_remaining, 400);
    // Local midnight: a new month, full; r2's settle gives nothing back into it.
    clock.set(at("2026-12-01T05:00:10Z"));
    let r = b.call(settle("acme", "r2", 10)).await;
    assert_eq!(code(&r), Code::Ok);
    let r = a.call(reserve("acme", "r3", 1)).await;
    assert_eq!(
        r.statuses[0].limit_remaining, 999,
        "the new month starts full"
    );
    let jan = (at("2027-01-01T05:00:00Z") - at("2026-12-01T05:00:10Z")).as_secs() as i64;
    assert_eq!(reset_secs(&r.statuses[0]), Some(jan));
    a.stop().await;
    b.stop().await;
}

test_with_all_stores!(monthly_token_budgets_on, kind => monthly_token_budgets);

/// An RLQS assignment on a calendar month lasts to the boundary: a spent budget is DENY_ALL for
/// the 30 s to local midnight on Dec 1, and the new month starts afresh.
#[tokio::test]
async fn an_rlqs_assignment_on_a_calendar_month_ends_at_the_boundary() {
    use super::quota::{strategy_of, ttl_of, usage, Stream};
    let rules = "\
domain: rlqs
descriptors:
  - key: x-api-key
    rate_limit:
      unit: month
      requests_per_unit: 600
      calendar: {time_zone: America/New_York}
";
    let server = TestServer::start(rules).await;
    server.clock.set(at("2026-12-01T04:59:30Z")); // Nov 30 23:59:30 EST
    let mut a = Stream::open(&server).await;
    let actions = a
        .report("rlqs", vec![usage(&[("x-api-key", "k")], 600, 0)])
        .await;
    assert_eq!(strategy_of(&actions[0]), Err("deny_all"));
    assert_eq!(ttl_of(&actions[0]), 30, "until local midnight on Dec 1");
    server.clock.set(at("2026-12-01T05:00:00Z"));
    let actions = a
        .report("rlqs", vec![usage(&[("x-api-key", "k")], 0, 5)])
        .await;
    assert!(
        strategy_of(&actions[0]).is_ok(),
        "a fresh month: {actions:?}"
    );
    server.stop().await;
}
