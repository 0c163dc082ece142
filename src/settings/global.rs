//! The home store of global limits (`GLOBAL_REDIS_*`) and this replica's region (`REGION`).
//! The home store takes the main store's forms (`host:port`, URLs, a Cluster's seeds, a
//! Sentinel's `master_name,host:port,...`) and shares its timeouts, pool size, TLS settings
//! and key prefix: only where it is and who may use it differ.

use super::{RedisArgs, Secret, SettingsError};
use crate::store::global::Share;
use crate::store::redis::{RedisKind, RedisSettings};
use clap::{Args, ValueEnum};

/// What a region cut off from the home store does once its pool is spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Unreachable {
    /// Deny: never over the limit.
    Deny,
    /// Admit `GLOBAL_UNREACHABLE_SHARE` of each limit per window on credit, charged home once
    /// it answers: at most the limit plus the shares of the regions cut off.
    Share,
}

/// Global limits' home store. Without `GLOBAL_REDIS_URL`, a `global` limit is a load error.
#[derive(Debug, Clone, Args)]
pub struct GlobalArgs {
    /// The home store of `global` limits, which every region reaches: the same forms as
    /// REDIS_URL. Each region keeps a pool of a global limit in its own store (REDIS_URL),
    /// refilled from here.
    #[arg(long, env = "GLOBAL_REDIS_URL", hide_env_values = true)]
    pub global_redis_url: Option<Secret>,

    /// `single`, `cluster` or `sentinel`, as REDIS_TYPE, for GLOBAL_REDIS_URL.
    #[arg(
        long,
        env = "GLOBAL_REDIS_TYPE",
        default_value = "single",
        value_enum,
        ignore_case = true
    )]
    pub global_redis_type: RedisKind,

    /// The home store's password, or `user:password`, as REDIS_AUTH.
    #[arg(long, env = "GLOBAL_REDIS_AUTH", hide_env_values = true)]
    pub global_redis_auth: Option<Secret>,

    /// Bound on a round trip to the home store (a refill), connecting included: it is far
    /// away (tens to hundreds of ms), so REDIS_TIMEOUT's default would cut every refill. No
    /// request waits on it while its region's pool has units.
    #[arg(
        long,
        env = "GLOBAL_REDIS_TIMEOUT",
        default_value = "1s",
        value_parser = super::parse_duration
    )]
    pub global_redis_timeout: std::time::Duration,

    /// This replica's region (its logs and metrics name it). Replicas of one region share
    /// its store (REDIS_URL) and so its pools.
    #[arg(long, env = "REGION", default_value = "")]
    pub region: String,

    /// What a region cut off from the home store does once its pool and slices are spent:
    /// `deny` (never over the limit) or `share` (admit GLOBAL_UNREACHABLE_SHARE of each global
    /// limit per window on credit, charged home when it answers again).
    #[arg(
        long,
        env = "GLOBAL_UNREACHABLE",
        default_value = "deny",
        value_enum,
        ignore_case = true
    )]
    pub global_unreachable: Unreachable,

    /// With GLOBAL_UNREACHABLE=share: the part of each global limit a region cut off may admit
    /// per window beyond what its pool held (above 0, at most 1; 0.33 for one of three
    /// regions). Admitted in a window: at most the limit plus the shares of the regions cut off.
    #[arg(long, env = "GLOBAL_UNREACHABLE_SHARE")]
    pub global_unreachable_share: Option<Share>,
}

impl GlobalArgs {
    /// Whether a home store is set.
    pub fn is_set(&self) -> bool {
        self.global_redis_url
            .as_ref()
            .is_some_and(|u| !u.expose().trim().is_empty())
    }

    /// The part of each global limit a region cut off admits on credit (`share`), or `None`
    /// (`deny`). A share without `share`, or `share` without a share, is an error: either
    /// would leave the operator believing in a partition behaviour they do not get.
    pub fn share(&self) -> Result<Option<Share>, SettingsError> {
        match (self.global_unreachable, self.global_unreachable_share) {
            (Unreachable::Deny, None) => Ok(None),
            (Unreachable::Share, Some(s)) => Ok(Some(s)),
            (Unreachable::Share, None) => Err(SettingsError::Redis(
                "GLOBAL_UNREACHABLE=share needs GLOBAL_UNREACHABLE_SHARE: the part of each \
                 global limit a region cut off from home may admit per window (0.33 for one of \
                 three regions)"
                    .into(),
            )),
            (Unreachable::Deny, Some(_)) => Err(SettingsError::Redis(
                "GLOBAL_UNREACHABLE_SHARE is set but GLOBAL_UNREACHABLE is deny: set \
                 GLOBAL_UNREACHABLE=share for regions cut off to admit their share, or unset \
                 GLOBAL_UNREACHABLE_SHARE"
                    .into(),
            )),
        }
    }

    /// `REGION`, required with a home store: the regions' reports at home are keyed by it, so
    /// two regions left unnamed (or named alike) would read as one, each overwriting the
    /// other's report and the fair shares sized on them. At most 63 letters, digits, `.`, `_`
    /// or `-` (it names a metric label and a log field too).
    pub fn region(&self) -> Result<&str, SettingsError> {
        let r = self.region.as_str();
        if r.is_empty() {
            return Err(SettingsError::Redis(
                "GLOBAL_REDIS_URL is set but REGION is empty: name this region (each region \
                 its own name, every replica of a region the same; e.g. REGION=eu-west)"
                    .into(),
            ));
        }
        let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
        if r.len() > 63 || !r.chars().all(ok) {
            return Err(SettingsError::Redis(format!(
                "REGION {r:?}: at most 63 letters, digits, '.', '_' or '-'"
            )));
        }
        Ok(r)
    }

    /// The home store's settings (the main store's, at GLOBAL_REDIS_URL), or `None`.
    pub fn settings(&self, main: &RedisArgs) -> Result<Option<RedisSettings>, SettingsError> {
        if !self.is_set() {
            return Ok(None);
        }
        self.region()?;
        let args = RedisArgs {
            redis_url: self.global_redis_url.clone(),
            redis_type: self.global_redis_type,
            redis_auth: self.global_redis_auth.clone(),
            redis_sentinel_auth: None,
            redis_timeout: self.global_redis_timeout,
            ..main.clone()
        };
        args.settings().map_err(|e| match e {
            SettingsError::Redis(m) => SettingsError::Redis(format!(
                "GLOBAL_REDIS_URL (the home store; read REDIS_* below as GLOBAL_REDIS_*): {m}"
            )),
            other => other,
        })
    }
}
