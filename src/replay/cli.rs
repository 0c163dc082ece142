//! `sluice replay` from the command line: read the log, replay it against each config, print
//! the table (or the JSON), draw the picture; a progress line on a terminal.

use super::{read_logs, replay, svg, table, Report};
use crate::config::load_path;
use crate::service::ServiceOptions;
use crate::settings::ReplayArgs;
use std::io::{IsTerminal, Write};

/// Runs the replay the arguments ask for; the report goes to stdout, errors are returned.
pub async fn run(args: &ReplayArgs) -> Result<(), String> {
    if let Some(p) = &args.plot {
        let svg_file = p.extension().is_some_and(|e| e.eq_ignore_ascii_case("svg"));
        if !svg_file {
            return Err(format!(
                "--plot {}: the picture is drawn as SVG (name the file .svg)",
                p.display()
            ));
        }
    }
    let mut options = args.load.options();
    // A global limit is decided on one counter here, as the home store counts it.
    options.global_store = true;
    let mut rules = Vec::new();
    for path in args.configs() {
        let r = load_path(&path, &options).map_err(|errors| {
            let all: Vec<String> = errors.0.iter().map(ToString::to_string).collect();
            format!("{}: invalid config:\n{}", path.display(), all.join("\n"))
        })?;
        rules.push((path, r));
    }
    let (lines, skipped) = read_logs(&args.logs)?;
    if let Some(first) = &skipped.first {
        // A log cut by a full disk or a crash: the rest replays, and stderr says so.
        eprintln!(
            "sluice replay: {} line(s) skipped that are not decision log lines; the first: {first}",
            skipped.lines
        );
    }
    let mut report = Report {
        lines: lines.len() as u64,
        first_us: lines.first().map_or(0, |l| l.t),
        last_us: lines.last().map_or(0, |l| l.t),
        configs: Vec::new(),
    };
    let shown = std::io::stderr().is_terminal();
    for (path, r) in rules {
        let name = path.display().to_string();
        let total = lines.len().max(1);
        let mut progress = |done: usize| {
            if shown {
                eprint!("\r{name}: {:>3}% ({done} of {total})", done * 100 / total);
                let _ = std::io::stderr().flush();
            }
        };
        let d = &args.decide;
        let options = ServiceOptions {
            counting: args.load.counting,
            global_shadow_mode: d.shadow_mode,
            global_quota_mode: d.quota_mode,
            stop_increment_when_over: d.stop_cache_key_increment_when_overlimit,
            allow_limit_override: d.allow_limit_override,
            ..ServiceOptions::default()
        };
        let c = replay(&name, r, options, &lines, args.top, &mut progress).await?;
        if shown {
            eprintln!();
        }
        report.configs.push(c);
    }
    let out = if args.json {
        serde_json::to_string_pretty(&report).map_err(|e| e.to_string())? + "\n"
    } else {
        table(&report)
    };
    print!("{out}");
    if let Some(p) = &args.plot {
        std::fs::write(p, svg(&report)).map_err(|e| format!("{}: {e}", p.display()))?;
        if !args.json {
            println!("\npicture: {}", p.display());
        }
    }
    Ok(())
}
