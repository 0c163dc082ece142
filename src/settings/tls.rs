//! `GRPC_SERVER_USE_TLS` and its certificate settings, with envoyproxy/ratelimit's names.

use super::{parse_go_bool, SettingsError};
use crate::server::tls::TlsSettings;
use clap::Args;
use std::path::PathBuf;
/// TLS on the gRPC port, with envoyproxy/ratelimit's names. The HTTP admin port stays plaintext.
#[derive(Debug, Clone, Args)]
pub struct TlsArgs {
    /// Serve gRPC over TLS with GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY.
    #[arg(
        long,
        env = "GRPC_SERVER_USE_TLS",
        default_value = "false",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub grpc_server_use_tls: bool,

    /// PEM certificate chain of the gRPC server (reloaded when the file changes).
    #[arg(long, env = "GRPC_SERVER_TLS_CERT")]
    pub grpc_server_tls_cert: Option<PathBuf>,

    /// PEM private key of the gRPC server (reloaded when the file changes).
    #[arg(long, env = "GRPC_SERVER_TLS_KEY")]
    pub grpc_server_tls_key: Option<PathBuf>,

    /// PEM CA bundle: when set, clients must present a certificate signed by it (mutual TLS).
    #[arg(long, env = "GRPC_CLIENT_TLS_CACERT")]
    pub grpc_client_tls_cacert: Option<PathBuf>,
}

impl TlsArgs {
    /// The gRPC TLS settings, or `None` for plaintext. The files are read (and checked) when the
    /// server starts.
    pub fn grpc_tls(&self) -> Result<Option<TlsSettings>, SettingsError> {
        // clap refuses an empty path, and an empty env var counts as unset (`ignore_empty_env`).
        let cert = self.grpc_server_tls_cert.clone();
        let key = self.grpc_server_tls_key.clone();
        let ca = self.grpc_client_tls_cacert.clone();
        if !self.grpc_server_use_tls {
            // Serving plaintext while the operator expects every client to show a certificate
            // would silently drop the authentication they asked for.
            if ca.is_some() {
                return Err(SettingsError::Tls(
                    "GRPC_CLIENT_TLS_CACERT is set but GRPC_SERVER_USE_TLS is not true: \
                     refusing to serve gRPC in plaintext when client certificates are expected"
                        .into(),
                ));
            }
            // envoyproxy ignores them too; say so, since it is probably not what was meant.
            if cert.is_some() || key.is_some() {
                tracing::warn!(
                    "GRPC_SERVER_TLS_CERT/GRPC_SERVER_TLS_KEY are ignored: GRPC_SERVER_USE_TLS is \
                     not true, gRPC is served in plaintext"
                );
            }
            return Ok(None);
        }
        let (Some(cert), Some(key)) = (cert, key) else {
            return Err(SettingsError::Tls(
                "GRPC_SERVER_USE_TLS=true needs both GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY \
                 (PEM files)"
                    .into(),
            ));
        };
        let settings = TlsSettings::new(cert, key);
        Ok(Some(match ca {
            Some(ca) => settings.with_client_ca(ca),
            None => settings,
        }))
    }
}
