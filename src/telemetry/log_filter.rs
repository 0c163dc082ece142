//! Which log lines are written: `LOG_LEVEL` for everything, refined per module by `RUST_LOG`.
//!
//! Why not `EnvFilter::from_env` with `LOG_LEVEL` as its default directive: that default is
//! dropped as soon as `RUST_LOG` holds any directive, so `RUST_LOG=sluice::store=debug` (an
//! operator looking closer at one module) would silence every other line, warnings and errors
//! included. Here `LOG_LEVEL` stays the level of everything `RUST_LOG` does not name, unless
//! `RUST_LOG` sets a level of its own for everything (a bare `debug`), which then wins.

use tracing_subscriber::filter::{EnvFilter, LevelFilter};

/// The filter for `level` (`LOG_LEVEL`) refined by `rust_log` (`RUST_LOG`, if set); invalid
/// directives in `rust_log` are skipped.
pub fn log_filter(level: LevelFilter, rust_log: Option<&str>) -> EnvFilter {
    let rust_log = rust_log.unwrap_or_default().trim();
    let sets_all = rust_log
        .split(',')
        .any(|d| d.trim().parse::<LevelFilter>().is_ok());
    let spec = if sets_all {
        rust_log.to_string()
    } else {
        format!("{level},{rust_log}")
    };
    EnvFilter::builder()
        .with_default_directive(level.into())
        .parse_lossy(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_module_directive_refines_the_level_and_keeps_it_for_the_rest() {
        let f = log_filter(LevelFilter::INFO, Some("sluice::store::global=debug"));
        assert_eq!(
            f.max_level_hint(),
            Some(LevelFilter::DEBUG),
            "the module's debug lines"
        );
        let text = f.to_string();
        assert!(text.contains("sluice::store::global=debug"), "{text}");
        assert!(
            text.split(',').any(|d| d == "info"),
            "the rest at info: {text}"
        );
    }

    #[test]
    fn a_bare_level_in_rust_log_wins_and_no_rust_log_is_the_level() {
        let f = log_filter(LevelFilter::INFO, Some("warn,sluice=debug"));
        let text = f.to_string();
        assert!(!text.split(',').any(|d| d == "info"), "{text}");
        assert!(text.split(',').any(|d| d == "warn"), "{text}");
        assert_eq!(log_filter(LevelFilter::WARN, None).to_string(), "warn");
        // Nothing valid in it: the level alone.
        assert_eq!(
            log_filter(LevelFilter::ERROR, Some("=lolwut")).to_string(),
            "error"
        );
    }
}
