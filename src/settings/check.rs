//! `sluice check PATH`: validate a config without serving it.

use super::parse_go_bool;
use crate::config::LoadOptions;
use clap::Args;
use std::path::PathBuf;
/// `sluice check PATH`.
#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    /// Config file or directory to validate.
    pub path: PathBuf,

    #[command(flatten)]
    pub load: LoadFlags,
}

/// How a config tree is read: one set of flags for `serve` and `check`, so a check reads the
/// tree exactly as the service will.
#[derive(Debug, Clone, Args)]
pub struct LoadFlags {
    /// Skip files and directories whose name starts with `.` (Kubernetes ConfigMap mounts hold
    /// `..data` symlinks).
    #[arg(
        long,
        alias = "ignore-dotfiles",
        env = "RUNTIME_IGNOREDOTFILES",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub runtime_ignoredotfiles: bool,

    /// Configs (files or xDS resources) with the same domain add their descriptors to it
    /// instead of being refused.
    #[arg(
        long,
        env = "MERGE_DOMAIN_CONFIG",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub merge_domain_config: bool,

    /// envoyproxy's `USE_CALENDAR_MONTH_RATE_LIMIT`: a fixed-window `unit: month` without a
    /// `calendar:` block is a UTC calendar month (reset at 00:00 UTC on the 1st) instead of 30
    /// days from the Unix epoch.
    #[arg(
        long,
        env = "USE_CALENDAR_MONTH_RATE_LIMIT",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub use_calendar_month_rate_limit: bool,

    /// How a domain without its own `counting:` charges its limits (and every domain pushed
    /// over xDS): `envoyproxy` records every hit, as envoyproxy/ratelimit; `all_or_nothing`
    /// charges a request only if every limit admits it.
    #[arg(long, env = "COUNTING", default_value = "envoyproxy")]
    pub counting: crate::config::Counting,
}

impl LoadFlags {
    pub fn options(&self) -> LoadOptions {
        LoadOptions {
            ignore_dotfiles: self.runtime_ignoredotfiles,
            merge_domains: self.merge_domain_config,
            calendar_months: self.use_calendar_month_rate_limit,
            // `sluice check` runs where the service's environment may be: a `global` limit
            // loads when that environment names a home store.
            global_store: std::env::var_os("GLOBAL_REDIS_URL").is_some_and(|u| !u.is_empty()),
        }
    }
}
