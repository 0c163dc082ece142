//! Loading rule files from disk (one file, or a directory of one-domain files) into a
//! [`RuleSet`](super::RuleSet), collecting every error instead of stopping at the first, so an
//! operator fixes a config in one round instead of one mistake per reload.
//! The accepted keys and the rules mirror envoyproxy/ratelimit's `src/config/config_impl.go`
//! (messages keep its wording where it has one), with a few stricter checks noted where they are.
//! The sluice extensions (DESIGN 3.2: `period`, `rate_limits`, `algorithm`, `burst`,
//! `applies_to_descendants`) are checked here as strictly; a config without them loads to exactly
//! the envoyproxy/ratelimit model (fixed window, unit periods).

use super::yaml::{self, Node, Resolved, Value};
use super::{
    Algorithm, DescriptorNode, DomainRules, Level, Limit, Location, Period, Quota, RateLimitRule,
    RuleSet, Unit, ValueMatch,
};
use std::collections::HashMap;
use std::fmt;
use std::fs;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

/// sliding_log stores every admitted hit; beyond this a single counter would hold megabytes.
pub const MAX_SLIDING_LOG_LIMIT: u32 = 100_000;

/// Options of the envoyproxy/ratelimit runtime loader.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// `RUNTIME_IGNOREDOTFILES`: skip files and directories whose name starts with `.`.
    pub ignore_dotfiles: bool,
    /// `MERGE_DOMAIN_CONFIG`: files (or xDS resources) with the same domain add their top-level
    /// descriptors to it, as envoyproxy/ratelimit merges them; a top-level descriptor defined
    /// twice is still an error. Off, a domain defined twice is an error.
    pub merge_domains: bool,
}

/// One problem in one config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: String,
    /// 1-based line, when the problem has a position.
    pub line: Option<usize>,
    /// YAML path of the offending node, e.g. `descriptors[0].rate_limit.unit`.
    pub path: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(l) => write!(f, "{}:{}", self.file, l)?,
            None => write!(f, "{}", self.file)?,
        }
        if !self.path.is_empty() {
            write!(f, ": {}", self.path)?;
        }
        write!(f, ": {}", self.message)
    }
}

/// Every error found while loading; never empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

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
    build(sources, errors, opts.merge_domains)
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
    build(sources, Vec::new(), false)
}

/// Loads configs that come as trees rather than text, `(name, root)`: the same rules and the
/// same errors as a file, named after the source and without lines.
pub(crate) fn load_trees(
    trees: Vec<(String, Node)>,
    merge_domains: bool,
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
    build(sources, Vec::new(), merge_domains)
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

fn file_error(file: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        file: file.to_owned(),
        line: None,
        path: String::new(),
        message: message.into(),
    }
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
) -> Result<RuleSet, ConfigErrors> {
    // domain -> (file, line, dotted) of its first definition
    let mut first: HashMap<String, (String, usize, bool)> = HashMap::new();
    let mut domains = HashMap::new();
    for src in &sources {
        let (parsed, mut file_errors) = match &src.body {
            Body::Text(text) => parse_file(&src.name, text),
            Body::Tree(root) => parse_tree(&src.name, root),
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
/// envoyproxy/ratelimit; so is a different `hash_tag`.
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
    if into.domain_tag != more.domain_tag {
        err(format!(
            "hash_tag differs from the other config of domain '{}' ({}): merged configs must agree",
            into.domain, into.file
        ));
        return;
    }
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
fn parse_file(name: &str, text: &str) -> (Option<(DomainRules, usize)>, Vec<ConfigError>) {
    let mut cx = Ctx {
        file: Arc::from(name),
        errors: Vec::new(),
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
fn parse_tree(name: &str, root: &Node) -> (Option<(DomainRules, usize)>, Vec<ConfigError>) {
    let mut cx = Ctx {
        file: Arc::from(name),
        errors: Vec::new(),
    };
    let parsed = cx.root(root);
    (parsed, cx.errors)
}

fn is_null(node: &Node) -> bool {
    matches!(&node.value, Value::Scalar(s) if s.resolve() == Resolved::Null)
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

/// Where a mapping sits, which decides the keys it accepts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scope {
    Root,
    Descriptor,
    /// The `rate_limit` block of a descriptor.
    RateLimit,
    /// One entry of a descriptor's `rate_limits` list (sluice extension).
    RateLimitsEntry,
    Replaces,
}

const ROOT_KEYS: &[&str] = &["domain", "descriptors", "hash_tag"];
const DESCRIPTOR_KEYS: &[&str] = &[
    "key",
    "value",
    "rate_limit",
    "rate_limits",
    "descriptors",
    "shadow_mode",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "quota_mode",
    "metadata",
];
/// The keys of one limit: envoyproxy/ratelimit's, then the sluice extensions (DESIGN 3.2).
const LIMIT_KEYS: &[&str] = &[
    "unit",
    "requests_per_unit",
    "unlimited",
    "name",
    "replaces",
    "period",
    "algorithm",
    "burst",
    "applies_to_descendants",
];
const REPLACES_KEYS: &[&str] = &["name"];

impl Scope {
    fn keys(self) -> &'static [&'static str] {
        match self {
            Scope::Root => ROOT_KEYS,
            Scope::Descriptor => DESCRIPTOR_KEYS,
            Scope::RateLimit | Scope::RateLimitsEntry => LIMIT_KEYS,
            Scope::Replaces => REPLACES_KEYS,
        }
    }

    fn is_limit(self) -> bool {
        matches!(self, Scope::RateLimit | Scope::RateLimitsEntry)
    }

    fn describe(self) -> &'static str {
        match self {
            Scope::Root => "at the top level",
            Scope::Descriptor => "in a descriptor",
            Scope::RateLimit => "in `rate_limit`",
            Scope::RateLimitsEntry => "in a `rate_limits` entry",
            Scope::Replaces => "in a `replaces` entry",
        }
    }
}

/// Why `key` is not accepted in `scope`, naming where it belongs when it belongs elsewhere.
fn unknown_key_message(key: &str, scope: Scope) -> String {
    let hint = if scope.is_limit() && matches!(key, "rate_limit" | "rate_limits") {
        format!(
            "`{key}` belongs to the descriptor; a limit cannot contain another (list several \
             limits in the descriptor's `rate_limits`)"
        )
    } else if scope != Scope::Descriptor && DESCRIPTOR_KEYS.contains(&key) {
        match scope {
            Scope::RateLimit => {
                format!("`{key}` belongs to the descriptor, next to `rate_limit`, not inside it")
            }
            Scope::RateLimitsEntry => format!(
                "`{key}` belongs to the descriptor, next to `rate_limits`, not inside one of its \
                 entries"
            ),
            _ => format!("`{key}` belongs in an entry of `descriptors`"),
        }
    } else if !scope.is_limit() && LIMIT_KEYS.contains(&key) {
        format!("`{key}` belongs inside `rate_limit` (or an entry of `rate_limits`)")
    } else if scope != Scope::Root && ROOT_KEYS.contains(&key) {
        format!("`{key}` is only valid at the top level of the file")
    } else {
        format!("accepted {}: {}", scope.describe(), scope.keys().join(", "))
    };
    format!(
        "config error, unknown key '{key}' {}; {hint}",
        scope.describe()
    )
}

/// One limit mapping as parsed, with what the descriptor-level checks need. When the mapping
/// had errors the rule holds placeholders; the descriptor is then discarded anyway.
struct ParsedLimit {
    rule: RateLimitRule,
    /// YAML path of the mapping, e.g. `descriptors[0].rate_limits[1]`.
    path: String,
    /// Line of `name`, when the limit has one.
    name_line: Option<usize>,
    /// Line of `applies_to_descendants: true`.
    descendants_line: Option<usize>,
}

/// Walks one file's tree, collecting errors.
struct Ctx {
    file: Arc<str>,
    errors: Vec<ConfigError>,
}

impl Ctx {
    fn err(&mut self, line: usize, path: &str, message: impl Into<String>) {
        self.errors.push(ConfigError {
            file: self.file.to_string(),
            // Line 0: a config without source text (pushed over xDS).
            line: (line > 0).then_some(line),
            path: path.to_owned(),
            message: message.into(),
        });
    }

    /// The accepted entries of a mapping as `(key, key node, value node)`; reports non-string,
    /// unknown and duplicate keys.
    fn entries<'a>(
        &mut self,
        entries: &'a [(Node, Node)],
        path: &str,
        scope: Scope,
    ) -> Vec<(&'a str, &'a Node, &'a Node)> {
        let mut out = Vec::with_capacity(entries.len());
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (k, v) in entries {
            let Value::Scalar(s) = &k.value else {
                self.err(k.line, path, "mapping keys must be plain strings");
                continue;
            };
            let key = s.text.as_str();
            if !scope.keys().contains(&key) {
                self.err(k.line, &join(path, key), unknown_key_message(key, scope));
                continue;
            }
            if let Some(first) = seen.insert(key, k.line) {
                // yaml.v2 silently keeps the last of duplicate keys, which can drop a whole
                // `descriptors` list unnoticed; sluice rejects it.
                self.err(
                    k.line,
                    &join(path, key),
                    format!("duplicate key '{key}' in one mapping (first at line {first})"),
                );
                continue;
            }
            out.push((key, k, v));
        }
        out
    }

    /// A string field. yaml.v2 turns any scalar into its source text (so `value: true` is
    /// "true" and null is ""), but its key validation rejects numbers with a fraction.
    fn string(&mut self, node: &Node, path: &str, name: &str) -> Option<String> {
        match &node.value {
            Value::Scalar(s) => match s.resolve() {
                Resolved::Null => Some(String::new()),
                Resolved::Float => {
                    self.err(
                        node.line,
                        path,
                        format!(
                            "`{name}` {} reads as a floating-point number in YAML 1.1, which \
                             envoyproxy/ratelimit rejects here; quote it to use it as text: \"{}\"",
                            s.text, s.text
                        ),
                    );
                    None
                }
                Resolved::Bool(_) | Resolved::Int(_) | Resolved::Str => Some(s.text.clone()),
            },
            _ => {
                self.err(
                    node.line,
                    path,
                    format!("`{name}` must be a string, not a {}", kind(node)),
                );
                None
            }
        }
    }

    /// A boolean flag; null is false, as yaml.v2 leaves the Go zero value.
    fn flag(&mut self, node: &Node, path: &str, name: &str) -> Option<bool> {
        if let Value::Scalar(s) = &node.value {
            match s.resolve() {
                Resolved::Null => return Some(false),
                Resolved::Bool(b) => return Some(b),
                _ => {}
            }
        }
        self.err(
            node.line,
            path,
            format!(
                "`{name}` must be a boolean (true or false), got {}",
                describe(node)
            ),
        );
        None
    }

    /// A list of mappings (or null, meaning empty).
    fn list<'a>(&mut self, node: &'a Node, path: &str, name: &str) -> Option<&'a [Node]> {
        match &node.value {
            Value::Seq(items) => Some(items),
            Value::Scalar(s) if s.resolve() == Resolved::Null => Some(&[]),
            _ => {
                self.err(
                    node.line,
                    path,
                    format!("`{name}` must be a list, not a {}", kind(node)),
                );
                None
            }
        }
    }

    /// The top-level mapping: the rules and the line of `domain` when the domain is usable.
    fn root(&mut self, root: &Node) -> Option<(DomainRules, usize)> {
        let Value::Map(entries) = &root.value else {
            self.err(
                root.line,
                "",
                format!(
                    "the top level must be a mapping with `domain` and `descriptors`, not a {}",
                    kind(root)
                ),
            );
            return None;
        };
        let mut domain: Option<(String, usize)> = None;
        let mut descriptors = None;
        let mut domain_seen = false;
        let mut domain_tag = false;
        for (key, _, value) in self.entries(entries, "", Scope::Root) {
            match key {
                "hash_tag" => {
                    domain_tag = match self.string(value, "hash_tag", "hash_tag").as_deref() {
                        Some("domain") => true,
                        Some("descriptor") | None => false,
                        Some(other) => {
                            self.err(
                                value.line,
                                "hash_tag",
                                format!(
                                    "hash_tag must be `descriptor` (the default: domain and the \
                                     descriptor's first entry) or `domain` (the whole domain in \
                                     one Redis Cluster slot), got {other:?}"
                                ),
                            );
                            false
                        }
                    }
                }
                "domain" => {
                    domain_seen = true;
                    domain = self
                        .string(value, "domain", "domain")
                        .map(|d| (d, value.line));
                }
                "descriptors" => descriptors = Some(value),
                _ => {}
            }
        }
        let domain = match domain {
            Some((d, line)) if !d.is_empty() => Some((d, line)),
            Some((_, line)) => {
                self.err(line, "domain", "config file cannot have empty domain");
                None
            }
            None => {
                if !domain_seen {
                    self.err(
                        root.line,
                        "domain",
                        "config file cannot have empty domain (`domain` is missing)",
                    );
                }
                None
            }
        };
        let prefix = domain
            .as_ref()
            .map(|(d, _)| format!("{d}."))
            .unwrap_or_default();
        let mut level = Level::default();
        if let Some(node) = descriptors {
            self.descriptors(node, "descriptors", &prefix, &mut level);
        }
        domain.map(|(domain, line)| {
            (
                DomainRules {
                    name: Arc::from(domain.as_str()),
                    domain,
                    file: self.file.clone(),
                    root: level,
                    domain_tag,
                },
                line,
            )
        })
    }

    /// One `descriptors` list into `level`; `prefix` is the stats path of the parent plus `.`.
    fn descriptors(&mut self, node: &Node, path: &str, prefix: &str, level: &mut Level) {
        let Some(items) = self.list(node, path, "descriptors") else {
            return;
        };
        // Composite key (`key` or `key_value`, envoyproxy's map key for a level) -> first line.
        let mut seen: HashMap<String, usize> = HashMap::new();
        for (i, item) in items.iter().enumerate() {
            let item_path = format!("{path}[{i}]");
            let Some(node) = self.descriptor(item, &item_path, prefix, &mut seen) else {
                continue;
            };
            match &node.value {
                ValueMatch::Exact(v) => {
                    level
                        .exact
                        .entry(node.key.clone())
                        .or_default()
                        .insert(v.clone(), node);
                }
                ValueMatch::Wildcard(_) => level.wildcards.push(node),
                ValueMatch::Any => {
                    level.bare.insert(node.key.clone(), node);
                }
            }
        }
    }

    fn descriptor(
        &mut self,
        item: &Node,
        path: &str,
        prefix: &str,
        seen: &mut HashMap<String, usize>,
    ) -> Option<DescriptorNode> {
        let Value::Map(entries) = &item.value else {
            self.err(
                item.line,
                path,
                format!(
                    "config error, each entry of `descriptors` must be a mapping with at least \
                     `key`, not a {}",
                    kind(item)
                ),
            );
            return None;
        };
        let errors_before = self.errors.len();
        let mut key: Option<(String, usize)> = None;
        let mut key_invalid = false;
        let mut value = String::new();
        // A malformed value is reported once; it must not also read as "no value" below.
        let mut value_bad = false;
        // (value node, path, line of the key) of `rate_limit` and of `rate_limits`
        let mut rate_limit = None;
        let mut rate_limits = None;
        let mut children = None;
        let mut shadow_mode = false;
        let mut quota_mode = false;
        let mut detailed_metric = false;
        let mut value_to_metric = false;
        let mut share_threshold: Option<usize> = None;
        let mut metadata = None;
        for (name, k, v) in self.entries(entries, path, Scope::Descriptor) {
            let p = join(path, name);
            match name {
                "key" => match self.string(v, &p, name) {
                    Some(k) => key = Some((k, v.line)),
                    None => key_invalid = true,
                },
                "value" => match self.string(v, &p, name) {
                    Some(s) => value = s,
                    None => value_bad = true,
                },
                "rate_limit" => rate_limit = Some((v, p, k.line)),
                "rate_limits" => rate_limits = Some((v, p, k.line)),
                "descriptors" => children = Some((v, p)),
                "shadow_mode" => shadow_mode = self.flag(v, &p, name).unwrap_or(false),
                "quota_mode" => quota_mode = self.flag(v, &p, name).unwrap_or(false),
                "detailed_metric" => detailed_metric = self.flag(v, &p, name).unwrap_or(false),
                "value_to_metric" => value_to_metric = self.flag(v, &p, name).unwrap_or(false),
                "share_threshold" => {
                    share_threshold = (self.flag(v, &p, name) == Some(true)).then_some(v.line);
                }
                // Free-form, returned to Envoy with RESPONSE_DYNAMIC_METADATA.
                "metadata" => match super::metadata::to_struct(v) {
                    Ok(m) => metadata = Some(Arc::new(m)),
                    Err(e) => self.err(v.line, &p, e),
                },
                _ => {}
            }
        }

        let key = match key {
            Some((k, line)) if k.is_empty() => {
                self.err(line, &join(path, "key"), "descriptor has empty key");
                None
            }
            Some((k, line)) => Some((k, line)),
            None => {
                if !key_invalid {
                    self.err(
                        item.line,
                        path,
                        "descriptor has empty key (`key` is missing)",
                    );
                }
                None
            }
        };
        let matcher = if value.is_empty() {
            ValueMatch::Any
        } else if value.contains('*') {
            ValueMatch::Wildcard(value.clone())
        } else {
            ValueMatch::Exact(value.clone())
        };
        if let (Some((k, line)), false) = (&key, value_bad) {
            if matcher == ValueMatch::Any && k.ends_with('*') {
                // envoyproxy/ratelimit turns a bare key ending in `*` into a prefix match on
                // "key_value" strings, i.e. on keys; sluice only supports wildcards in values.
                self.err(
                    *line,
                    &join(path, "key"),
                    format!(
                        "a bare key ending in '*' ('{k}') is a key wildcard, which sluice does not \
                         support; put the wildcard in `value`"
                    ),
                );
            }
        }
        if let (Some(line), false) = (share_threshold, value_bad) {
            if !matches!(matcher, ValueMatch::Wildcard(_)) {
                self.err(
                    line,
                    &join(path, "share_threshold"),
                    format!(
                        "share_threshold can only be used with wildcard values (containing '*'), \
                         but found {}",
                        if value.is_empty() {
                            "no value".to_owned()
                        } else {
                            format!("value '{value}'")
                        }
                    ),
                );
            }
        }

        let composite = key.as_ref().filter(|_| !value_bad).map(|(k, _)| {
            if value.is_empty() {
                k.clone()
            } else {
                format!("{k}_{value}")
            }
        });
        let stats_path = format!("{prefix}{}", composite.as_deref().unwrap_or(""));
        if let Some(c) = &composite {
            if let Some(first) = seen.get(c) {
                self.err(
                    item.line,
                    path,
                    format!(
                        "duplicate descriptor composite key '{stats_path}' (first at line {first})"
                    ),
                );
            } else {
                seen.insert(c.clone(), item.line);
            }
        }

        let mut limits = Vec::new();
        if let (Some((_, _, one_line)), Some((_, _, list_line))) = (&rate_limit, &rate_limits) {
            // Reported on whichever comes second; both are still checked below.
            let (line, key, other, other_line) = if one_line < list_line {
                (*list_line, "rate_limits", "rate_limit", *one_line)
            } else {
                (*one_line, "rate_limit", "rate_limits", *list_line)
            };
            self.err(
                line,
                &join(path, key),
                format!(
                    "`rate_limit` and `rate_limits` cannot both be given on one descriptor \
                     (`{other}` is at line {other_line}); put every limit in `rate_limits`"
                ),
            );
        }
        if let Some((node, p, _)) = rate_limit {
            limits.extend(self.limit(node, &p, Scope::RateLimit));
        }
        if let Some((node, p, _)) = rate_limits {
            limits.extend(self.rate_limits(node, &p));
        }
        let has_children = children
            .as_ref()
            .is_some_and(|(node, _)| matches!(&node.value, Value::Seq(items) if !items.is_empty()));
        self.check_node_limits(&limits, has_children);
        let rules: Vec<RateLimitRule> = limits
            .into_iter()
            .map(|l| RateLimitRule {
                shadow_mode,
                quota_mode,
                ..l.rule
            })
            .collect();
        let mut level = Level::default();
        if let Some((node, p)) = children {
            // Children are checked even when this descriptor is broken, so all errors show.
            self.descriptors(node, &p, &format!("{stats_path}."), &mut level);
        }

        let (key, _) = key?;
        // Any error in this descriptor or below it means the whole load fails; the node is
        // only built for a clean subtree.
        if self.errors.len() > errors_before {
            return None;
        }
        Some(DescriptorNode {
            key,
            value: matcher,
            rate_limits: rules,
            share_threshold: share_threshold.is_some(),
            detailed_metric,
            value_to_metric,
            children: level,
            location: Location {
                file: self.file.clone(),
                line: item.line,
            },
            path: stats_path,
            metadata,
        })
    }

    /// The checks across the limits of one descriptor: unique names, and resource limits
    /// (`applies_to_descendants`) only where something can match below.
    fn check_node_limits(&mut self, limits: &[ParsedLimit], has_children: bool) {
        let mut names: HashMap<&str, usize> = HashMap::new();
        for l in limits {
            if let (Some(name), Some(line)) = (l.rule.name.as_deref(), l.name_line) {
                if let Some(first) = names.get(name) {
                    self.err(
                        line,
                        &join(&l.path, "name"),
                        format!(
                            "duplicate limit name '{name}' on one descriptor (first at line \
                             {first}); the limits of a descriptor need distinct names"
                        ),
                    );
                } else {
                    names.insert(name, line);
                }
            }
            if let (Some(line), false) = (l.descendants_line, has_children) {
                self.err(
                    line,
                    &join(&l.path, "applies_to_descendants"),
                    "`applies_to_descendants: true` on a descriptor without child `descriptors`: \
                     no request can ever match below this node, so the flag could never act; add \
                     child descriptors or remove the flag",
                );
            }
        }
    }

    /// A `rate_limits` list (sluice extension): one limit per entry, at least one.
    fn rate_limits(&mut self, node: &Node, path: &str) -> Vec<ParsedLimit> {
        let items = match &node.value {
            Value::Seq(items) if !items.is_empty() => items,
            Value::Seq(_) => {
                self.err(
                    node.line,
                    path,
                    "`rate_limits` is empty; list at least one limit, or remove the key for a \
                     descriptor without limits",
                );
                return Vec::new();
            }
            Value::Scalar(s) if s.resolve() == Resolved::Null => {
                self.err(
                    node.line,
                    path,
                    "`rate_limits` has no entries; list at least one limit, or remove the key for \
                     a descriptor without limits",
                );
                return Vec::new();
            }
            _ => {
                self.err(
                    node.line,
                    path,
                    format!(
                        "`rate_limits` must be a list of limits (a mapping per limit), not a {}",
                        kind(node)
                    ),
                );
                return Vec::new();
            }
        };
        items
            .iter()
            .enumerate()
            .filter_map(|(i, item)| {
                self.limit(item, &format!("{path}[{i}]"), Scope::RateLimitsEntry)
            })
            .collect()
    }

    /// One limit: a `rate_limit` block or a `rate_limits` entry. `None` when it is not a mapping
    /// (reported) or a null `rate_limit` (no limit, as envoyproxy/ratelimit treats it).
    /// `shadow_mode`/`quota_mode` are descriptor-level and filled in by the caller.
    fn limit(&mut self, node: &Node, path: &str, scope: Scope) -> Option<ParsedLimit> {
        let entries = match &node.value {
            Value::Map(entries) => entries,
            Value::Scalar(s) if scope == Scope::RateLimit && s.resolve() == Resolved::Null => {
                return None
            }
            _ => {
                let message = if scope == Scope::RateLimit {
                    format!("`rate_limit` must be a mapping, not a {}", kind(node))
                } else {
                    format!(
                        "each `rate_limits` entry must be a mapping like {{requests_per_unit: 10, \
                         unit: second}}, not a {}",
                        kind(node)
                    )
                };
                self.err(node.line, path, message);
                return None;
            }
        };
        let errors_before = self.errors.len();
        let mut unit: Option<(String, usize)> = None;
        let mut requests_per_unit: Option<u32> = None;
        let mut unlimited = false;
        let mut name = String::new();
        let mut name_line = None;
        let mut replaces = Vec::new();
        // Extensions: the line of the key's value when the key is given, and its text or value
        // when well-formed (a malformed one is reported once and not judged again).
        let mut period: (Option<usize>, Option<String>) = (None, None);
        let mut algorithm: (Option<usize>, Option<String>) = (None, None);
        let mut burst: (Option<usize>, Option<u32>) = (None, None);
        let mut descendants_line = None;
        // A unit or unlimited flag that is already reported as malformed is not judged again.
        let mut unit_bad = false;
        let mut unlimited_bad = false;
        for (key, _, v) in self.entries(entries, path, scope) {
            let p = join(path, key);
            match key {
                "unit" => match self.string(v, &p, key) {
                    Some(u) => unit = Some((u, v.line)),
                    None => unit_bad = true,
                },
                "requests_per_unit" => requests_per_unit = self.requests_per_unit(v, &p),
                "unlimited" => match self.flag(v, &p, key) {
                    Some(u) => unlimited = u,
                    None => unlimited_bad = true,
                },
                "name" => {
                    name = self.string(v, &p, key).unwrap_or_default();
                    name_line = Some(v.line);
                }
                "replaces" => replaces = self.replaces(v, &p),
                "period" => {
                    period = (
                        Some(v.line),
                        self.text(
                            v,
                            &p,
                            key,
                            "a duration such as 500ms, 10s, 5m, 1h, 2d or 1w",
                        ),
                    );
                }
                "algorithm" => {
                    algorithm = (
                        Some(v.line),
                        self.text(v, &p, key, &format!("one of {}", algorithm_names())),
                    );
                }
                "burst" => burst = (Some(v.line), self.burst(v, &p)),
                "applies_to_descendants" => {
                    descendants_line = (self.flag(v, &p, key) == Some(true)).then_some(v.line);
                }
                _ => {}
            }
        }

        let unit_written = unit.as_ref().is_some_and(|(u, _)| !u.is_empty());
        let quota = if unlimited_bad {
            Quota::Unlimited
        } else if unlimited {
            // An unlimited limit is never counted: everything that shapes a count contradicts it.
            if let (true, Some((_, line))) = (unit_written, &unit) {
                // envoyproxy/ratelimit only rejects a *valid* unit here; any unit next to
                // `unlimited: true` is a contradiction, so sluice rejects them all.
                self.err(
                    *line,
                    &join(path, "unit"),
                    "should not specify rate limit unit when unlimited",
                );
            }
            for (key, line) in [
                ("period", period.0),
                ("algorithm", algorithm.0),
                ("burst", burst.0),
            ] {
                if let Some(line) = line {
                    self.err(
                        line,
                        &join(path, key),
                        format!("should not specify rate limit {key} when unlimited"),
                    );
                }
            }
            Quota::Unlimited
        } else {
            let from_unit = match (&unit, unit_bad) {
                (Some((u, line)), false) if !u.is_empty() => match Unit::parse(u) {
                    Some(u) => Some(Period::from_unit(u)),
                    None => {
                        self.err(
                            *line,
                            &join(path, "unit"),
                            format!(
                                "invalid rate limit unit '{u}'; expected one of {} (any case)",
                                unit_names()
                            ),
                        );
                        None
                    }
                },
                _ => None,
            };
            let from_period = match period {
                (Some(line), Some(text)) => match parse_period(&text) {
                    Ok(p) => Some(p),
                    Err(message) => {
                        self.err(line, &join(path, "period"), message);
                        None
                    }
                },
                _ => None,
            };
            match (unit_written || unit_bad, period.0) {
                (true, Some(line)) => {
                    let unit_line = unit.as_ref().map_or(node.line, |(_, l)| *l);
                    self.err(
                        line,
                        &join(path, "period"),
                        format!(
                            "`period` and `unit` cannot both be given (`unit` is at line \
                             {unit_line}); keep one of them"
                        ),
                    );
                }
                (false, None) => {
                    let line = unit.as_ref().map_or(node.line, |(_, l)| *l);
                    self.err(
                        line,
                        &join(path, "unit"),
                        format!(
                            "invalid rate limit unit '': `unit` is required unless \
                             `unlimited: true` (one of {}), or give a `period` instead (a \
                             duration such as 500ms, 10s, 5m, 1h, 2d or 1w)",
                            unit_names()
                        ),
                    );
                }
                _ => {}
            }
            let algorithm_given = algorithm.0.is_some();
            let algorithm = match algorithm {
                (Some(line), Some(text)) => match Algorithm::parse(&text) {
                    Some(a) => Some(a),
                    None => {
                        let case = if Algorithm::parse(&text.to_ascii_lowercase()).is_some() {
                            " (names are lower-case)"
                        } else {
                            ""
                        };
                        self.err(
                            line,
                            &join(path, "algorithm"),
                            format!(
                                "invalid algorithm '{text}'; expected one of {}{case}",
                                algorithm_names()
                            ),
                        );
                        None
                    }
                },
                (Some(_), None) => None,
                (None, _) => Some(Algorithm::FixedWindow),
            };
            let rpu = requests_per_unit.unwrap_or(0);
            if algorithm == Some(Algorithm::SlidingLog) && rpu > MAX_SLIDING_LOG_LIMIT {
                self.err(
                    node.line,
                    &join(path, "requests_per_unit"),
                    format!(
                        "sliding_log keeps one entry per admitted request (about 50 bytes each in                          Redis), so its requests_per_unit is capped at {MAX_SLIDING_LOG_LIMIT};                          got {rpu}. Use sliding_window for large limits"
                    ),
                );
            }
            let burst = match (burst, algorithm) {
                // A bad algorithm is already reported; a burst next to it is not judged.
                (_, None) => 0,
                ((None, _), Some(Algorithm::TokenBucket)) => rpu.saturating_sub(1),
                ((Some(_), b), Some(Algorithm::TokenBucket)) => b.unwrap_or(0),
                ((Some(line), _), Some(other)) => {
                    let default = if algorithm_given {
                        ""
                    } else {
                        " (the default)"
                    };
                    self.err(
                        line,
                        &join(path, "burst"),
                        format!(
                            "`burst` only applies to `algorithm: token_bucket`; this limit uses \
                             {}{default}",
                            other.name()
                        ),
                    );
                    0
                }
                ((None, _), Some(_)) => 0,
            };
            if requests_per_unit.is_none() && self.errors.len() == errors_before {
                // The reference's Go zero value: a limit without requests_per_unit admits
                // nothing. Valid, but rarely meant, so say so.
                tracing::warn!(
                    file = %self.file,
                    line = node.line,
                    path,
                    "rate limit has no requests_per_unit; it defaults to 0 and blocks every request"
                );
            }
            let period = from_unit
                .or(from_period)
                .unwrap_or(Period::from_unit(Unit::Second));
            if algorithm == Some(Algorithm::TokenBucket) && rpu > 0 {
                // The TAT carries the emission interval's remainder in 1/rpu µs; products of it
                // must stay exact in the Lua script's doubles.
                let rem = period.millis().saturating_mul(1000) % u64::from(rpu);
                if (u64::from(burst) + 1).saturating_mul(rem) >= 1 << 53 {
                    self.err(
                        node.line,
                        path,
                        format!(
                            "token_bucket with requests_per_unit {rpu} and burst {burst} over \
                             {period} cannot be decided exactly: (burst + 1) x (period in µs mod \
                             requests_per_unit) must stay below 2^53. Lower the burst or pick a \
                             period that is a multiple of requests_per_unit µs"
                        ),
                    );
                }
            }
            Quota::Limited(Limit {
                requests_per_unit: rpu,
                period,
                algorithm: algorithm.unwrap_or_default(),
                burst,
            })
        };

        if !name.is_empty() {
            for (replaced, line) in &replaces {
                if *replaced == name {
                    self.err(
                        *line,
                        &join(path, "replaces"),
                        format!("replaces should not contain name of same descriptor ('{name}')"),
                    );
                }
            }
        }
        Some(ParsedLimit {
            path: path.to_owned(),
            name_line: name_line.filter(|_| !name.is_empty()),
            rule: RateLimitRule {
                name: (!name.is_empty()).then_some(name),
                quota,
                replaces: replaces.into_iter().map(|(n, _)| n).collect(),
                shadow_mode: false,
                quota_mode: false,
                applies_to_descendants: descendants_line.is_some(),
            },
            descendants_line,
        })
    }

    /// The text of a scalar extension value (`period`, `algorithm`), whatever YAML type it reads
    /// as; `expected` describes a valid value for the error.
    fn text(&mut self, node: &Node, path: &str, name: &str, expected: &str) -> Option<String> {
        match &node.value {
            Value::Scalar(s) if s.resolve() != Resolved::Null => Some(s.text.clone()),
            Value::Scalar(_) => {
                self.err(
                    node.line,
                    path,
                    format!("`{name}` is empty; expected {expected}"),
                );
                None
            }
            _ => {
                self.err(
                    node.line,
                    path,
                    format!("`{name}` must be {expected}, not a {}", kind(node)),
                );
                None
            }
        }
    }

    /// `burst`: a whole number from 0 to u32::MAX.
    fn burst(&mut self, node: &Node, path: &str) -> Option<u32> {
        if let Value::Scalar(s) = &node.value {
            if let Resolved::Int(n) = s.resolve() {
                if let Ok(n) = u32::try_from(n) {
                    return Some(n);
                }
            }
        }
        self.err(
            node.line,
            path,
            format!(
                "`burst` must be an integer from 0 to {}, got {}",
                u32::MAX,
                describe(node)
            ),
        );
        None
    }

    fn requests_per_unit(&mut self, node: &Node, path: &str) -> Option<u32> {
        if let Value::Scalar(s) = &node.value {
            match s.resolve() {
                Resolved::Null => return Some(0),
                Resolved::Int(n) => {
                    if let Ok(n) = u32::try_from(n) {
                        return Some(n);
                    }
                }
                _ => {}
            }
        }
        self.err(
            node.line,
            path,
            format!(
                "requests_per_unit must be an integer from 0 to {}, got {}",
                u32::MAX,
                describe(node)
            ),
        );
        None
    }

    /// `replaces: [{name: a}, {name: b}]` into names, each with its line.
    fn replaces(&mut self, node: &Node, path: &str) -> Vec<(String, usize)> {
        let mut names = Vec::new();
        let Some(items) = self.list(node, path, "replaces") else {
            return names;
        };
        for (i, item) in items.iter().enumerate() {
            let p = format!("{path}[{i}]");
            let Value::Map(entries) = &item.value else {
                self.err(
                    item.line,
                    &p,
                    format!(
                        "each `replaces` entry must be a mapping like {{name: other_limit}}, not a {}",
                        kind(item)
                    ),
                );
                continue;
            };
            let mut name = None;
            for (key, _, v) in self.entries(entries, &p, Scope::Replaces) {
                if key == "name" {
                    name = Some(self.string(v, &join(&p, key), key));
                }
            }
            match name {
                Some(Some(n)) if !n.is_empty() => names.push((n, item.line)),
                // Already reported as a bad string.
                Some(None) => {}
                _ => self.err(
                    item.line,
                    &join(&p, "name"),
                    "should not have an empty replaces entry (each entry needs a `name`)",
                ),
            }
        }
        names
    }
}

fn unit_names() -> String {
    Unit::ALL.map(Unit::name).join(", ")
}

fn algorithm_names() -> String {
    Algorithm::ALL.map(Algorithm::name).join(", ")
}

/// A `period` value through [`Period::parse`], with a clearer message for a fraction (`1.5s`),
/// which the duration syntax does not have.
fn parse_period(text: &str) -> Result<Period, String> {
    let t = text.trim();
    let number_end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    if t[..number_end].contains('.') {
        return Err(format!(
            "period '{t}' must be a whole number and a suffix (ms, s, m, h, d or w); write a \
             fraction with a smaller suffix, e.g. 1500ms for 1.5s"
        ));
    }
    Period::parse(t)
}

fn kind(node: &Node) -> &'static str {
    match &node.value {
        Value::Scalar(_) => "scalar",
        Value::Seq(_) => "list",
        Value::Map(_) => "mapping",
    }
}

/// A node for an error message: a scalar's text, or its kind.
fn describe(node: &Node) -> String {
    match &node.value {
        Value::Scalar(s) => format!("'{}'", s.text),
        _ => format!("a {}", kind(node)),
    }
}
