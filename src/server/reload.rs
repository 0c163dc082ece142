//! Live config reload: the config file or directory is re-read whenever its contents change, and
//! the new rules replace the old ones only if they load without error. Polling file contents
//! (following symlinks on every walk) sees every way configs are updated in practice: an edit in
//! place, a rename over the file, a swapped `RUNTIME_ROOT` symlink, and the atomic `..data`
//! symlink swap of a Kubernetes ConfigMap volume, with no platform-specific file watcher.

use crate::config::{fingerprint, load_path, LoadOptions};
use crate::service::RateLimiter;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Default time between two looks at watched files: the config tree, and the gRPC TLS
/// certificate, key and client CA.
pub const DEFAULT_RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// What to watch.
#[derive(Debug, Clone)]
pub struct ReloadSettings {
    /// The config file or directory, as loaded at start.
    pub path: PathBuf,
    pub options: LoadOptions,
    /// Time between two looks (`CONFIG_RELOAD_INTERVAL`).
    pub interval: Duration,
    /// Which config it is: the enforced one, or the candidate one (`CANDIDATE_CONFIG`).
    pub candidate: bool,
}

/// Watches `settings.path` until aborted. `loaded` is the digest of what the running rules were
/// loaded from, so an unchanged tree is never reloaded.
pub(crate) async fn watch(limiter: Arc<RateLimiter>, settings: ReloadSettings, mut loaded: u64) {
    let interval = settings.interval.max(Duration::from_millis(10));
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let settings = Arc::new(settings);
    loop {
        ticker.tick().await;
        let s = Arc::clone(&settings);
        // File I/O stays off the async workers.
        let attempt = tokio::task::spawn_blocking(move || {
            let before = fingerprint(&s.path, &s.options);
            if before == loaded {
                return None;
            }
            let result = load_path(&s.path, &s.options);
            // Files that changed while being read (a swap in progress) may be a mix of old and
            // new: skip this round and read them again on the next tick.
            let after = fingerprint(&s.path, &s.options);
            (before == after).then_some((after, result))
        })
        .await;
        let Ok(Some((digest, result))) = attempt else {
            continue;
        };
        loaded = digest;
        match result {
            Ok(rules) if settings.candidate => {
                tracing::info!(
                    source = %settings.path.display(),
                    domains = rules.domains.len(),
                    "candidate config reloaded; its counts start over"
                );
                limiter.replace_candidates(rules);
            }
            Err(errors) if settings.candidate => {
                tracing::error!(
                    source = %settings.path.display(),
                    errors = %errors,
                    "candidate config reload failed; the previous candidates stay in force"
                );
                limiter.candidates().record_failed_load();
            }
            Ok(rules) => {
                super::log_config_loaded(&rules, Some(&settings.path), limiter.options().counting);
                limiter.replace_rules(rules);
            }
            Err(errors) => {
                tracing::error!(
                    source = %settings.path.display(),
                    errors = %errors,
                    "config reload failed; the previous rules stay in force"
                );
                limiter.config_load_failed(&errors.to_string());
            }
        }
    }
}
