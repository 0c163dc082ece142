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
//! interned [`CalendarId`]; the calendars themselves live in one process-wide table. An id is
//! never reused (a request planned on a config being replaced may still hold one), so entries
//! are never dropped; instead the table holds one entry per calendar that exists, whatever the
//! spelling: the zone under its IANA name as the database spells it (`america/new_york` is
//! `America/New_York`), the week start only for weeks, the anchor only for months. That is at
//! most every zone x (day, 7 week starts, 31 anchors, year), about 24 000, so however many
//! reloads a process lives through, a valid calendar always finds its entry or room for one
//! ([`MAX_CALENDARS`] is above that bound).

use super::Unit;
use jiff::civil::{Date, Weekday};
use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, LazyLock, Mutex, RwLock};

/// Distinct calendars the process keeps at most: above every calendar there is (about 600 zone
/// names x 40 unit, week start and anchor combinations), so never reached by valid specs.
pub const MAX_CALENDARS: usize = 65_536;

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

/// Where each calendar is in [`TABLE`].
static INDEX: LazyLock<Mutex<HashMap<CalendarSpec, u32>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// The id of `spec`'s calendar (see the module's notes on spellings), resolving its zone: an
/// unknown zone, or a full table (never, for valid specs), is an error saying so.
pub fn intern(spec: &CalendarSpec) -> Result<CalendarId, String> {
    let zone = TimeZone::get(&spec.zone).ok();
    let Some((zone, name)) = zone.and_then(|z| z.iana_name().map(str::to_string).map(|n| (z, n)))
    else {
        return Err(format!(
            "time_zone {:?} is not an IANA time zone (such as UTC, Europe/Paris, \
             America/New_York)",
            spec.zone
        ));
    };
    let spec = CalendarSpec {
        unit: spec.unit,
        zone: name,
        week_start: match spec.unit {
            Unit::Week => spec.week_start,
            _ => Weekday::Monday,
        },
        anchor_day: match spec.unit {
            Unit::Month => spec.anchor_day,
            _ => 1,
        },
    };
    // The index's lock first, then the table's: the only order either is taken in together.
    let mut index = INDEX.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&i) = index.get(&spec) {
        return Ok(CalendarId(i));
    }
    let mut table = TABLE.write().unwrap_or_else(|e| e.into_inner());
    let id = match u32::try_from(table.len()) {
        Ok(id) if table.len() < MAX_CALENDARS => id,
        _ => {
            return Err(format!(
                "more than {MAX_CALENDARS} distinct calendars (unit, time_zone, week_start, \
                 anchor_day) in use"
            ))
        }
    };
    table.push(Arc::new(Calendar {
        spec: spec.clone(),
        zone,
        last: Mutex::new((0, 0)),
    }));
    index.insert(spec, id);
    Ok(CalendarId(id))
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
    fn every_spelling_of_a_calendar_shares_one_entry_so_reloads_never_fill_the_table() {
        let month = |zone: &str, week_start, anchor_day| CalendarSpec {
            unit: Unit::Month,
            zone: zone.into(),
            week_start,
            anchor_day,
        };
        let canonical = intern(&month("America/New_York", MON, 1)).unwrap();
        // 4 096 spellings of one zone (every letter's case), with week starts a month ignores:
        // a process reloading configs written each way keeps one calendar, not 4 096.
        let letters = "americanewyork";
        for mask in 0u32..4096 {
            let mut i = 0;
            let zone: String = "America/New_York"
                .chars()
                .map(|c| {
                    if !c.is_ascii_alphabetic() || i >= letters.len() {
                        return c;
                    }
                    i += 1;
                    if mask & (1 << (i - 1)) != 0 {
                        c.to_ascii_uppercase()
                    } else {
                        c.to_ascii_lowercase()
                    }
                })
                .collect();
            let ws = [MON, Weekday::Sunday][(mask % 2) as usize];
            assert_eq!(intern(&month(&zone, ws, 1)), Ok(canonical), "{zone}");
        }
        assert_eq!(
            canonical.calendar().spec.to_string(),
            "month@America/New_York"
        );
        // A day ignores both the week start and the anchor.
        let day = |week_start, anchor_day| CalendarSpec {
            unit: Unit::Day,
            zone: "utc".into(),
            week_start,
            anchor_day,
        };
        assert_eq!(intern(&day(Weekday::Friday, 15)), intern(&day(MON, 1)));
        assert_eq!(intern(&day(MON, 1)).unwrap().calendar().spec.zone, "UTC");
        // Every calendar there is fits: no valid spec is ever refused for want of room.
        let db = jiff::tz::db();
        let mut specs = 0;
        for zone in db.available() {
            let mut all = vec![(Unit::Day, MON, 1), (Unit::Year, MON, 1)];
            all.extend(
                [MON, Weekday::Tuesday, Weekday::Wednesday, Weekday::Thursday]
                    .into_iter()
                    .chain([Weekday::Friday, Weekday::Saturday, Weekday::Sunday])
                    .map(|w| (Unit::Week, w, 1)),
            );
            all.extend((1..=31).map(|a| (Unit::Month, MON, a)));
            for (unit, week_start, anchor_day) in all {
                let spec = CalendarSpec {
                    unit,
                    zone: zone.to_string(),
                    week_start,
                    anchor_day,
                };
                intern(&spec).unwrap_or_else(|e| panic!("{spec}: {e}"));
                specs += 1;
            }
        }
        assert!(specs < MAX_CALENDARS, "{specs} calendars exist");
        assert!(TABLE.read().unwrap().len() <= specs + 64);
    }

    #[test]
    fn unknown_zones_are_refused_and_specs_are_interned_once() {
        let bad = CalendarSpec {
            zone: "Mars/Olympus".into(),
            ..CalendarSpec::utc_months()
        };
        assert!(intern(&bad).unwrap_err().contains("Mars/Olympus"));
        let unknown = CalendarSpec {
            zone: "Etc/Unknown".into(),
            ..CalendarSpec::utc_months()
        };
        assert!(
            intern(&unknown).is_err(),
            "not a zone: a name without rules"
        );
        assert_eq!(
            intern(&CalendarSpec::utc_months()),
            intern(&CalendarSpec::utc_months())
        );
        assert_eq!(CalendarSpec::utc_months().to_string(), "month@UTC");
    }
}
