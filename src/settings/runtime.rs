//! envoyproxy/ratelimit's runtime directory layout (`RUNTIME_ROOT`, `RUNTIME_SUBDIRECTORY`, ...)
//! and how an empty env var counts as unset.

use super::{parse_duration, parse_go_bool};
use crate::duration::format_go;
use clap::Args;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::Duration;
/// The envoyproxy/ratelimit runtime directory layout.
#[derive(Debug, Clone, Args)]
pub struct RuntimeArgs {
    // Strings, not paths: an empty part is valid (it vanishes from the composed path).
    /// Root of the runtime directory tree.
    #[arg(
        long,
        env = "RUNTIME_ROOT",
        default_value = "/srv/runtime_data/current"
    )]
    pub runtime_root: String,

    /// Directory under the root (Istio's sample uses `ratelimit`).
    #[arg(long, env = "RUNTIME_SUBDIRECTORY", default_value = "")]
    pub runtime_subdirectory: String,

    /// Directory under the subdirectory that holds the config files.
    #[arg(long, env = "RUNTIME_APPDIRECTORY", default_value = "config")]
    pub runtime_appdirectory: String,

    /// envoyproxy's switch between watching the runtime root (a swapped `RUNTIME_ROOT` symlink)
    /// or the config directory (a ConfigMap's `..data` swap). Accepted for compatibility: sluice
    /// re-reads the whole tree from `RUNTIME_ROOT` down, following symlinks, so it sees both.
    #[arg(
        long,
        env = "RUNTIME_WATCH_ROOT",
        default_value = "true",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub runtime_watch_root: bool,

    /// How often the config files are checked for changes (`1s`, `500ms`); `0` turns live
    /// reload off.
    #[arg(
        long,
        env = "CONFIG_RELOAD_INTERVAL",
        default_value = format_go(crate::server::reload::DEFAULT_RELOAD_INTERVAL),
        value_parser = parse_duration
    )]
    pub config_reload_interval: Duration,
}

impl RuntimeArgs {
    /// ROOT/SUBDIRECTORY/APPDIRECTORY, as envoyproxy/ratelimit composes it (empty parts vanish).
    pub fn config_dir(&self) -> PathBuf {
        Path::new(&self.runtime_root)
            .join(&self.runtime_subdirectory)
            .join(&self.runtime_appdirectory)
    }
}

/// Drops the env fallback of every argument whose variable `is_empty` says is set but empty.
pub fn ignore_empty_env(cmd: clap::Command, is_empty: &dyn Fn(&OsStr) -> bool) -> clap::Command {
    cmd.mut_args(|a| {
        if a.get_env().is_some_and(is_empty) {
            a.env(None)
        } else {
            a
        }
    })
    .mut_subcommands(|sub| ignore_empty_env(sub, is_empty))
}
