//! `sluice check PATH`: validate a config without serving it.

use super::*;

/// `sluice check PATH`.
#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    /// Config file or directory to validate.
    pub path: PathBuf,

    /// Skip files and directories whose name starts with `.`.
    #[arg(
        long,
        env = "RUNTIME_IGNOREDOTFILES",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub ignore_dotfiles: bool,

    /// Merge files with the same domain (as the service does with MERGE_DOMAIN_CONFIG=true).
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
}
