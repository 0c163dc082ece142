//! Loading rule files from disk (one file, or a directory of one-domain files) into a
//! [`RuleSet`](super::RuleSet), collecting every error instead of stopping at the first, so an
//! operator fixes a config in one round instead of one mistake per reload.
//! The accepted keys and the rules mirror envoyproxy/ratelimit's `src/config/config_impl.go`
//! (messages keep its wording where it has one), with a few stricter checks noted where they are.
//! The sluice extensions (`period`, `rate_limits`, `algorithm`, `burst`,
//! `applies_to_descendants`) are checked as strictly; a config without them loads to exactly
//! the envoyproxy/ratelimit model (fixed window, unit periods).
//!
//! This file walks files and directories and merges domains; the YAML tree of one file is read
//! by [`ctx::Ctx`] (root and lists), `descriptor.rs` and `limit.rs`; the accepted keys are in
//! `schema.rs` and the error types in `errors.rs`.

mod calendar;
mod ctx;
mod descriptor;
mod errors;
mod lease;
mod leased;
mod limit;
mod schema;

use ctx::{is_null, Ctx};
use errors::file_error;
pub use errors::{ConfigError, ConfigErrors};
pub use lease::{MAX_IN_FLIGHT, MAX_LEASE_ID_BYTES};
pub use leased::Leasing;
pub use limit::MAX_SLIDING_LOG_LIMIT;

/// Longest domain a config may name, and so a request may (review A10: a request's domain
/// reaches trace spans before anything else reads it).
pub const MAX_DOMAIN_BYTES: usize = 1024;

use super::yaml::{self, Node};
use super::{DomainRules, Level, RuleSet};
use std::collections::HashMap;
use std::fs;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

/// Options of the envoyproxy/ratelimit runtime loader.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// `RUNTIME_IGNOREDOTFILES`: skip files and directories whose name starts with `.`.
    pub ignore_dotfiles: bool,
    /// `MERGE_DOMAIN_CONFIG`: files (or xDS resources) with the same domain add their top-level
    /// descriptors to it, as envoyproxy/ratelimit merges them; a top-level descriptor defined
    /// twice is still an error. Off, a domain defined twice is an error.
    pub merge_domains: bool,
    /// envoyproxy's `USE_CALENDAR_MONTH_RATE_LIMIT`: a fixed-window `unit: month` without a
    /// `calendar:` block is a UTC calendar month instead of 30 days from the epoch.
    pub calendar_months: bool,
    /// A home store is set (`GLOBAL_REDIS_URL`): `global` limits may load. Without one, each
    /// `global` block is an error naming its file and line.
    pub global_store: bool,
}

/// Loads a config file, or every file of a directory (one domain per file).
///
/// A directory is walked recursively, following symlinks (Kubernetes ConfigMap mounts are
/// symlinks), in path order so a load is deterministic. Every regular file is a config, as in
/// envoyproxy/ratelimit's runtime loader.
pub fn load_path(path: &Path, opts: &LoadOptions) -> Result<RuleSet, ConfigErrors> {
    let mut errors = Vec::new();
    let files = collect_files(path, opts, &mut errors);
    if files.is_empty() && errors.is_empty() {
        let skipped = if opts.ignore_dotfiles {
            " (files and directories starting with '.' were skipped: RUNTIME_IGNOREDOTFILES=true)"
        } else {
            ""
        };
        errors.push(ConfigError {
            file: path.display().to_string(),
            line: None,
            path: String::new(),
            message: format!("no config files found in this directory{skipped}"),
        });
    }
    let mut sources = Vec::with_capacity(files.len());
    for (file, dotted) in files {
        let name = file.display().to_string();
        match fs::read(&file) {
            Ok(bytes) => match String::from_utf8(bytes) {
                Ok(text) => sources.push(Source {
                    name,
                    path: file,
                    body: Body::Text(text),
                    dotted,
                }),
                Err(_) => errors.push(file_error(&name, "config file is not valid UTF-8")),
            },
            Err(e) => errors.push(file_error(&name, format!("cannot read config file: {e}"))),
        }
    }
    let rules = build(sources, errors, opts.merge_domains, opts.calendar_months)?;
    if !opts.global_store {
        rules.without_home_store()?;
    }
    Ok(rules)
}

/// A digest of everything [`load_path`] would read under `path`: which files, their contents
/// (or why they cannot be read) and errors walking the tree. Live reload compares digests to see
/// a change, including a Kubernetes ConfigMap's atomic `..data` symlink swap, since symlinks are
/// followed on every walk.
pub fn fingerprint(path: &Path, opts: &LoadOptions) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut errors = Vec::new();
    let files = collect_files(path, opts, &mut errors);
    // SipHash with fixed keys: stable within the process, which is all a comparison needs.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for e in &errors {
        e.to_string().hash(&mut h);
    }
    for (file, dotted) in &files {
        file.hash(&mut h);
        dotted.hash(&mut h);
        match fs::read(file) {
            Ok(bytes) => bytes.hash(&mut h),
            Err(e) => e.to_string().hash(&mut h),
        }
    }
    h.finish()
}

/// Loads in-memory sources `(file name, YAML text)`: the same rules as files on disk.
pub fn load_sources(sources: &[(String, String)]) -> Result<RuleSet, ConfigErrors> {
    let sources = sources
        .iter()
        .map(|(name, text)| Source {
            name: name.clone(),
            path: PathBuf::from(name),
            body: Body::Text(text.clone()),
            dotted: has_dot_component(Path::new(name)),
        })
        .collect();
    build(sources, Vec::new(), false, false)
}

/// Loads configs that come as trees rather than text, `(name, root)`: the same rules and the
/// same errors as a file, named after the source and without lines.
pub(crate) fn load_trees(
    trees: Vec<(String, Node)>,
    merge_domains: bool,
    calendar_months: bool,
) -> Result<RuleSet, ConfigErrors> {
    let sources = trees
        .into_iter()
        .map(|(name, root)| Source {
            path: PathBuf::from(&name),
            name,
            body: Body::Tree(root),
            dotted: false,
        })
        .collect();
    build(sources, Vec::new(), merge_domains, calendar_months)
}

struct Source {
    name: String,
    path: PathBuf,
    body: Body,
    /// Found under a directory (or named) starting with `.`: used for the duplicate-domain hint.
    dotted: bool,
}

/// What a source holds: YAML text (a file), or a tree built from another format (xDS).
enum Body {
    Text(String),
    Tree(Node),
}

fn is_dot_name(name: &std::ffi::OsStr) -> bool {
    name.as_encoded_bytes().first() == Some(&b'.')
}

fn has_dot_component(path: &Path) -> bool {
    path.components().any(|c| match c {
        Component::Normal(name) => is_dot_name(name),
        _ => false,
    })
}

/// The files to load under `root`, sorted by path, each with whether it sits under a dot name.
fn collect_files(
    root: &Path,
    opts: &LoadOptions,
    errors: &mut Vec<ConfigError>,
) -> Vec<(PathBuf, bool)> {
    let name = root.display().to_string();
    let meta = match fs::metadata(root) {
        Ok(m) => m,
        Err(e) => {
            errors.push(file_error(&name, format!("cannot read config path: {e}")));
            return Vec::new();
        }
    };
    if meta.is_file() {
        return vec![(root.to_path_buf(), false)];
    }
    if !meta.is_dir() {
        errors.push(file_error(
            &name,
            "config path is neither a regular file nor a directory",
        ));
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut ancestors = Vec::new();
    walk(root, false, opts, &mut ancestors, &mut out, errors);
    out.sort();
    out
}

fn walk(
    dir: &Path,
    dotted: bool,
    opts: &LoadOptions,
    ancestors: &mut Vec<PathBuf>,
    out: &mut Vec<(PathBuf, bool)>,
    errors: &mut Vec<ConfigError>,
) {
    let name = dir.display().to_string();
    // Following symlinks can loop (a link to an ancestor); only the current chain of directories
    // is tracked, so a directory reachable twice (ConfigMap `..data` and its target) is still
    // walked twice, as envoyproxy/ratelimit does.
    let canonical = match fs::canonicalize(dir) {
        Ok(c) => c,
        Err(e) => {
            errors.push(file_error(&name, format!("cannot read directory: {e}")));
            return;
        }
    };
    if ancestors.contains(&canonical) {
        errors.push(file_error(
            &name,
            "symlink loop: this directory links back to one of its parents",
        ));
        return;
    }
    let entries = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) => {
            errors.push(file_error(&name, format!("cannot read directory: {e}")));
            return;
        }
    };
    ancestors.push(canonical);
    for entry in entries {
        let entry = match entry {
            Ok(e) => e,
            Err(e) => {
                errors.push(file_error(&name, format!("cannot read directory: {e}")));
                continue;
            }
        };
        let dot = is_dot_name(&entry.file_name());
        if dot && opts.ignore_dotfiles {
            continue;
        }
        let path = entry.path();
        // `fs::metadata` follows symlinks: a link to a file loads the file, a link to a
        // directory is walked.
        match fs::metadata(&path) {
            Ok(m) if m.is_dir() => walk(&path, dotted || dot, opts, ancestors, out, errors),
            Ok(m) if m.is_file() => out.push((path, dotted || dot)),
            // Sockets, fifos and the like are not configs.
            Ok(_) => {}
            Err(e) => errors.push(file_error(
                &path.display().to_string(),
                format!("cannot read config file: {e}"),
            )),
        }
    }
    ancestors.pop();
}

/// Parses every source, checks domains across files and assembles the rule set.
fn build(
    sources: Vec<Source>,
    mut errors: Vec<ConfigError>,
    merge_domains: bool,
    calendar_months: bool,
) -> Result<RuleSet, ConfigErrors> {
    // domain -> (file, line, dotted) of its first definition
    let mut first: HashMap<String, (String, usize, bool)> = HashMap::new();
    let mut domains = HashMap::new();
    for src in &sources {
        let (parsed, mut file_errors) = match &src.body {
            Body::Text(text) => parse_file(&src.name, text, calendar_months),
            Body::Tree(root) => parse_tree(&src.name, root, calendar_months),
        };
        errors.append(&mut file_errors);
        let Some((rules, line)) = parsed else {
            continue;
        };
        if let (true, Some(into)) = (merge_domains, domains.get_mut(&rules.domain)) {
            merge_domain(into, rules, &src.name, line, &mut errors);
            continue;
        }
        if let Some((other, other_line, other_dotted)) = first.get(&rules.domain) {
            let hint = if src.dotted || *other_dotted {
                "; a file under a directory starting with '.' was loaded too (Kubernetes \
                 ConfigMap mounts hold `..data` and `..<timestamp>` copies): set \
                 RUNTIME_IGNOREDOTFILES=true to skip them"
            } else {
                ""
            };
            let at = if *other_line > 0 {
                format!("{other}:{other_line}")
            } else {
                other.clone()
            };
            errors.push(ConfigError {
                file: src.name.clone(),
                line: (line > 0).then_some(line),
                path: "domain".into(),
                message: format!(
                    "duplicate domain '{}' in config file: already defined at {at}{hint}",
                    rules.domain
                ),
            });
            continue;
        }
        first.insert(rules.domain.clone(), (src.name.clone(), line, src.dotted));
        domains.insert(rules.domain.clone(), rules);
    }
    if !errors.is_empty() {
        return Err(ConfigErrors(errors));
    }
    Ok(RuleSet {
        domains,
        loaded_at: SystemTime::now(),
        sources: sources.into_iter().map(|s| s.path).collect(),
    })
}

/// `MERGE_DOMAIN_CONFIG`: adds `more`'s top-level descriptors to `into` (same domain). A top-level
/// composite key (`key` or `key_value`) both define is an error naming `file`, as in
/// envoyproxy/ratelimit; so is a different `hash_tag`, `counting` or `allow_limit_override`.
fn merge_domain(
    into: &mut DomainRules,
    more: DomainRules,
    file: &str,
    line: usize,
    errors: &mut Vec<ConfigError>,
) {
    let mut err = |message: String| {
        errors.push(ConfigError {
            file: file.to_owned(),
            line: (line > 0).then_some(line),
            path: "descriptors".into(),
            message,
        })
    };
    let differs = [
        ("hash_tag", into.domain_tag != more.domain_tag),
        (
            "allow_limit_override",
            into.allow_limit_override != more.allow_limit_override,
        ),
        ("counting", into.counting != more.counting),
    ];
    if let Some((what, _)) = differs.iter().find(|(_, d)| *d) {
        err(format!(
            "{what} differs from the other config of domain '{}' ({}): merged configs must agree",
            into.domain, into.file
        ));
        return;
    }
    // Each file's `global` blocks, with their own file, for the home-store check.
    into.globals.extend(more.globals.iter().cloned());
    let duplicate = |path: &str| {
        format!(
            "duplicate descriptor composite key '{path}' (domain '{}' is merged from several \
             configs: MERGE_DOMAIN_CONFIG=true)",
            into.domain
        )
    };
    let Level {
        exact,
        wildcards,
        bare,
    } = more.root;
    for (key, values) in exact {
        let slot = into.root.exact.entry(key).or_default();
        for (value, node) in values {
            match slot.entry(value) {
                std::collections::hash_map::Entry::Occupied(_) => err(duplicate(&node.path)),
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(node);
                }
            }
        }
    }
    for node in wildcards {
        let same = into
            .root
            .wildcards
            .iter()
            .any(|w| w.key == node.key && w.value == node.value);
        if same {
            err(duplicate(&node.path));
        } else {
            into.root.wildcards.push(node);
        }
    }
    for (key, node) in bare {
        match into.root.bare.entry(key) {
            std::collections::hash_map::Entry::Occupied(_) => err(duplicate(&node.path)),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(node);
            }
        }
    }
}

/// Parses one file: its rules (with the line of `domain`) when it has a domain, and its errors
/// sorted by line.
fn parse_file(
    name: &str,
    text: &str,
    calendar_months: bool,
) -> (Option<(DomainRules, usize)>, Vec<ConfigError>) {
    let mut cx = Ctx {
        file: Arc::from(name),
        errors: Vec::new(),
        calendar_months,
        globals: Vec::new(),
    };
    let docs = match yaml::parse(text) {
        Ok(docs) => docs,
        Err(e) => {
            cx.err(e.line, "", e.message);
            return (None, cx.errors);
        }
    };
    // A stray `---` or a comment-only document parses as null; it carries no rules.
    let mut docs = docs.into_iter().filter(|d| !is_null(d));
    let Some(root) = docs.next() else {
        cx.errors.push(file_error(name, "empty config file"));
        return (None, cx.errors);
    };
    if let Some(extra) = docs.next() {
        // envoyproxy/ratelimit reads only the first document and silently drops the rest; a
        // dropped domain is worse than an error, so this is rejected.
        cx.err(
            extra.line,
            "",
            "more than one YAML document in one config file; put each domain in its own file",
        );
    }
    let parsed = cx.root(&root);
    cx.errors.sort_by_key(|e| e.line);
    (parsed, cx.errors)
}

/// [`parse_file`] for a tree that did not come from text.
fn parse_tree(
    name: &str,
    root: &Node,
    calendar_months: bool,
) -> (Option<(DomainRules, usize)>, Vec<ConfigError>) {
    let mut cx = Ctx {
        file: Arc::from(name),
        errors: Vec::new(),
        calendar_months,
        globals: Vec::new(),
    };
    let parsed = cx.root(root);
    (parsed, cx.errors)
}
