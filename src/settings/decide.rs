//! How requests are decided, beside the config: the flags `sluice serve` runs with and
//! `sluice replay` replays with (the same names and environment variables, so a replay in the
//! service's environment decides as it did).

use super::parse_go_bool;
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct DecideFlags {
    /// Decide and count as usual but always answer OK.
    #[arg(
        long,
        env = "SHADOW_MODE",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub shadow_mode: bool,

    /// Treat every limit as `quota_mode: true` (envoyproxy's global quota mode): a request is
    /// over limit only when all of its limits are.
    #[arg(
        long,
        env = "QUOTA_MODE",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub quota_mode: bool,

    /// envoyproxy counting only: if one of a request's keys would exceed its limit, charge only
    /// the keys that would (and nothing if one is in the local over-limit cache), as
    /// envoyproxy/ratelimit's setting of the same name; sluice decides it atomically.
    #[arg(
        long,
        env = "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub stop_cache_key_increment_when_overlimit: bool,

    /// Honour Envoy's per-descriptor `limit` (the `limit` of a rate-limit action, from dynamic
    /// metadata): it replaces the node's configured limits, never the resource limits above
    /// it. Whoever can build the override chooses that limit: turn it off unless only your
    /// proxies reach sluice and only your control plane sets it. A domain's
    /// `allow_limit_override:` wins over this.
    #[arg(
        long,
        env = "ALLOW_LIMIT_OVERRIDE",
        default_value = "true",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub allow_limit_override: bool,
}
