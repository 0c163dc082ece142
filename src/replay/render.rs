//! A replay's report for people: a table on the terminal, and a picture (SVG) of admitted and
//! denied requests over time per config and of the consumers each would stop, because
//! operators look before they read. Hand-written SVG: a few rectangles and labels need no
//! plotting library.

use super::report::{ConfigReport, Report};
use std::fmt::Write;

/// The terminal table: requests per config beside the log, then each config's limits and the
/// consumers they would stop.
pub fn table(r: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "replayed {} requests, {} .. {}\n",
        r.lines,
        utc(r.first_us),
        utc(r.last_us)
    );
    let width = r
        .configs
        .iter()
        .map(|c| c.config.len())
        .max()
        .unwrap_or(0)
        .max(12);
    let _ = writeln!(
        out,
        "{:<w$}  {:>10}  {:>10}  {:>12}  {:>14}",
        "",
        "admitted",
        "denied",
        "newly denied",
        "newly admitted",
        w = width
    );
    if let Some(c) = r.configs.first() {
        let _ = writeln!(
            out,
            "{:<w$}  {:>10}  {:>10}",
            "logged",
            c.logged.admitted,
            c.logged.denied,
            w = width
        );
    }
    for c in &r.configs {
        let _ = writeln!(
            out,
            "{:<w$}  {:>10}  {:>10}  {:>12}  {:>14}",
            c.config,
            c.requests.admitted,
            c.requests.denied,
            c.newly_denied,
            c.newly_admitted,
            w = width
        );
    }
    for c in &r.configs {
        limits(&mut out, c);
    }
    out
}

fn limits(out: &mut String, c: &ConfigReport) {
    let _ = writeln!(out, "\n{}:", c.config);
    if c.invalid + c.fallback > 0 {
        let _ = writeln!(
            out,
            "  {} invalid line(s) skipped; {} answered by FAILURE_MODE then (not compared)",
            c.invalid, c.fallback
        );
    }
    for l in &c.limits {
        let _ = writeln!(
            out,
            "  {}: {} admitted, {} denied (logged {} denied; {} newly denied)",
            l.limit, l.descriptors.admitted, l.descriptors.denied, l.logged_denied, l.newly_denied
        );
        for t in &l.top {
            let _ = writeln!(
                out,
                "      {:<40} {:>8} denied of {:>8} (logged {})",
                t.consumer, t.denied, t.requests, t.logged_denied
            );
        }
    }
}

/// The picture: per config, requests admitted (blue) and denied (red) per time bucket, the
/// logged denials as a line, and the consumers its most denying limit would stop.
pub fn svg(r: &Report) -> String {
    const W: f64 = 960.0;
    const CHART: f64 = 200.0;
    const ROW: f64 = 18.0;
    let tops: Vec<usize> = r
        .configs
        .iter()
        .map(|c| c.limits.first().map_or(0, |l| l.top.len()))
        .collect();
    let height: f64 = r
        .configs
        .iter()
        .zip(&tops)
        .map(|(_, t)| 60.0 + CHART + 40.0 + ROW * (*t as f64 + 1.0))
        .sum::<f64>()
        + 20.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let mut y = 10.0;
    for (c, top) in r.configs.iter().zip(tops) {
        y = config_chart(&mut s, c, y, (W, CHART, ROW), top);
    }
    s.push_str("</svg>\n");
    s
}

fn config_chart(
    s: &mut String,
    c: &ConfigReport,
    y0: f64,
    (w, chart, row): (f64, f64, f64),
    top: usize,
) -> f64 {
    let (left, right) = (60.0, w - 20.0);
    let _ = writeln!(
        s,
        r#"<text x="{left}" y="{}" font-size="14" font-weight="bold">{}: {} admitted, {} denied ({} newly denied)</text>"#,
        y0 + 16.0,
        esc(&c.config),
        c.requests.admitted,
        c.requests.denied,
        c.newly_denied
    );
    let base = y0 + 40.0 + chart;
    let peak = c
        .timeline
        .iter()
        .map(|b| (b.0 + b.1).max(b.2))
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    let n = c.timeline.len().max(1) as f64;
    let bw = (right - left) / n;
    let mut logged = Vec::new();
    for (i, (ok, denied, was)) in c.timeline.iter().enumerate() {
        let x = left + bw * i as f64;
        let hd = chart * *denied as f64 / peak;
        let ho = chart * *ok as f64 / peak;
        let _ = writeln!(
            s,
            r##"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{ho:.1}" fill="#4a78b5"/><rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{hd:.1}" fill="#d33c3c"/>"##,
            base - ho - hd,
            bw.max(1.0) - 0.5,
            base - hd,
            bw.max(1.0) - 0.5,
        );
        logged.push(format!(
            "{:.1},{:.1}",
            x + bw / 2.0,
            base - chart * *was as f64 / peak
        ));
    }
    let _ = writeln!(
        s,
        r##"<polyline points="{}" fill="none" stroke="#222" stroke-dasharray="4 2"/>"##,
        logged.join(" ")
    );
    let end_us = c
        .bucket_us
        .saturating_mul(c.timeline.len() as u64)
        .saturating_add(c.start_us);
    let _ = writeln!(
        s,
        r##"<line x1="{left}" y1="{base}" x2="{right}" y2="{base}" stroke="#222"/><text x="{left}" y="{:.1}">{}</text><text x="{right}" y="{:.1}" text-anchor="end">{}</text><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
        base + 14.0,
        utc(c.start_us),
        base + 14.0,
        utc(end_us),
        left - 4.0,
        base - chart + 10.0,
        peak as u64
    );
    let _ = writeln!(
        s,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="end"><tspan fill="#4a78b5">admitted</tspan> <tspan fill="#d33c3c">denied</tspan> (replayed), dashed: denied as logged</text>"##,
        right,
        y0 + 16.0
    );
    let y = match c.limits.first().filter(|_| top > 0) {
        Some(l) => stopped(s, l, base + 34.0, (left, right, row)),
        None => base + 34.0,
    };
    y + row
}

/// The consumers `l` would stop most, as bars; the `y` below them.
fn stopped(
    s: &mut String,
    l: &super::report::LimitReport,
    mut y: f64,
    (left, right, row): (f64, f64, f64),
) -> f64 {
    let _ = writeln!(
        s,
        r#"<text x="{left}" y="{y}" font-weight="bold">who {} would stop</text>"#,
        esc(&l.limit)
    );
    let most = l.top.first().map_or(1, |t| t.denied.max(1)) as f64;
    for t in &l.top {
        y += row;
        // The label's column is 300 px (40 characters at 12 px), the count's 100 px.
        let bar = (right - left - 420.0) * t.denied as f64 / most;
        let _ = writeln!(
            s,
            r##"<text x="{left}" y="{y}">{}</text><rect x="{:.1}" y="{:.1}" width="{bar:.1}" height="{:.1}" fill="#d33c3c"/><text x="{:.1}" y="{y}">{} of {}</text>"##,
            esc(&shorten(&t.consumer, 40)),
            left + 300.0,
            y - 11.0,
            row - 5.0,
            left + 306.0 + bar,
            t.denied,
            t.requests
        );
    }
    y
}

fn shorten(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let mut out: String = s.chars().take(max - 1).collect();
    out.push('…');
    out
}

/// Text safe inside SVG (consumer values are whatever callers sent): markup escaped, and the
/// control characters XML does not allow replaced.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            c if c.is_control() || matches!(c, '\u{fffe}' | '\u{ffff}') => {
                out.push('\u{fffd}');
            }
            c => out.push(c),
        }
    }
    out
}

/// `2026-12-07 01:02:03 UTC` from Unix µs.
fn utc(us: u64) -> String {
    let secs = i64::try_from(us / 1_000_000).unwrap_or(i64::MAX);
    match jiff::Timestamp::from_second(secs) {
        Ok(t) => t.strftime("%Y-%m-%d %H:%M:%S UTC").to_string(),
        Err(_) => format!("{us} µs"),
    }
}
