//! envoyproxy/ratelimit's stats, for deployments whose dashboards read them: statsd lines
//! (`USE_STATSD`, to a `statsd_exporter` sidecar) and the Prometheus series its built-in
//! exporter serves (`USE_PROMETHEUS`, on `PROMETHEUS_ADDR`).
//!
//! Nothing here runs per request. Both views are derived from sluice's own counters (the
//! registry behind `/metrics`) when they are read: every `STATS_FLUSH_INTERVAL` for statsd, on
//! each scrape for Prometheus. The names are envoyproxy's:
//!
//! | statsd (gostats) | Prometheus (envoyproxy's default mapping) |
//! | --- | --- |
//! | `ratelimit.service.rate_limit.<domain>.<key>[.<key2>...].{total_hits,over_limit,near_limit,within_limit,shadow_mode}` | `ratelimit_service_rate_limit_<counter>{domain,key1[,key2]}` |
//! | `ratelimit.service.rate_limit.<domain>.<key>....over_limit_with_local_cache` | (not mapped by envoyproxy either) |
//! | `ratelimit.service.call.should_rate_limit.{redis_error,service_error}` | `ratelimit_service_should_rate_limit_error{err_type}` |
//! | `ratelimit.service.config_load_{success,error}` | `ratelimit_service_config_load_{success,error}` |
//! | `ratelimit_server.ShouldRateLimit.total_requests` | `ratelimit_service_total_requests{grpc_method}` |
//! | | `ratelimit_service_response_time_seconds{grpc_method}` (histogram) |
//!
//! `<key>` is the matched rule's key path, with values as envoyproxy shows them (a rule's value,
//! or the request's with `detailed_metric`), after envoyproxy's sanitising (`:` and `|` become
//! `_`, as do the dots of an IPv4 address). statsd counters are sent as the increase since the
//! last flush, and only when non-zero, as gostats does; `EXTRA_TAGS` are appended to each name
//! as gostats serialises tags (`.__key=value`) and become labels on the Prometheus side.

use super::metrics::Metrics;
use prometheus::proto::{MetricFamily, MetricType};
use std::collections::HashMap;
use std::fmt::Write;
use std::time::Duration;

/// The per-descriptor counters, sluice's family then envoyproxy's suffix; the last is not in
/// envoyproxy's Prometheus mapping.
const DESCRIPTOR_COUNTERS: [(&str, &str); 6] = [
    ("sluice_rate_limit_total_hits", "total_hits"),
    ("sluice_rate_limit_over_limit", "over_limit"),
    ("sluice_rate_limit_near_limit", "near_limit"),
    ("sluice_rate_limit_within_limit", "within_limit"),
    ("sluice_rate_limit_shadow_mode", "shadow_mode"),
    (
        "sluice_rate_limit_over_limit_with_local_cache",
        "over_limit_with_local_cache",
    ),
];

/// Prometheus labels of one series.
pub type Labels = Vec<(&'static str, String)>;

/// One envoyproxy counter: its statsd name (tags not yet appended), its value since start, and
/// its Prometheus series when envoyproxy's mapping gives it one.
#[derive(Debug, Clone, PartialEq)]
pub struct Stat {
    pub name: String,
    pub value: u64,
    pub prometheus: Option<(&'static str, Labels)>,
}

/// envoyproxy's `SanitizeStatName`: `:` and `|` would break a statsd line; the dots of an IPv4
/// address would split it into name components. Control characters too (review A9): a stat
/// name can hold a client's value, and a `\n` in it would end the line and forge another
/// stat's.
pub fn sanitize(s: &str) -> String {
    let replaced: String = s
        .chars()
        .map(|c| {
            if c == ':' || c == '|' || c.is_control() {
                '_'
            } else {
                c
            }
        })
        .collect();
    let bytes = replaced.as_bytes();
    let mut out = String::with_capacity(replaced.len());
    let mut i = 0;
    while i < replaced.len() {
        match ipv4_at(bytes, i) {
            Some(end) if i == 0 || !bytes[i - 1].is_ascii_digit() => {
                out.push_str(&replaced[i..end].replace('.', "_"));
                i = end;
            }
            _ => {
                let c = replaced[i..].chars().next().unwrap_or('_');
                out.push(c);
                i += c.len_utf8();
            }
        }
    }
    out
}

/// The end of a dotted quad (1-3 digits, four times) starting at `i`, not followed by a digit.
fn ipv4_at(b: &[u8], mut i: usize) -> Option<usize> {
    for part in 0..4 {
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() && i - start < 3 {
            i += 1;
        }
        if i == start {
            return None;
        }
        if part < 3 {
            if b.get(i) != Some(&b'.') {
                return None;
            }
            i += 1;
        }
    }
    (b.get(i).is_none_or(|c| !c.is_ascii_digit())).then_some(i)
}

fn label<'a>(m: &'a prometheus::proto::Metric, name: &str) -> &'a str {
    m.get_label()
        .iter()
        .find(|l| l.name() == name)
        .map(|l| l.value())
        .unwrap_or("")
}

fn counter_value(m: &prometheus::proto::Metric) -> u64 {
    // Counters of whole hits, stored as f64 by the client library.
    m.get_counter().get_value() as u64
}

/// Every envoyproxy counter, read from sluice's registry now.
pub fn stats(families: &[MetricFamily]) -> Vec<Stat> {
    let mut out = descriptor_stats(families);
    out.extend(service_stats(families));
    out
}

/// `ratelimit.service.rate_limit.<domain>.<key>.<counter>`, one per descriptor series.
fn descriptor_stats(families: &[MetricFamily]) -> Vec<Stat> {
    let family = |name: &str| families.iter().find(|f| f.name() == name);
    let mut out = Vec::new();
    for (sluice, suffix) in DESCRIPTOR_COUNTERS {
        let Some(f) = family(sluice) else { continue };
        for m in f.get_metric() {
            let path = sanitize(&format!(
                "{}.{}",
                label(m, "domain"),
                label(m, "descriptor")
            ));
            let prometheus = (suffix != "over_limit_with_local_cache").then(|| {
                let mut parts = path.split('.');
                let mut labels = vec![
                    ("domain", parts.next().unwrap_or("").to_string()),
                    ("key1", parts.next().unwrap_or("").to_string()),
                ];
                if let Some(k2) = parts.next() {
                    labels.push(("key2", k2.to_string()));
                }
                (prometheus_descriptor_name(suffix), labels)
            });
            out.push(Stat {
                name: format!("ratelimit.service.rate_limit.{path}.{suffix}"),
                value: counter_value(m),
                prometheus,
            });
        }
    }
    out
}

/// The service-wide stats: errors by type, config loads, total requests.
fn service_stats(families: &[MetricFamily]) -> Vec<Stat> {
    let family = |name: &str| families.iter().find(|f| f.name() == name);
    let mut out = Vec::new();
    let sum = |name: &str, keep: &dyn Fn(&prometheus::proto::Metric) -> bool| -> u64 {
        family(name)
            .map(|f| {
                f.get_metric()
                    .iter()
                    .filter(|m| keep(m))
                    .map(|m| match f.get_field_type() {
                        MetricType::HISTOGRAM => m.get_histogram().get_sample_count(),
                        _ => counter_value(m),
                    })
                    .sum()
            })
            .unwrap_or(0)
    };
    let errors = [
        ("redis_error", sum("sluice_store_errors_total", &|_| true)),
        (
            "service_error",
            sum("sluice_request_duration_seconds", &|m| {
                label(m, "outcome") == "invalid_argument"
            }),
        ),
    ];
    for (kind, value) in errors {
        out.push(Stat {
            name: format!("ratelimit.service.call.should_rate_limit.{kind}"),
            value,
            prometheus: Some((
                "ratelimit_service_should_rate_limit_error",
                vec![("err_type", kind.to_string())],
            )),
        });
    }
    for (result, stat) in [
        ("success", "config_load_success"),
        ("failure", "config_load_error"),
    ] {
        out.push(Stat {
            name: format!("ratelimit.service.{stat}"),
            value: sum("sluice_config_loads_total", &|m| {
                label(m, "result") == result
            }),
            prometheus: Some((
                if result == "success" {
                    "ratelimit_service_config_load_success"
                } else {
                    "ratelimit_service_config_load_error"
                },
                Vec::new(),
            )),
        });
    }
    out.push(Stat {
        name: "ratelimit_server.ShouldRateLimit.total_requests".into(),
        value: sum("sluice_request_duration_seconds", &|_| true),
        prometheus: Some((
            "ratelimit_service_total_requests",
            vec![("grpc_method", "ShouldRateLimit".to_string())],
        )),
    });
    out
}

fn prometheus_descriptor_name(suffix: &str) -> &'static str {
    match suffix {
        "total_hits" => "ratelimit_service_rate_limit_total_hits",
        "over_limit" => "ratelimit_service_rate_limit_over_limit",
        "near_limit" => "ratelimit_service_rate_limit_near_limit",
        "within_limit" => "ratelimit_service_rate_limit_within_limit",
        _ => "ratelimit_service_rate_limit_shadow_mode",
    }
}

/// `EXTRA_TAGS` as gostats appends them to a statsd name: sorted, `.__key=value` each.
fn with_tags(name: &str, tags: &[(String, String)]) -> String {
    let mut out = name.to_string();
    for (k, v) in tags {
        let _ = write!(out, ".__{k}={}", v.replace([':', '|'], "_"));
    }
    out
}

/// The statsd lines of one flush: each counter's increase since `last` (updated), non-zero only.
pub fn statsd_lines(
    stats: &[Stat],
    last: &mut HashMap<String, u64>,
    tags: &[(String, String)],
) -> Vec<String> {
    let mut lines = Vec::new();
    for s in stats {
        let before = last.insert(s.name.clone(), s.value).unwrap_or(0);
        let delta = s.value.saturating_sub(before);
        if delta > 0 {
            lines.push(format!("{}:{delta}|c", with_tags(&s.name, tags)));
        }
    }
    lines
}

/// Prometheus text (0.0.4) of envoyproxy's series, as its built-in exporter serves them.
pub fn render_prometheus(metrics: &Metrics, tags: &[(String, String)]) -> String {
    let families = metrics.gather();
    let mut by_name: Vec<(&'static str, Vec<(Labels, u64)>)> = Vec::new();
    for s in stats(&families) {
        let Some((name, labels)) = s.prometheus else {
            continue;
        };
        match by_name.iter_mut().find(|(n, _)| *n == name) {
            Some((_, series)) => series.push((labels, s.value)),
            None => by_name.push((name, vec![(labels, s.value)])),
        }
    }
    let mut out = String::new();
    let extra: Vec<(String, String)> = tags.to_vec();
    let render_labels = |labels: &[(&'static str, String)]| -> String {
        let all: Vec<String> = labels
            .iter()
            .map(|(k, v)| ((*k).to_string(), v.clone()))
            .chain(extra.iter().cloned())
            .map(|(k, v)| format!("{k}=\"{}\"", escape(&v)))
            .collect();
        if all.is_empty() {
            String::new()
        } else {
            format!("{{{}}}", all.join(","))
        }
    };
    for (name, series) in &by_name {
        let _ = writeln!(out, "# TYPE {name} counter");
        for (labels, value) in series {
            let _ = writeln!(out, "{name}{} {value}", render_labels(labels));
        }
    }
    // The gRPC response time, from sluice's request histogram (all outcomes together).
    if let Some(f) = families
        .iter()
        .find(|f| f.name() == "sluice_request_duration_seconds")
    {
        let mut buckets: Vec<(f64, u64)> = Vec::new();
        let (mut count, mut sum) = (0u64, 0.0f64);
        for m in f.get_metric() {
            let h = m.get_histogram();
            count += h.get_sample_count();
            sum += h.get_sample_sum();
            for (i, b) in h.get_bucket().iter().enumerate() {
                match buckets.get_mut(i) {
                    Some(slot) => slot.1 += b.cumulative_count(),
                    None => buckets.push((b.upper_bound(), b.cumulative_count())),
                }
            }
        }
        let name = "ratelimit_service_response_time_seconds";
        let labels = render_labels(&[("grpc_method", "ShouldRateLimit".to_string())]);
        let inner = labels.trim_start_matches('{').trim_end_matches('}');
        let _ = writeln!(out, "# TYPE {name} histogram");
        for (le, n) in &buckets {
            let _ = writeln!(out, "{name}_bucket{{{inner},le=\"{le}\"}} {n}");
        }
        let _ = writeln!(out, "{name}_bucket{{{inner},le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum{labels} {sum}");
        let _ = writeln!(out, "{name}_count{labels} {count}");
    }
    out
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Where and how often statsd lines go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatsdSettings {
    pub host: String,
    pub port: u16,
    /// `STATS_FLUSH_INTERVAL`.
    pub flush_interval: Duration,
}

/// Largest datagram sent: fits an Ethernet MTU with IP and UDP headers, as statsd clients do.
const MAX_DATAGRAM: usize = 1432;

/// Flushes the counters to statsd over UDP every interval until aborted. A send that fails (a
/// name that does not resolve, say) is logged when it starts and when it ends; UDP gives no
/// receipt, so what is lost on the way is lost, as with any statsd client.
pub async fn run_statsd(metrics: Metrics, settings: StatsdSettings, tags: Vec<(String, String)>) {
    let interval = settings.flush_interval.max(Duration::from_millis(10));
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = HashMap::new();
    let mut failing = false;
    loop {
        ticker.tick().await;
        let stats = stats(&metrics.gather());
        // Computed before sending: the next flush carries on from here either way, so a
        // failed send loses this increase rather than doubling it later.
        let lines = statsd_lines(&stats, &mut last, &tags);
        if lines.is_empty() {
            continue;
        }
        match send(&settings, &lines).await {
            Ok(()) => {
                if std::mem::take(&mut failing) {
                    tracing::info!(host = %settings.host, port = settings.port, "statsd reachable again");
                }
            }
            Err(e) => {
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(host = %settings.host, port = settings.port, error = %e, "cannot send stats to statsd");
                }
            }
        }
    }
}

async fn send(settings: &StatsdSettings, lines: &[String]) -> std::io::Result<()> {
    let addr = tokio::net::lookup_host((settings.host.as_str(), settings.port))
        .await?
        .next()
        .ok_or_else(|| std::io::Error::other("no address"))?;
    let local: std::net::SocketAddr = if addr.is_ipv6() {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    };
    let socket = tokio::net::UdpSocket::bind(local).await?;
    let mut datagram = String::new();
    for line in lines {
        if !datagram.is_empty() && datagram.len() + 1 + line.len() > MAX_DATAGRAM {
            socket.send_to(datagram.as_bytes(), addr).await?;
            datagram.clear();
        }
        if !datagram.is_empty() {
            datagram.push('\n');
        }
        datagram.push_str(line);
    }
    if !datagram.is_empty() {
        socket.send_to(datagram.as_bytes(), addr).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_sanitised_as_envoyproxy_does() {
        assert_eq!(
            sanitize("edge.remote_address_10.0.0.1"),
            "edge.remote_address_10_0_0_1"
        );
        assert_eq!(sanitize("d.key_a:b|c"), "d.key_a_b_c");
        assert_eq!(
            sanitize("d.x\nratelimit.victim.over_limit\r\t\u{0}"),
            "d.x_ratelimit.victim.over_limit___",
            "no line of its own"
        );
        assert_eq!(sanitize("d.v_1.2.3"), "d.v_1.2.3", "not a dotted quad");
        assert_eq!(
            sanitize("d.k_1234.1.1.1"),
            "d.k_1234.1.1.1",
            "4 digits: not an IP"
        );
    }

    #[test]
    fn statsd_lines_are_increases_since_the_last_flush() {
        let stat = |v| Stat {
            name: "ratelimit.service.rate_limit.d.k.total_hits".into(),
            value: v,
            prometheus: None,
        };
        let mut last = HashMap::new();
        let tags = vec![("env".to_string(), "prod:eu".to_string())];
        assert_eq!(
            statsd_lines(&[stat(3)], &mut last, &tags),
            ["ratelimit.service.rate_limit.d.k.total_hits.__env=prod_eu:3|c"]
        );
        assert!(
            statsd_lines(&[stat(3)], &mut last, &[]).is_empty(),
            "no change, no line"
        );
        assert_eq!(
            statsd_lines(&[stat(5)], &mut last, &[]),
            ["ratelimit.service.rate_limit.d.k.total_hits:2|c"]
        );
    }
}
