//! What a failed load reports: every problem with its file, line and YAML path, all at once.

use std::fmt;

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

pub(super) fn file_error(file: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        file: file.to_owned(),
        line: None,
        path: String::new(),
        message: message.into(),
    }
}
