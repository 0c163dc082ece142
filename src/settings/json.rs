//! `/json` on the plaintext HTTP port (envoyproxy's debug-and-test endpoint for decisions): with
//! gRPC served over TLS or mutual TLS it would let anyone who reaches the port decide (and
//! charge, or with `is_negative_hits` refund) without a certificate, so by default it is off
//! then, and refunds with it. Each can be set either way.

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct JsonArgs {
    /// Serve `/json` (default: only when gRPC is plaintext; else 403).
    #[arg(long, env = "JSON_ENDPOINT", value_parser = super::parse_go_bool)]
    pub json_endpoint: Option<bool>,

    /// Take `is_negative_hits` (refunds) on `/json` (default: only when gRPC is plaintext;
    /// else 403).
    #[arg(long, env = "JSON_ALLOW_NEGATIVE_HITS", value_parser = super::parse_go_bool)]
    pub json_allow_negative_hits: Option<bool>,
}
