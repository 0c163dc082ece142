//! Where the rules come from (`CONFIG_TYPE`) and, for config over xDS, envoyproxy/ratelimit's
//! `CONFIG_GRPC_XDS_*` and `XDS_CLIENT_*` settings, with the same names and defaults.

use super::{parse_duration, parse_go_bool, SettingsError};
use crate::server::xds::{Backoff, XdsSettings, XdsTls};
use clap::Args;
use std::path::PathBuf;
use std::time::Duration;
use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue};

/// `CONFIG_TYPE`: files (envoyproxy's default) or a state-of-the-world ADS stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigType {
    File,
    GrpcXdsSotw,
}

fn parse_config_type(s: &str) -> Result<ConfigType, String> {
    match s.trim().to_ascii_uppercase().as_str() {
        "FILE" => Ok(ConfigType::File),
        "GRPC_XDS_SOTW" => Ok(ConfigType::GrpcXdsSotw),
        _ => Err(format!(
            "invalid config type {s:?} (use FILE or GRPC_XDS_SOTW)"
        )),
    }
}

#[derive(Debug, Clone, Args)]
pub struct ConfigSourceArgs {
    /// Where the rules come from: `FILE` (the config files) or `GRPC_XDS_SOTW` (pushed by an xDS
    /// management server over an ADS stream).
    #[arg(long, env = "CONFIG_TYPE", default_value = "FILE", value_parser = parse_config_type)]
    pub config_type: ConfigType,

    /// With xDS: start serving before the first config arrives (requests get UNAVAILABLE until
    /// it does). Unset, sluice reports NOT_SERVING until then.
    #[arg(long, env = "FORCE_START_WITHOUT_INITIAL_CONFIG", default_value = "false",
          value_parser = parse_go_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true")]
    pub force_start_without_initial_config: bool,

    /// Report NOT_SERVING until a config is loaded.
    #[arg(long, env = "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", default_value = "false",
          value_parser = parse_go_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true")]
    pub healthy_with_at_least_one_config_loaded: bool,

    /// The node id sent to the xDS server.
    #[arg(long, env = "CONFIG_GRPC_XDS_NODE_ID", default_value = "default")]
    pub config_grpc_xds_node_id: String,

    /// Node metadata, `key=value,key=value`.
    #[arg(long, env = "CONFIG_GRPC_XDS_NODE_METADATA", default_value = "")]
    pub config_grpc_xds_node_metadata: String,

    /// `host:port` of the xDS management server.
    #[arg(
        long,
        env = "CONFIG_GRPC_XDS_SERVER_URL",
        default_value = "localhost:18000"
    )]
    pub config_grpc_xds_server_url: String,

    /// Wait between failed connection attempts to the xDS server.
    #[arg(long, env = "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", default_value = "3s",
          value_parser = parse_duration)]
    pub config_grpc_xds_server_connect_retry_interval: Duration,

    /// gRPC metadata sent on the ADS stream, `key:value,key:value`.
    #[arg(
        long,
        env = "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
        default_value = ""
    )]
    pub config_grpc_xds_client_additional_headers: String,

    /// Reach the xDS server over TLS (needs CONFIG_GRPC_XDS_SERVER_TLS_CACERT).
    #[arg(long, env = "CONFIG_GRPC_XDS_SERVER_USE_TLS", default_value = "false",
          value_parser = parse_go_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true")]
    pub config_grpc_xds_server_use_tls: bool,

    /// PEM client certificate for mutual TLS to the xDS server.
    #[arg(long, env = "CONFIG_GRPC_XDS_CLIENT_TLS_CERT")]
    pub config_grpc_xds_client_tls_cert: Option<PathBuf>,

    /// PEM key of the client certificate.
    #[arg(long, env = "CONFIG_GRPC_XDS_CLIENT_TLS_KEY")]
    pub config_grpc_xds_client_tls_key: Option<PathBuf>,

    /// PEM CA bundle the xDS server's certificate must chain to.
    #[arg(long, env = "CONFIG_GRPC_XDS_SERVER_TLS_CACERT")]
    pub config_grpc_xds_server_tls_cacert: Option<PathBuf>,

    /// Name the xDS server's certificate must carry, when not the URL's host.
    #[arg(long, env = "CONFIG_GRPC_XDS_SERVER_TLS_SAN")]
    pub config_grpc_xds_server_tls_san: Option<String>,

    /// First wait before reconnecting after the ADS stream broke; doubles per failure.
    #[arg(long, env = "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", default_value = "10s",
          value_parser = parse_duration)]
    pub xds_client_backoff_initial_interval: Duration,

    /// Longest wait before reconnecting.
    #[arg(long, env = "XDS_CLIENT_BACKOFF_MAX_INTERVAL", default_value = "60s",
          value_parser = parse_duration)]
    pub xds_client_backoff_max_interval: Duration,

    /// Spread of each wait with jitter on (0..=1: +-50% at 0.5).
    #[arg(long, env = "XDS_CLIENT_BACKOFF_RANDOM_FACTOR", default_value = "0.5",
          value_parser = parse_factor)]
    pub xds_client_backoff_random_factor: f64,

    /// Randomise the waits, so many replicas do not reconnect in step.
    #[arg(long, env = "XDS_CLIENT_BACKOFF_JITTER", default_value = "true",
          value_parser = parse_go_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true")]
    pub xds_client_backoff_jitter: bool,

    /// Largest xDS response accepted, in bytes (default 4 MiB).
    #[arg(long, env = "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub xds_client_max_msg_size_in_bytes: Option<u32>,
}

fn parse_factor(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!(
            "invalid random factor {s:?} (a number from 0 to 1)"
        )),
    }
}

impl ConfigSourceArgs {
    /// The xDS client settings, or `None` for config files.
    pub fn xds(
        &self,
        (merge_domains, calendar_months): (bool, bool),
    ) -> Result<Option<XdsSettings>, SettingsError> {
        if self.config_type == ConfigType::File {
            return Ok(None);
        }
        let err = |m: String| SettingsError::Xds(m);
        let tls = if self.config_grpc_xds_server_use_tls {
            let Some(ca_cert) = self.config_grpc_xds_server_tls_cacert.clone() else {
                return Err(err(
                    "CONFIG_GRPC_XDS_SERVER_USE_TLS=true needs CONFIG_GRPC_XDS_SERVER_TLS_CACERT: \
                     sluice does not read the system trust store"
                        .into(),
                ));
            };
            let client_identity = match (
                self.config_grpc_xds_client_tls_cert.clone(),
                self.config_grpc_xds_client_tls_key.clone(),
            ) {
                (Some(c), Some(k)) => Some((c, k)),
                (None, None) => None,
                _ => {
                    return Err(err("set both CONFIG_GRPC_XDS_CLIENT_TLS_CERT and \
                                    CONFIG_GRPC_XDS_CLIENT_TLS_KEY, or neither"
                        .into()))
                }
            };
            Some(XdsTls {
                ca_cert,
                client_identity,
                server_name: self.config_grpc_xds_server_tls_san.clone(),
            })
        } else {
            None
        };
        let url = self.config_grpc_xds_server_url.trim();
        if url.is_empty() || url.contains("://") {
            return Err(err(format!(
                "CONFIG_GRPC_XDS_SERVER_URL must be host:port, got {url:?}"
            )));
        }
        Ok(Some(XdsSettings {
            server_url: url.to_string(),
            node_id: self.config_grpc_xds_node_id.clone(),
            node_metadata: node_metadata(&self.config_grpc_xds_node_metadata),
            headers: headers(&self.config_grpc_xds_client_additional_headers).map_err(err)?,
            connect_retry_interval: self.config_grpc_xds_server_connect_retry_interval,
            tls,
            backoff: Backoff {
                initial: self.xds_client_backoff_initial_interval,
                max: self
                    .xds_client_backoff_max_interval
                    .max(self.xds_client_backoff_initial_interval),
                random_factor: self.xds_client_backoff_random_factor,
                jitter: self.xds_client_backoff_jitter,
            },
            max_message_bytes: self.xds_client_max_msg_size_in_bytes.map(|n| n as usize),
            merge_domains,
            calendar_months,
        }))
    }

    /// Not ready until a config is in: asked for, or implied by xDS without a forced start
    /// (envoyproxy does not serve at all before its first xDS config then).
    pub fn ready_needs_config(&self) -> bool {
        self.healthy_with_at_least_one_config_loaded
            || (self.config_type == ConfigType::GrpcXdsSotw
                && !self.force_start_without_initial_config)
    }
}

/// `key=value,key=value`, as envoyproxy splits it: entries without `=` are skipped.
fn node_metadata(s: &str) -> Vec<(String, String)> {
    s.split(',')
        .filter_map(|e| e.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// `key:value,key:value` (envconfig's map syntax), each a valid gRPC ASCII header.
fn headers(s: &str) -> Result<Vec<(AsciiMetadataKey, AsciiMetadataValue)>, String> {
    let setting = "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS";
    let mut out = Vec::new();
    for (k, v) in super::key_value_list(s, setting)? {
        let key = AsciiMetadataKey::from_bytes(k.to_ascii_lowercase().as_bytes())
            .map_err(|_| format!("invalid header name {k:?} in {setting}"))?;
        let value = AsciiMetadataValue::try_from(v)
            .map_err(|_| format!("invalid value for header {k:?} in {setting}"))?;
        out.push((key, value));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_and_headers_parse_as_envoyproxy_writes_them() {
        assert_eq!(
            node_metadata("cluster=eg,zone=a=b,junk"),
            [
                ("cluster".into(), "eg".into()),
                ("zone".into(), "a=b".into())
            ]
        );
        let h = headers("x-token:abc, X-Team : platform").expect("valid");
        assert_eq!(h.len(), 2);
        assert_eq!(h[1].0.as_str(), "x-team");
        assert_eq!(h[1].1, "platform");
        assert!(headers("").expect("empty").is_empty());
        assert!(headers("novalue").is_err());
        assert!(headers("bad header:1").is_err());
    }

    #[test]
    fn config_type_is_file_or_sotw() {
        assert_eq!(parse_config_type("FILE"), Ok(ConfigType::File));
        assert_eq!(
            parse_config_type("grpc_xds_sotw"),
            Ok(ConfigType::GrpcXdsSotw)
        );
        assert!(parse_config_type("GRPC_XDS_DELTA").is_err());
    }
}
