//! `sluice replay`: a decision log against one config, or two side by side.

use super::{DecideFlags, LoadFlags};
use clap::{ArgGroup, Args};
use std::path::PathBuf;

#[derive(Debug, Clone, Args)]
#[command(group(ArgGroup::new("configs").required(true).args(["config", "compare"])))]
pub struct ReplayArgs {
    /// A decision log (DECISION_LOG); repeat it for the rotated files (`path.1`, ...).
    #[arg(long = "log", value_name = "FILE", required = true)]
    pub logs: Vec<PathBuf>,

    /// The config (file or directory) to replay the log against.
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,

    /// Two configs side by side.
    #[arg(long, num_args = 2, value_names = ["A", "B"])]
    pub compare: Vec<PathBuf>,

    /// The report as JSON on stdout (for scripts), instead of the table.
    #[arg(long)]
    pub json: bool,

    /// Draw admitted and denied over time, and who would be stopped, into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,

    /// Consumers listed per limit.
    #[arg(long, default_value_t = 10)]
    pub top: usize,

    #[command(flatten)]
    pub load: LoadFlags,

    /// `SHADOW_MODE`, `QUOTA_MODE`, `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT` and
    /// `ALLOW_LIMIT_OVERRIDE`, as the service that wrote the log ran with: a replay in its
    /// environment decides as it did.
    #[command(flatten)]
    pub decide: DecideFlags,
}

impl ReplayArgs {
    /// The configs to replay, in order.
    pub fn configs(&self) -> Vec<PathBuf> {
        match &self.config {
            Some(c) => vec![c.clone()],
            None => self.compare.clone(),
        }
    }
}
