//! The Rate Limit Quota Service's bounds: how many streams, buckets per stream and buckets in
//! all one process tracks (each bucket costs about a kilobyte with its debug view), when an
//! idle bucket is abandoned, and whether `/debug/rlqs` may show bucket values (often API keys).

use crate::quota::QuotaSettings;
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct RlqsArgs {
    /// Open RLQS streams at most (one per Envoy and domain); one more is refused with
    /// RESOURCE_EXHAUSTED.
    #[arg(long, env = "RLQS_MAX_STREAMS", default_value_t = QuotaSettings::default().max_streams as u32,
        value_parser = clap::value_parser!(u32).range(1..))]
    pub rlqs_max_streams: u32,

    /// Open RLQS streams from one peer (IP address) at most, so no one client holds the whole
    /// of `RLQS_MAX_STREAMS`; one more is refused with RESOURCE_EXHAUSTED.
    #[arg(long, env = "RLQS_MAX_STREAMS_PER_PEER",
        default_value_t = QuotaSettings::default().max_streams_per_peer as u32,
        value_parser = clap::value_parser!(u32).range(1..))]
    pub rlqs_max_streams_per_peer: u32,

    /// Buckets one stream may hold; past it, a new bucket that names a limit is denied until
    /// its next report (untracked) and `sluice_rlqs_refused_total{reason="over_bucket_cap"}`
    /// counts it; a bucket no limit names is never tracked.
    #[arg(long, env = "RLQS_MAX_BUCKETS_PER_STREAM",
        default_value_t = QuotaSettings::default().max_buckets_per_stream as u32,
        value_parser = clap::value_parser!(u32).range(1..))]
    pub rlqs_max_buckets_per_stream: u32,

    /// Buckets all streams together may hold; past it the same, counted as
    /// `over_total_bucket_cap`.
    #[arg(long, env = "RLQS_MAX_BUCKETS", default_value_t = QuotaSettings::default().max_buckets as u32,
        value_parser = clap::value_parser!(u32).range(1..))]
    pub rlqs_max_buckets: u32,

    /// Consecutive reports (5 s each) without usage after which a bucket is abandoned.
    #[arg(long, env = "RLQS_IDLE_REPORTS", default_value_t = QuotaSettings::default().idle_reports,
        value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub rlqs_idle_reports: u32,

    /// A bucket not reported for this long is abandoned (`5m`; longer than any Envoy's
    /// `reporting_interval`), counted as `reason="bucket_timeout"`.
    #[arg(long, env = "RLQS_BUCKET_TIMEOUT", default_value = "5m",
        value_parser = crate::settings::parse_duration)]
    pub rlqs_bucket_timeout: std::time::Duration,

    /// A stream that sends no first usage report within this is ended with DEADLINE_EXCEEDED.
    #[arg(long, env = "RLQS_FIRST_REPORT_TIMEOUT", default_value = "30s",
        value_parser = crate::settings::parse_duration)]
    pub rlqs_first_report_timeout: std::time::Duration,

    /// A stream that holds no limited bucket for this long (after its first report) is ended
    /// with DEADLINE_EXCEEDED: it would hold a place under `RLQS_MAX_STREAMS` for nothing.
    #[arg(long, env = "RLQS_IDLE_STREAM_TIMEOUT", default_value = "1m",
        value_parser = crate::settings::parse_duration)]
    pub rlqs_idle_stream_timeout: std::time::Duration,

    /// The largest usage report taken, in bytes; a larger one ends its stream with
    /// OUT_OF_RANGE, unread. An Envoy reports about 80 bytes per bucket it holds.
    #[arg(long, env = "RLQS_MAX_REPORT_BYTES",
        default_value_t = QuotaSettings::default().max_report_bytes as u32,
        value_parser = clap::value_parser!(u32).range(1024..=(64 << 20)))]
    pub rlqs_max_report_bytes: u32,

    /// Bucket usages one report may carry, counted on the wire before it is decoded; one more
    /// ends the stream with INVALID_ARGUMENT.
    #[arg(long, env = "RLQS_MAX_USAGES_PER_REPORT",
        default_value_t = QuotaSettings::default().max_usages_per_report as u32,
        value_parser = clap::value_parser!(u32).range(1..))]
    pub rlqs_max_usages_per_report: u32,

    /// A stream's reports are taken at most this often; one sent sooner waits (merged with any
    /// others meanwhile: usage adds up) until the interval has passed since the last one taken.
    #[arg(long, env = "RLQS_MIN_REPORT_INTERVAL", default_value = "1s",
        value_parser = crate::settings::parse_duration)]
    pub rlqs_min_report_interval: std::time::Duration,

    /// Store calls all RLQS streams together make at once; more wait their turn, so a flood of
    /// reports never crowds the store RLS requests need.
    #[arg(long, env = "RLQS_MAX_STORE_CALLS",
        default_value_t = QuotaSettings::default().max_store_calls as u32,
        value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub rlqs_max_store_calls: u32,

    /// Show bucket values on `/debug/rlqs` (by default each value is shown as its length only).
    #[arg(
        long,
        env = "RLQS_DEBUG_SHOW_VALUES",
        default_value = "false",
        value_parser = super::parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub rlqs_debug_show_values: bool,
}

impl RlqsArgs {
    pub fn settings(&self) -> QuotaSettings {
        QuotaSettings {
            max_streams: self.rlqs_max_streams as usize,
            max_streams_per_peer: self.rlqs_max_streams_per_peer as usize,
            max_buckets_per_stream: self.rlqs_max_buckets_per_stream as usize,
            max_buckets: self.rlqs_max_buckets as usize,
            idle_reports: self.rlqs_idle_reports,
            bucket_timeout: self.rlqs_bucket_timeout,
            first_report_timeout: self.rlqs_first_report_timeout,
            idle_stream_timeout: self.rlqs_idle_stream_timeout,
            show_values: self.rlqs_debug_show_values,
            max_report_bytes: self.rlqs_max_report_bytes as usize,
            max_usages_per_report: self.rlqs_max_usages_per_report as usize,
            min_report_interval: self.rlqs_min_report_interval,
            max_store_calls: self.rlqs_max_store_calls as usize,
            // Set where the gRPC listener's connection age is known (server::serve).
            max_stream_age: None,
        }
    }
}
