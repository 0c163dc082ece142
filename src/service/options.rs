//! The service-wide switches a deployment sets (`SHADOW_MODE`, `QUOTA_MODE`, `FAILURE_MODE`,
//! `NEAR_LIMIT_RATIO`, the request caps ...): plain data, parsed by `settings` and read by the
//! limiter on every request.

use super::headers;

/// Service-wide switches.
#[derive(Debug, Clone)]
pub struct ServiceOptions {
    /// `SHADOW_MODE`: decide and count as usual, but always answer OK overall.
    pub global_shadow_mode: bool,
    /// `QUOTA_MODE`: every limit is a quota-mode limit, as if each descriptor set
    /// `quota_mode: true` (see [`crate::store::Admission`]).
    pub global_quota_mode: bool,
    /// `COUNTING`: how a domain without its own `counting:` charges (xDS-pushed domains too).
    pub counting: crate::config::Counting,
    /// `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT` (envoyproxy counting only).
    pub stop_increment_when_over: bool,
    /// `FAILURE_MODE`: what to answer when the counter store fails. `None` (the default)
    /// answers gRPC UNAVAILABLE, leaving the choice to Envoy's `failure_mode_deny`.
    pub failure_mode: Option<FailureMode>,
    /// `NEAR_LIMIT_RATIO`: allowed hits past this share of a limit count as `near_limit`.
    pub near_limit_ratio: f64,
    /// `LIMIT_RESPONSE_HEADERS_ENABLED`: the headers to add; `None` adds none.
    pub headers: Option<headers::HeaderOptions>,
    /// Bounds on what one request may ask for.
    pub caps: RequestCaps,
    /// Not ready (gRPC health NOT_SERVING, `/healthcheck` 500) until a first config is in:
    /// `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED`, or config over xDS without
    /// `FORCE_START_WITHOUT_INITIAL_CONFIG`. Only a limiter started by
    /// [`RateLimiter::awaiting_config`] ever lacks a config.
    pub ready_needs_config: bool,
    /// `RESPONSE_DYNAMIC_METADATA`: fill the response's `dynamic_metadata` as envoyproxy does.
    pub response_dynamic_metadata: bool,
    /// `ALLOW_LIMIT_OVERRIDE`: whether Envoy's per-descriptor `limit` replaces the configured
    /// limit in a domain without its own `allow_limit_override:`.
    pub allow_limit_override: bool,
    /// `DECISION_LOG`: where decided requests are offered (off: `None`).
    pub decision_log: Option<crate::decision_log::DecisionLog>,
}

/// Bounds on one request, checked before any rule or store work, so no request a client
/// controls can make a script run long, hold the memory store's locks, or allocate without
/// limit. The defaults leave room for what Envoy really sends (a few descriptors of a few
/// entries; values such as paths and header values) and keep the worst accepted request at a
/// few hundred counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestCaps {
    /// `MAX_DESCRIPTORS_PER_REQUEST`.
    pub descriptors: u32,
    /// `MAX_ENTRIES_PER_DESCRIPTOR`.
    pub entries: u32,
    /// `MAX_DESCRIPTOR_KEY_BYTES`.
    pub key_bytes: u32,
    /// `MAX_DESCRIPTOR_VALUE_BYTES`.
    pub value_bytes: u32,
}

impl Default for RequestCaps {
    fn default() -> Self {
        Self {
            descriptors: 64,
            entries: 16,
            key_bytes: 256,
            value_bytes: 4096,
        }
    }
}

impl RequestCaps {
    /// The largest RLS request the caps can admit, in bytes on the wire: the domain, and each
    /// descriptor's entries at their longest with their framing, its limit override and its
    /// `hits_addend` (4.3 MiB with the defaults). A larger message is refused from its length
    /// prefix, unread, with OUT_OF_RANGE (issue 38: the RLS message size follows the caps).
    pub fn max_message_bytes(&self) -> usize {
        let entry = (self.key_bytes as usize).saturating_add(self.value_bytes as usize) + 16;
        let descriptor = (self.entries as usize)
            .saturating_mul(entry)
            .saturating_add(64);
        (self.descriptors as usize)
            .saturating_mul(descriptor)
            .saturating_add(crate::config::MAX_DOMAIN_BYTES + 64)
    }
}

/// envoyproxy/ratelimit's default `NEAR_LIMIT_RATIO`.
pub const DEFAULT_NEAR_LIMIT_RATIO: f64 = 0.8;

impl Default for ServiceOptions {
    fn default() -> Self {
        Self {
            global_shadow_mode: false,
            global_quota_mode: false,
            counting: crate::config::Counting::default(),
            stop_increment_when_over: false,
            failure_mode: None,
            near_limit_ratio: DEFAULT_NEAR_LIMIT_RATIO,
            headers: None,
            caps: RequestCaps::default(),
            ready_needs_config: false,
            response_dynamic_metadata: false,
            allow_limit_override: true,
            decision_log: None,
        }
    }
}

/// What sluice answers itself when the counter store cannot decide (`FAILURE_MODE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureMode {
    /// Overall OK; every limited descriptor OK with its `current_limit` and 0 remaining.
    Allow,
    /// Overall OVER_LIMIT; every limited descriptor OVER_LIMIT (shadow limits and global
    /// shadow mode still answer OK, as for a real denial).
    Deny,
    /// Decided by this replica against its share of each limit, and written back when the
    /// store answers again (`store::fallback`). A Redis stack decides through that layer, so
    /// the store never fails for the service; if it ever did, the request is denied.
    Local,
}

impl std::str::FromStr for FailureMode {
    type Err = String;
    /// `allow`, `deny` or `local`, case-insensitive.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "allow" => Ok(FailureMode::Allow),
            "deny" => Ok(FailureMode::Deny),
            "local" => Ok(FailureMode::Local),
            _ => Err(format!(
                "invalid failure mode {s:?} (use allow, deny or local)"
            )),
        }
    }
}
