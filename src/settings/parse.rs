//! The value grammars settings share: Go's booleans and durations as envoyproxy/ratelimit reads
//! them, envconfig's `key:value` lists, counts with a floor, and secrets that never print.

use super::SettingsError;

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::str::FromStr;
use std::time::Duration;
/// A setting that may carry credentials (a Redis URL with a password, later tokens): `Debug`
/// never shows its value, so logging the settings can never leak it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The raw value, for the one place that needs it (connecting).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_string()))
    }
}

/// `MEMORY_MAX_COUNTERS`: at least 1 (a store that keeps no counter would enforce no limit).
pub(crate) fn parse_max_counters(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1: a store holding no counter enforces no limit".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("not a number of counters: {e}")),
    }
}

/// envconfig's map syntax, `key:value,key:value`: trimmed pairs, empty entries skipped; an entry
/// without `:` is an error naming `setting`.
pub(crate) fn key_value_list<'a>(
    s: &'a str,
    setting: &str,
) -> Result<Vec<(&'a str, &'a str)>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|entry| {
            entry
                .split_once(':')
                .map(|(k, v)| (k.trim(), v.trim()))
                .ok_or_else(|| format!("{setting} entry {entry:?} is not key:value"))
        })
        .collect()
}

/// Go's `strconv.ParseBool`, which envoyproxy/ratelimit uses for its boolean env vars.
pub fn parse_go_bool(s: &str) -> Result<bool, String> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(format!(
            "invalid boolean {s:?} (use true/false/1/0/t/f/TRUE/FALSE/True/False)"
        )),
    }
}

/// A duration as Go's `time.ParseDuration` writes them; see [`crate::duration::parse_go`].
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    crate::duration::parse_go(s)
}

/// `host:port` to a socket address. Hosts are usually IPs (`0.0.0.0`, `::`), but names such as
/// `localhost` work too, as with Go's net.Listen.
pub(crate) fn resolve(
    what: &'static str,
    host: &str,
    port: u16,
) -> Result<SocketAddr, SettingsError> {
    let err = |reason: String| SettingsError::Resolve {
        what,
        host: host.to_string(),
        port,
        reason,
    };
    // Accept `[::1]` as well as `::1`.
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if let Ok(ip) = bare.parse::<std::net::IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    (bare, port)
        .to_socket_addrs()
        .map_err(|e| err(e.to_string()))?
        .next()
        .ok_or_else(|| err("no address found".to_string()))
}
