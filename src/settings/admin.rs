//! `ADMIN_*`: where the admin API listens and how it authenticates (see `crate::admin`).

use super::{parse_go_bool, resolve, SettingsError};
use crate::admin::{AuthSettings, Scopes};
use crate::server::admin::AdminListen;
use crate::server::tls::TlsSettings;
use clap::Args;
use std::path::PathBuf;

#[derive(Debug, Clone, Args)]
pub struct AdminServeArgs {
    /// Serve the admin API (inspect, reset, overrides) on its own listener.
    #[arg(
        long,
        env = "ADMIN_ENABLED",
        default_value = "true",
        value_parser = parse_go_bool,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub admin_enabled: bool,

    /// Address of the admin API. Anything but loopback needs ADMIN_TOKENS_FILE or
    /// ADMIN_TLS_CLIENT_CACERT.
    #[arg(long, env = "ADMIN_HOST", default_value = "127.0.0.1")]
    pub admin_host: String,

    /// Port of the admin API (0 picks a free port).
    #[arg(long, env = "ADMIN_PORT", default_value_t = 8083)]
    pub admin_port: u16,

    /// Serve the admin API on this Unix socket instead (plaintext; the file's permissions
    /// decide who reaches it).
    #[arg(long, env = "ADMIN_UDS")]
    pub admin_uds: Option<PathBuf>,

    /// Bearer tokens: one `NAME SCOPES TOKEN` per line (scopes: read, write), read again on
    /// every call.
    #[arg(long, env = "ADMIN_TOKENS_FILE")]
    pub admin_tokens_file: Option<PathBuf>,

    /// PEM certificate of the admin listener (TLS; reloaded when the file changes).
    #[arg(long, env = "ADMIN_TLS_CERT", requires = "admin_tls_key")]
    pub admin_tls_cert: Option<PathBuf>,

    /// PEM key of the admin listener.
    #[arg(long, env = "ADMIN_TLS_KEY", requires = "admin_tls_cert")]
    pub admin_tls_key: Option<PathBuf>,

    /// PEM CA bundle: admin clients must present a certificate it signed; its subject's common
    /// name names the caller.
    #[arg(long, env = "ADMIN_TLS_CLIENT_CACERT", requires = "admin_tls_cert")]
    pub admin_tls_client_cacert: Option<PathBuf>,

    /// Scopes of a caller authenticated by its client certificate: read, or read,write. Read by
    /// default: a CA that also signs other clients (a mesh's, the gRPC port's) must not make
    /// every one of them a writer.
    #[arg(long, env = "ADMIN_TLS_CLIENT_SCOPES", default_value = "read",
          value_parser = Scopes::parse)]
    pub admin_tls_client_scopes: Scopes,
}

impl AdminServeArgs {
    /// The admin listener, or `None` with `ADMIN_ENABLED=false`.
    pub fn listen(&self) -> Result<Option<AdminListen>, SettingsError> {
        if !self.admin_enabled {
            return Ok(None);
        }
        let addr = resolve("admin", &self.admin_host, self.admin_port)?;
        let tls = match (&self.admin_tls_cert, &self.admin_tls_key) {
            (Some(cert), Some(key)) => {
                let t = TlsSettings::new(cert.clone(), key.clone());
                Some(match &self.admin_tls_client_cacert {
                    Some(ca) => t.with_client_ca(ca.clone()),
                    None => t,
                })
            }
            _ => None,
        };
        Ok(Some(AdminListen {
            addr,
            uds: self.admin_uds.clone(),
            auth: AuthSettings {
                tokens_file: self.admin_tokens_file.clone(),
                client_cert_scopes: self
                    .admin_tls_client_cacert
                    .as_ref()
                    .map(|_| self.admin_tls_client_scopes),
            },
            tls,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Serve {
        #[command(flatten)]
        admin: AdminServeArgs,
    }

    #[test]
    fn client_certificates_read_unless_told_to_write() {
        let tls = [
            "serve",
            "--admin-tls-cert=c.pem",
            "--admin-tls-key=k.pem",
            "--admin-tls-client-cacert=ca.pem",
        ];
        let scopes = |extra: &[&str]| {
            let args = tls.iter().chain(extra).copied();
            let listen = Serve::try_parse_from(args).unwrap().admin.listen().unwrap();
            listen.unwrap().auth.client_cert_scopes.unwrap()
        };
        let read = Scopes {
            read: true,
            write: false,
        };
        assert_eq!(scopes(&[]), read);
        let all = scopes(&["--admin-tls-client-scopes=read,write"]);
        assert_eq!(all, Scopes::ALL);
    }
}
