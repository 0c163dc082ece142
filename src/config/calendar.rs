//! Calendar windows: a limit's `day`, `week`, `month` or `year` aligned to the calendar in an
//! IANA time zone (a `calendar:` block, or envoyproxy's `USE_CALENDAR_MONTH_RATE_LIMIT` for UTC
//! months), instead of envoyproxy's fixed lengths from the Unix epoch (a `month` there is 30
//! days: asked on 2026-11-26, it resets on 2026-12-03).
//!
//! Why windows are computed here and handed to the stores as `[start, end)`: the zone rules
//! (DST's 23- and 25-hour days, leap years, a billing month anchored on the 31st that ends on
//! the last day of February) come from the maintained database `jiff` bundles, and neither a
//! Lua script nor a fixed period can express them. The service computes the window containing
//! its clock's now for each calendar limit of a request ([`Calendar::window_at`]); the memory
//! store and `decide.lua` count in exactly that window, and its end is the reset every answer,
//! header and key TTL reports.
//!
//! A limit keeps `Copy` identity: its [`Period`](super::Period) names the calendar by a small
//! interned [`CalendarId`]; the calendars themselves live in one process-wide table, at most
//! [`MAX_CALENDARS`] distinct ones (a config or an xDS push needing more fails to load).

use super::Unit;
use jiff::civil::{Date, Weekday};
use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan};
use std::fmt;
use std::sync::{Arc, LazyLock, Mutex, RwLock};

/// Distinct calendars (unit, zone, week start, anchor) the process keeps at most.
pub const MAX_CALENDARS: usize = 1024;

/// What a `calendar:` block says.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CalendarSpec {
    pub unit: Unit,
    /// The IANA zone's name as written (`UTC` by default).
    pub zone: String,
    /// `week`: the first day of a week.
    pub week_start: Weekday,
    /// `month`: the day a billing month starts on (1-31; past a month's last day, that last
    /// day).
    pub anchor_day: u8,
}

impl CalendarSpec {
    /// UTC calendar months starting on the 1st (`USE_CALENDAR_MONTH_RATE_LIMIT`).
    pub fn utc_months() -> Self {
        Self {
            unit: Unit::Month,
            zone: "UTC".into(),
            week_start: Weekday::Monday,
            anchor_day: 1,
        }
    }
}

impl fmt::Display for CalendarSpec {
    /// `month@America/New_York`, with `+15` for an anchor other than the 1st and `+sunday`
    /// for a week not starting on Monday: part of the counter's identity (its Redis key).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.unit.name(), self.zone)?;
        match self.unit {
            Unit::Month if self.anchor_day != 1 => write!(f, "+{}", self.anchor_day),
            Unit::Week if self.week_start != Weekday::Monday => {
                write!(f, "+{}", weekday_name(self.week_start))
            }
            _ => Ok(()),
        }
    }
}

pub fn weekday_name(d: Weekday) -> &'static str {
    match d {
        Weekday::Monday => "monday",
        Weekday::Tuesday => "tuesday",
        Weekday::Wednesday => "wednesday",
        Weekday::Thursday => "thursday",
        Weekday::Friday => "friday",
        Weekday::Saturday => "saturday",
        Weekday::Sunday => "sunday",
    }
}

pub fn parse_weekday(s: &str) -> Option<Weekday> {
    [
        Weekday::Monday,
        Weekday::Tuesday,
        Weekday::Wednesday,
        Weekday::Thursday,
        Weekday::Friday,
        Weekday::Saturday,
        Weekday::Sunday,
    ]
    .into_iter()
    .find(|d| weekday_name(*d).eq_ignore_ascii_case(s.trim()))
}

/// A calendar as the process keeps it (see [`intern`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CalendarId(u32);

impl CalendarId {
    pub fn calendar(self) -> Arc<Calendar> {
        let table = TABLE.read().unwrap_or_else(|e| e.into_inner());
        Arc::clone(&table[self.0 as usize])
    }
}

/// A calendar: its spec, the zone resolved, and the last window computed (most requests fall
/// in it, so they cost a lock and two comparisons).
#[derive(Debug)]
pub struct Calendar {
    pub spec: CalendarSpec,
    zone: TimeZone,
    last: Mutex<(u64, u64)>,
}

static TABLE: LazyLock<RwLock<Vec<Arc<Calendar>>>> = LazyLock::new(|| RwLock::new(Vec::new()));

/// The id of `spec`, resolving its zone the first time: an unknown zone, or a table already
/// holding [`MAX_CALENDARS`], is an error saying so.
pub fn intern(spec: &CalendarSpec) -> Result<CalendarId, String> {
    let mut table = TABLE.write().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = table.iter().position(|c| c.spec == *spec) {
        return Ok(CalendarId(i as u32));
    }
    if table.len() >= MAX_CALENDARS {
        return Err(format!(
            "more than {MAX_CALENDARS} distinct calendars (unit, time_zone, week_start, \
             anchor_day) in use"
        ));
    }
    let zone = TimeZone::get(&spec.zone).map_err(|_| {
        format!(
            "time_zone {:?} is not an IANA time zone (such as UTC, Europe/Paris, \
             America/New_York)",
            spec.zone
        )
    })?;
    table.push(Arc::new(Calendar {
        spec: spec.clone(),
        zone,
        last: Mutex::new((0, 0)),
    }));
    Ok(CalendarId(table.len() as u32 - 1))
}

impl Calendar {
    /// The window `[start, end)` (Unix microseconds) containing `now_us`, `None` only for a time
    /// outside the years -9999..9999.
    pub fn window_at(&self, now_us: u64) -> Option<(u64, u64)> {
        {
            let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
            if last.0 <= now_us && now_us < last.1 {
                return Some(*last);
            }
        }
        let window = self.compute(now_us)?;
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = window;
        Some(window)
    }

    fn compute(&self, now_us: u64) -> Option<(u64, u64)> {
        let ts = Timestamp::from_microsecond(i64::try_from(now_us).ok()?).ok()?;
        let today = ts.to_zoned(self.zone.clone()).date();
        let (start, end) = match self.spec.unit {
            Unit::Week => {
                let back = (today.weekday().to_monday_zero_offset()
                    - self.spec.week_start.to_monday_zero_offset())
                .rem_euclid(7);
                let start = today.checked_sub(i64::from(back).days()).ok()?;
                (start, start.checked_add(7.days()).ok()?)
            }
            Unit::Month => {
                let anchor = |y: i16, m: i8| anchored(y, m, self.spec.anchor_day);
                let (y, m) = (today.year(), today.month());
                let this = anchor(y, m)?;
                if today >= this {
                    let (ny, nm) = shift(y, m, 1);
                    (this, anchor(ny, nm)?)
                } else {
                    let (py, pm) = shift(y, m, -1);
                    (anchor(py, pm)?, this)
                }
            }
            Unit::Year => (
                Date::new(today.year(), 1, 1).ok()?,
                Date::new(today.year().checked_add(1)?, 1, 1).ok()?,
            ),
            // Day, and (not accepted by the loader) anything shorter: the local day.
            _ => (today, today.tomorrow().ok()?),
        };
        // A day's first instant in the zone (a midnight skipped by DST: the first that exists).
        let at = |d: Date| -> Option<u64> {
            let z = d.to_zoned(self.zone.clone()).ok()?;
            u64::try_from(z.timestamp().as_microsecond()).ok()
        };
        Some((at(start)?, at(end)?))
    }
}

/// The day `day` of month `m` of year `y`, or the month's last day if it has fewer.
fn anchored(y: i16, m: i8, day: u8) -> Option<Date> {
    let first = Date::new(y, m, 1).ok()?;
    let d = i8::try_from(day).ok()?.min(first.days_in_month());
    Date::new(y, m, d).ok()
}

/// Month `m` of year `y` moved by `by` months (-1 or 1).
fn shift(y: i16, m: i8, by: i8) -> (i16, i8) {
    match m + by {
        0 => (y - 1, 12),
        13 => (y + 1, 1),
        n => (y, n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(s: &str) -> u64 {
        let ts: Timestamp = s.parse().unwrap();
        u64::try_from(ts.as_microsecond()).unwrap()
    }

    fn window(unit: Unit, zone: &str, week_start: Weekday, anchor_day: u8, at: &str) -> (u64, u64) {
        let id = intern(&CalendarSpec {
            unit,
            zone: zone.into(),
            week_start,
            anchor_day,
        })
        .unwrap();
        id.calendar().window_at(us(at)).unwrap()
    }

    const MON: Weekday = Weekday::Monday;

    #[test]
    fn a_new_york_month_ends_at_local_midnight_on_the_first() {
        let (s, e) = window(
            Unit::Month,
            "America/New_York",
            MON,
            1,
            "2026-12-01T04:59:30Z",
        );
        // Nov 30 23:59:30 EST: 30 s to go.
        assert_eq!(e - us("2026-12-01T04:59:30Z"), 30_000_000);
        assert_eq!(s, us("2026-11-01T04:00:00Z"), "Nov 1 00:00 EDT");
        assert_eq!(e, us("2026-12-01T05:00:00Z"), "Dec 1 00:00 EST");
    }

    #[test]
    fn days_across_dst_have_23_and_25_hours() {
        let (s, e) = window(
            Unit::Day,
            "America/New_York",
            MON,
            1,
            "2026-11-01T12:00:00Z",
        );
        assert_eq!(e - s, 25 * 3_600_000_000, "the fall-back day");
        let (s, e) = window(
            Unit::Day,
            "America/New_York",
            MON,
            1,
            "2026-03-08T12:00:00Z",
        );
        assert_eq!(e - s, 23 * 3_600_000_000, "the spring-forward day");
    }

    #[test]
    fn a_billing_month_anchored_on_the_31st_ends_on_the_last_of_february() {
        let w = |at| window(Unit::Month, "UTC", MON, 31, at);
        assert_eq!(
            w("2027-02-10T00:00:00Z"),
            (us("2027-01-31T00:00:00Z"), us("2027-02-28T00:00:00Z"))
        );
        assert_eq!(
            w("2027-03-01T00:00:00Z"),
            (us("2027-02-28T00:00:00Z"), us("2027-03-31T00:00:00Z"))
        );
        assert_eq!(
            w("2028-02-10T00:00:00Z"),
            (us("2028-01-31T00:00:00Z"), us("2028-02-29T00:00:00Z")),
            "a leap year"
        );
        let w = |at| window(Unit::Month, "UTC", MON, 15, at);
        assert_eq!(
            w("2026-12-14T23:00:00Z"),
            (us("2026-11-15T00:00:00Z"), us("2026-12-15T00:00:00Z"))
        );
        assert_eq!(
            w("2026-12-31T00:00:00Z"),
            (us("2026-12-15T00:00:00Z"), us("2027-01-15T00:00:00Z")),
            "across a year"
        );
    }

    #[test]
    fn weeks_start_on_their_day_and_years_on_january_first() {
        // 2026-11-26 is a Thursday.
        let (s, e) = window(Unit::Week, "UTC", MON, 1, "2026-11-26T10:00:00Z");
        assert_eq!(
            (s, e),
            (us("2026-11-23T00:00:00Z"), us("2026-11-30T00:00:00Z"))
        );
        let (s, _) = window(
            Unit::Week,
            "UTC",
            Weekday::Sunday,
            1,
            "2026-11-26T10:00:00Z",
        );
        assert_eq!(s, us("2026-11-22T00:00:00Z"));
        let (s, e) = window(Unit::Year, "Asia/Tokyo", MON, 1, "2026-12-31T16:00:00Z");
        assert_eq!(s, us("2026-12-31T15:00:00Z"), "Jan 1 2027 00:00 JST");
        assert_eq!(e, us("2027-12-31T15:00:00Z"));
    }

    #[test]
    fn unknown_zones_are_refused_and_specs_are_interned_once() {
        let bad = CalendarSpec {
            zone: "Mars/Olympus".into(),
            ..CalendarSpec::utc_months()
        };
        assert!(intern(&bad).unwrap_err().contains("Mars/Olympus"));
        assert_eq!(
            intern(&CalendarSpec::utc_months()),
            intern(&CalendarSpec::utc_months())
        );
        assert_eq!(CalendarSpec::utc_months().to_string(), "month@UTC");
    }
}
