//! A limit's `calendar` block (sluice extension): `unit: day | week | month | year` aligned to
//! the calendar in an IANA zone (`config/calendar.rs` computes the windows), and envoyproxy's
//! `USE_CALENDAR_MONTH_RATE_LIMIT` for UTC months. Calendar windows are fixed windows: another
//! algorithm, a `period`, or a unit shorter than a day is an error naming the line.

use super::super::calendar::{parse_weekday, CalendarSpec};
use super::super::yaml::{Node, Resolved, Value};
use super::super::{Algorithm, Period, Unit};
use super::ctx::{join, kind, Ctx};
use super::schema::Scope;
use jiff::civil::Weekday;

/// A `calendar` block as written, each key with its line.
#[derive(Debug, Clone)]
pub(super) struct CalendarBlock {
    zone: Option<(String, usize)>,
    week_start: Option<(Weekday, usize)>,
    anchor_day: Option<(u8, usize)>,
}

impl Ctx {
    /// Reads a `calendar` block; `None` (reported) when it is malformed.
    pub(super) fn calendar_block(&mut self, node: &Node, path: &str) -> Option<CalendarBlock> {
        let Value::Map(entries) = &node.value else {
            self.err(
                node.line,
                path,
                format!(
                    "`calendar` must be a mapping like {{time_zone: America/New_York}}, not a {}",
                    kind(node)
                ),
            );
            return None;
        };
        let errors_before = self.errors.len();
        let mut block = CalendarBlock {
            zone: None,
            week_start: None,
            anchor_day: None,
        };
        for (key, _, v) in self.entries(entries, path, Scope::Calendar) {
            let p = join(path, key);
            match key {
                "time_zone" => block.zone = self.string(v, &p, key).map(|z| (z, v.line)),
                "week_start" => match self.string(v, &p, key).as_deref().map(parse_weekday) {
                    Some(Some(d)) => block.week_start = Some((d, v.line)),
                    Some(None) => self.err(
                        v.line,
                        &p,
                        "`week_start` must be a day of the week (monday ... sunday)",
                    ),
                    None => {}
                },
                "anchor_day" => block.anchor_day = self.anchor_day(v, &p).map(|d| (d, v.line)),
                _ => {}
            }
        }
        (self.errors.len() == errors_before).then_some(block)
    }

    fn anchor_day(&mut self, node: &Node, path: &str) -> Option<u8> {
        if let Value::Scalar(s) = &node.value {
            if let Resolved::Int(n) = s.resolve() {
                if let Ok(n @ 1..=31) = u8::try_from(n) {
                    return Some(n);
                }
            }
        }
        self.err(
            node.line,
            path,
            "`anchor_day` must be a day of the month from 1 to 31 (a month shorter than it \
             starts on its last day)",
        );
        None
    }

    /// The period a limit counts in: its calendar's when it has a `calendar` block (or a UTC
    /// month under `USE_CALENDAR_MONTH_RATE_LIMIT`), else `period` as it is.
    pub(super) fn calendar_period(
        &mut self,
        calendar: Option<&(usize, Option<CalendarBlock>)>,
        (period, from_period): (Period, bool),
        algorithm: Option<Algorithm>,
        path: &str,
    ) -> Period {
        let fixed = algorithm.unwrap_or_default() == Algorithm::FixedWindow;
        let Some((line, block)) = calendar else {
            if self.calendar_months && fixed && period == Period::from_unit(Unit::Month) {
                return Period::from_calendar(&CalendarSpec::utc_months()).unwrap_or(period);
            }
            return period;
        };
        let Some(block) = block else {
            return period;
        };
        let path = join(path, "calendar");
        let unit = match period.unit() {
            Some(u @ (Unit::Day | Unit::Week | Unit::Month | Unit::Year)) if !from_period => u,
            _ => {
                self.err(
                    *line,
                    &path,
                    "`calendar` aligns `unit: day`, `week`, `month` or `year` to the calendar; \
                     give one of those units (not a `period`, not a shorter unit)",
                );
                return period;
            }
        };
        if !fixed {
            self.err(
                *line,
                &path,
                format!(
                    "`calendar` windows are fixed windows; `algorithm: {}` has no calendar \
                     meaning (remove `algorithm`, or `calendar`)",
                    algorithm.unwrap_or_default().name()
                ),
            );
            return period;
        }
        self.calendar_spec(*line, &path, unit, block)
            .and_then(|spec| match Period::from_calendar(&spec) {
                Ok(p) => Some(p),
                Err(e) => {
                    let at = block.zone.as_ref().map_or(*line, |z| z.1);
                    self.err(at, &join(&path, "time_zone"), e);
                    None
                }
            })
            .unwrap_or(period)
    }

    fn calendar_spec(
        &mut self,
        line: usize,
        path: &str,
        unit: Unit,
        block: &CalendarBlock,
    ) -> Option<CalendarSpec> {
        let mut ok = true;
        if let (Some((_, at)), false) = (block.week_start, unit == Unit::Week) {
            self.err(
                at,
                &join(path, "week_start"),
                "`week_start` applies to `unit: week`",
            );
            ok = false;
        }
        if let (Some((_, at)), false) = (block.anchor_day, unit == Unit::Month) {
            self.err(
                at,
                &join(path, "anchor_day"),
                "`anchor_day` applies to `unit: month`",
            );
            ok = false;
        }
        let _ = line;
        ok.then(|| CalendarSpec {
            unit,
            zone: block
                .zone
                .as_ref()
                .map_or_else(|| "UTC".to_string(), |z| z.0.clone()),
            week_start: block.week_start.map_or(Weekday::Monday, |w| w.0),
            anchor_day: block.anchor_day.map_or(1, |a| a.0),
        })
    }
}
