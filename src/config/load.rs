//! Loading rule files from disk (one file, or a directory of one-domain files) into a
//! [`RuleSet`](super::RuleSet), collecting every error instead of stopping at the first.
//! STUB: being written.

use super::RuleSet;
use std::fmt;
use std::path::Path;

/// Options of the envoyproxy/ratelimit runtime loader.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// `RUNTIME_IGNOREDOTFILES`: skip files and directories whose name starts with `.`.
    pub ignore_dotfiles: bool,
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
pub fn load_path(_path: &Path, _opts: &LoadOptions) -> Result<RuleSet, ConfigErrors> {
    Ok(RuleSet::empty())
}

/// Loads in-memory sources `(file name, YAML text)`: the same rules as files on disk.
pub fn load_sources(_sources: &[(String, String)]) -> Result<RuleSet, ConfigErrors> {
    Ok(RuleSet::empty())
}
