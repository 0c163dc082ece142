//! envoyproxy/ratelimit's stats settings (`USE_STATSD`, `USE_PROMETHEUS` and their companions),
//! with its names and defaults. sluice's own `/metrics` on the admin port is always on; these
//! add envoyproxy's series for dashboards built on them (see `telemetry/envoy_stats.rs`).

use super::{parse_duration, parse_go_bool, SettingsError};
use crate::server::EnvoyStatsSettings;
use crate::telemetry::envoy_stats::StatsdSettings;
use clap::Args;
use std::net::SocketAddr;
use std::time::Duration;

#[derive(Debug, Clone, Args)]
pub struct StatsArgs {
    /// Send envoyproxy's stats as statsd lines (UDP) every STATS_FLUSH_INTERVAL.
    #[arg(long, env = "USE_STATSD", default_value = "true", value_parser = parse_go_bool,
          num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub use_statsd: bool,

    #[arg(long, env = "STATSD_HOST", default_value = "localhost")]
    pub statsd_host: String,

    #[arg(long, env = "STATSD_PORT", default_value_t = 8125)]
    pub statsd_port: u16,

    /// Tags added to every envoyproxy stat, `key:value,key:value`.
    #[arg(long, env = "EXTRA_TAGS", default_value = "")]
    pub extra_tags: String,

    #[arg(long, env = "STATS_FLUSH_INTERVAL", default_value = "10s", value_parser = parse_duration)]
    pub stats_flush_interval: Duration,

    /// No envoyproxy stats at all (neither statsd nor USE_PROMETHEUS); `/metrics` stays.
    #[arg(long, env = "DISABLE_STATS", default_value = "false", value_parser = parse_go_bool,
          num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub disable_stats: bool,

    /// Serve envoyproxy's Prometheus series on PROMETHEUS_ADDR (needs USE_STATSD=false).
    #[arg(long, env = "USE_PROMETHEUS", default_value = "false", value_parser = parse_go_bool,
          num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub use_prometheus: bool,

    /// `host:port` or Go's `:port` (every interface).
    #[arg(long, env = "PROMETHEUS_ADDR", default_value = ":9090")]
    pub prometheus_addr: String,

    #[arg(long, env = "PROMETHEUS_PATH", default_value = "/metrics")]
    pub prometheus_path: String,

    /// envoyproxy's statsd_exporter mapping file. sluice serves the series of envoyproxy's
    /// default mapping and does not read this file.
    #[arg(long, env = "PROMETHEUS_MAPPER_YAML")]
    pub prometheus_mapper_yaml: Option<String>,
}

impl StatsArgs {
    pub fn settings(&self) -> Result<Option<EnvoyStatsSettings>, SettingsError> {
        let err = |m: String| SettingsError::Stats(m);
        if self.disable_stats {
            return Ok(None);
        }
        if self.use_statsd && self.use_prometheus {
            // envoyproxy refuses this too: one stats sink at a time.
            return Err(err(
                "USE_STATSD and USE_PROMETHEUS are both true: set one of them \
                            (envoyproxy/ratelimit refuses this too; USE_STATSD defaults to true)"
                    .into(),
            ));
        }
        let tags = tags(&self.extra_tags).map_err(err)?;
        let statsd = self.use_statsd.then(|| StatsdSettings {
            host: self.statsd_host.clone(),
            port: self.statsd_port,
            flush_interval: self.stats_flush_interval,
        });
        let prometheus = match self.use_prometheus {
            false => None,
            true => {
                if !self.prometheus_path.starts_with('/') {
                    return Err(err(format!(
                        "PROMETHEUS_PATH must start with '/', got {:?}",
                        self.prometheus_path
                    )));
                }
                if let Some(file) = &self.prometheus_mapper_yaml {
                    tracing::info!(
                        file = %file,
                        "PROMETHEUS_MAPPER_YAML is not read: sluice serves the series of \
                         envoyproxy's default mapping"
                    );
                }
                Some((
                    go_addr(&self.prometheus_addr)?,
                    self.prometheus_path.clone(),
                ))
            }
        };
        if statsd.is_none() && prometheus.is_none() {
            return Ok(None);
        }
        Ok(Some(EnvoyStatsSettings {
            statsd,
            prometheus,
            tags,
        }))
    }
}

/// Go's listen address: `:9090` is every interface. Resolved as the other listeners are.
fn go_addr(s: &str) -> Result<SocketAddr, SettingsError> {
    let bad = || {
        SettingsError::Stats(format!(
            "PROMETHEUS_ADDR must be host:port or :port, got {s:?}"
        ))
    };
    let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let host = if host.is_empty() { "0.0.0.0" } else { host };
    super::resolve("Prometheus (USE_PROMETHEUS)", host, port)
}

/// `EXTRA_TAGS`: `key:value,...` (envconfig's map syntax), sorted by key as gostats sends them.
fn tags(s: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for (k, v) in super::key_value_list(s, "EXTRA_TAGS")? {
        let valid = !k.is_empty()
            && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !k.starts_with(|c: char| c.is_ascii_digit());
        if !valid {
            return Err(format!(
                "EXTRA_TAGS key {k:?} must be letters, digits and '_' (it becomes a label)"
            ));
        }
        out.push((k.to_string(), v.to_string()));
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_addr_and_tags_parse_as_envoyproxy_writes_them() {
        assert_eq!(
            go_addr(":19001").ok(),
            Some(SocketAddr::from(([0, 0, 0, 0], 19001)))
        );
        assert_eq!(
            go_addr("127.0.0.1:9").ok(),
            Some(SocketAddr::from(([127, 0, 0, 1], 9)))
        );
        assert!(go_addr("19001").is_err());
        assert_eq!(
            tags("zone:eu, env:prod").expect("valid"),
            [("env".into(), "prod".into()), ("zone".into(), "eu".into())]
        );
        assert!(tags("novalue").is_err());
        assert!(tags("a-b:1").is_err());
    }
}
