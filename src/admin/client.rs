//! `sluice admin`: the admin API from a shell. Each subcommand is one call; the answer is printed
//! as protobuf JSON (the field names of `admin.proto`), so a person reads it and `jq` takes it.
//!
//! ```text
//! sluice admin inspect api tenant=acme user=bob
//! sluice admin top api
//! sluice admin candidates api --top 5
//! sluice admin reset api tenant=acme --reason "ticket 4411"
//! sluice admin override set api tenant=acme --limit 50 --ttl 1h --reason "launch"
//! sluice admin override delete api tenant=acme
//! sluice admin override list
//! ```

use crate::proto::sluice::admin::v1 as pb;
use crate::proto::sluice::admin::v1::admin_client::AdminClient;
use clap::{Args, Subcommand};
use std::path::PathBuf;
use std::time::Duration;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// `sluice admin`.
#[derive(Debug, Clone, Args)]
pub struct AdminArgs {
    /// The admin listener: `http://HOST:PORT`, `https://HOST:PORT`, or `unix:/path/to/socket`.
    #[arg(
        long,
        env = "SLUICE_ADMIN_URL",
        default_value = "http://127.0.0.1:8083"
    )]
    pub url: String,

    /// A bearer token (prefer --token-file: a command line is visible to every local user).
    #[arg(long, env = "SLUICE_ADMIN_TOKEN", hide_env_values = true)]
    pub token: Option<String>,

    /// A file holding the bearer token (its first line).
    #[arg(long, env = "SLUICE_ADMIN_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,

    /// CA bundle (PEM) the server's certificate chains to (`https://`).
    #[arg(long)]
    pub ca: Option<PathBuf>,

    /// Client certificate (PEM) for mutual TLS.
    #[arg(long, requires = "key")]
    pub cert: Option<PathBuf>,

    /// The client certificate's key (PEM).
    #[arg(long, requires = "cert")]
    pub key: Option<PathBuf>,

    /// The name the server's certificate must have (default: the URL's host).
    #[arg(long)]
    pub server_name: Option<String>,

    /// How long the call may take.
    #[arg(long, default_value = "10s", value_parser = crate::duration::parse_go)]
    pub timeout: Duration,

    #[command(subcommand)]
    pub call: Call,
}

/// One admin call.
#[derive(Debug, Clone, Subcommand)]
pub enum Call {
    /// What each limit of a descriptor holds (usage, remaining, reset); charges nothing.
    Inspect {
        domain: String,
        /// The descriptor as Envoy sends it: `key=value` entries in order.
        #[arg(required = true, value_parser = parse_entry)]
        entries: Vec<(String, String)>,
    },
    /// The consumers of a domain denied most recently.
    Top {
        domain: String,
        #[arg(long, default_value_t = 20)]
        page_size: u32,
        #[arg(long, default_value = "")]
        page_token: String,
    },
    /// What each candidate limit (CANDIDATE_CONFIG) would have done, beside the enforced
    /// config: would-admit and would-deny counts, disagreements, the consumers it would stop.
    Candidates {
        /// The domain (all domains when omitted).
        #[arg(default_value = "")]
        domain: String,
        /// Consumers per limit (at most 32).
        #[arg(long, default_value_t = 10)]
        top: u32,
    },
    /// Reset every counter at or below a descriptor prefix (`tenant=acme`: acme and its
    /// consumers).
    Reset {
        domain: String,
        #[arg(required = true, value_parser = parse_entry)]
        prefix: Vec<(String, String)>,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Overrides of a descriptor's limit, for a while.
    #[command(subcommand)]
    Override(OverrideCall),
}

#[derive(Debug, Clone, Subcommand)]
pub enum OverrideCall {
    /// Set a descriptor's limit (--limit N, --unlimited or --deny) for --ttl.
    // One of the three, each standing alone: a group that is required, no member that is.
    #[command(group(clap::ArgGroup::new("to").required(true).args(["limit", "unlimited", "deny"])))]
    Set {
        domain: String,
        #[arg(required = true, value_parser = parse_entry)]
        entries: Vec<(String, String)>,
        #[arg(long)]
        limit: Option<u32>,
        #[arg(long)]
        unlimited: bool,
        #[arg(long)]
        deny: bool,
        /// How long it lasts, in whole seconds (`90s`, `1h`, at most `2160h`).
        #[arg(long, value_parser = parse_ttl)]
        ttl: Duration,
        /// Only the limit of this name (default: every limit of the descriptor).
        #[arg(long, default_value = "")]
        name: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Remove an override before it expires.
    Delete {
        domain: String,
        #[arg(required = true, value_parser = parse_entry)]
        entries: Vec<(String, String)>,
        #[arg(long, default_value = "")]
        name: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// The overrides in force (of one domain, or all).
    List { domain: Option<String> },
}

/// An override's `--ttl`: a whole number of seconds, at least one. The API counts in seconds
/// and refuses 0; rounding `0s` or `500ms` up to a second would set what nobody asked for.
fn parse_ttl(s: &str) -> Result<Duration, String> {
    let ttl = crate::duration::parse_go(s)?;
    if ttl.is_zero() || ttl.subsec_nanos() != 0 {
        return Err(format!(
            "{s:?}: an override lasts a whole number of seconds, at least 1s"
        ));
    }
    Ok(ttl)
}

/// `key=value` (the value may hold `=`; the key may not be empty).
fn parse_entry(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{s:?}: expected key=value")),
    }
}

fn entries(list: &[(String, String)]) -> Vec<pb::Entry> {
    list.iter()
        .map(|(k, v)| pb::Entry {
            key: k.clone(),
            value: v.clone(),
        })
        .collect()
}

/// Why a call could not be made or was refused.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{0}")]
    Setup(String),
    #[error("cannot connect to {url}: {source}")]
    Connect {
        url: String,
        source: tonic::transport::Error,
    },
    #[error("{:?}: {}", .0.code(), .0.message())]
    Call(#[from] tonic::Status),
}

impl AdminArgs {
    fn token(&self) -> Result<Option<String>, ClientError> {
        if let Some(t) = &self.token {
            return Ok(Some(t.clone()));
        }
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| ClientError::Setup(format!("{}: {e}", path.display())))?;
        Ok(text.lines().next().map(|l| l.trim().to_string()))
    }

    async fn channel(&self) -> Result<Channel, ClientError> {
        let setup = |e: String| ClientError::Setup(e);
        let mut endpoint = Endpoint::from_shared(self.url.clone())
            .map_err(|e| setup(format!("{}: {e}", self.url)))?
            .timeout(self.timeout)
            .connect_timeout(self.timeout);
        if self.url.starts_with("https://") || self.ca.is_some() || self.cert.is_some() {
            let read =
                |p: &PathBuf| std::fs::read(p).map_err(|e| setup(format!("{}: {e}", p.display())));
            let mut tls = ClientTlsConfig::new();
            if let Some(ca) = &self.ca {
                tls = tls.ca_certificate(Certificate::from_pem(read(ca)?));
            }
            if let (Some(cert), Some(key)) = (&self.cert, &self.key) {
                tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
            }
            if let Some(name) = &self.server_name {
                tls = tls.domain_name(name.clone());
            }
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| setup(format!("TLS: {e}")))?;
        }
        endpoint
            .connect()
            .await
            .map_err(|source| ClientError::Connect {
                url: self.url.clone(),
                source,
            })
    }

    fn request<T>(
        &self,
        message: T,
        token: Option<&str>,
    ) -> Result<tonic::Request<T>, ClientError> {
        let mut r = tonic::Request::new(message);
        if let Some(t) = token {
            let value = format!("Bearer {t}")
                .parse()
                .map_err(|_| ClientError::Setup("the token is not a valid header value".into()))?;
            r.metadata_mut().insert("authorization", value);
        }
        Ok(r)
    }

    /// Makes the call; returns the answer as protobuf JSON.
    pub async fn run(&self) -> Result<String, ClientError> {
        let token = self.token()?;
        let token = token.as_deref();
        let mut c = AdminClient::new(self.channel().await?);
        let json = match &self.call {
            Call::Inspect { domain, entries: e } => {
                let m = pb::InspectRequest {
                    domain: domain.clone(),
                    entries: entries(e),
                };
                to_json(&c.inspect(self.request(m, token)?).await?.into_inner())
            }
            Call::Top {
                domain,
                page_size,
                page_token,
            } => {
                let m = pb::TopRequest {
                    domain: domain.clone(),
                    page_size: *page_size,
                    page_token: page_token.clone(),
                };
                to_json(&c.top(self.request(m, token)?).await?.into_inner())
            }
            Call::Candidates { domain, top } => {
                let m = pb::CandidatesRequest {
                    domain: domain.clone(),
                    top: *top,
                };
                to_json(&c.candidates(self.request(m, token)?).await?.into_inner())
            }
            Call::Reset {
                domain,
                prefix,
                reason,
            } => {
                let m = pb::ResetRequest {
                    domain: domain.clone(),
                    prefix: entries(prefix),
                    reason: reason.clone(),
                };
                to_json(&c.reset(self.request(m, token)?).await?.into_inner())
            }
            Call::Override(call) => self.run_override(&mut c, call, token).await?,
        };
        Ok(json)
    }

    async fn run_override(
        &self,
        c: &mut AdminClient<Channel>,
        call: &OverrideCall,
        token: Option<&str>,
    ) -> Result<String, ClientError> {
        use pb::set_override_request::Limit;
        Ok(match call {
            OverrideCall::Set {
                domain,
                entries: e,
                limit,
                unlimited,
                deny,
                ttl,
                name,
                reason,
            } => {
                let limit = match (limit, unlimited, deny) {
                    (Some(n), _, _) => Limit::RequestsPerUnit(*n),
                    (None, true, _) => Limit::Unlimited(true),
                    _ => Limit::Deny(*deny),
                };
                let m = pb::SetOverrideRequest {
                    domain: domain.clone(),
                    entries: entries(e),
                    limit_name: name.clone(),
                    limit: Some(limit),
                    ttl_seconds: ttl.as_secs(),
                    reason: reason.clone(),
                };
                to_json(&c.set_override(self.request(m, token)?).await?.into_inner())
            }
            OverrideCall::Delete {
                domain,
                entries: e,
                name,
                reason,
            } => {
                let m = pb::DeleteOverrideRequest {
                    domain: domain.clone(),
                    entries: entries(e),
                    limit_name: name.clone(),
                    reason: reason.clone(),
                };
                to_json(
                    &c.delete_override(self.request(m, token)?)
                        .await?
                        .into_inner(),
                )
            }
            OverrideCall::List { domain } => {
                let m = pb::ListOverridesRequest {
                    domain: domain.clone().unwrap_or_default(),
                };
                to_json(
                    &c.list_overrides(self.request(m, token)?)
                        .await?
                        .into_inner(),
                )
            }
        })
    }
}

/// A message as protobuf JSON, through the admin API's descriptors.
fn to_json<M: prost::Message + Named + std::fmt::Debug>(m: &M) -> String {
    let render = || -> Option<String> {
        let pool =
            prost_reflect::DescriptorPool::decode(crate::proto::ADMIN_FILE_DESCRIPTOR_SET).ok()?;
        let desc = pool.get_message_by_name(M::NAME)?;
        let dynamic =
            prost_reflect::DynamicMessage::decode(desc, m.encode_to_vec().as_slice()).ok()?;
        let opts = prost_reflect::SerializeOptions::new().skip_default_fields(false);
        let mut out = serde_json::Serializer::pretty(Vec::new());
        dynamic.serialize_with_options(&mut out, &opts).ok()?;
        String::from_utf8(out.into_inner()).ok()
    };
    render().unwrap_or_else(|| format!("{m:?}"))
}

/// The full protobuf name of an answer, to find its descriptor.
trait Named {
    const NAME: &'static str;
}

macro_rules! named {
    ($($t:ident),*) => {
        $(impl Named for pb::$t {
            const NAME: &'static str = concat!("sluice.admin.v1.", stringify!($t));
        })*
    };
}
named!(
    InspectResponse,
    TopResponse,
    CandidatesResponse,
    ResetResponse,
    Override,
    DeleteOverrideResponse,
    ListOverridesResponse
);

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Admin {
        #[command(flatten)]
        args: AdminArgs,
    }

    fn set(extra: &[&str]) -> Result<AdminArgs, clap::Error> {
        let args = ["admin", "override", "set", "api", "tenant=acme"];
        Admin::try_parse_from(args.iter().chain(extra)).map(|a| a.args)
    }

    #[test]
    fn an_override_lasts_whole_seconds_at_least_one() {
        for bad in ["0s", "500ms", "1500ms", "0"] {
            let e = set(&["--deny", "--ttl", bad]).unwrap_err();
            assert!(
                e.to_string().contains("whole number of seconds"),
                "{bad}: {e}"
            );
        }
        let Call::Override(OverrideCall::Set { ttl, .. }) =
            set(&["--deny", "--ttl", "90s"]).unwrap().call
        else {
            panic!("override set");
        };
        assert_eq!(ttl, Duration::from_secs(90));
    }

    #[test]
    fn one_of_limit_unlimited_or_deny_stands_alone() {
        for alone in [&["--limit", "5"][..], &["--unlimited"], &["--deny"]] {
            let args: Vec<&str> = alone.iter().copied().chain(["--ttl", "1m"]).collect();
            assert!(set(&args).is_ok(), "{alone:?}");
        }
        assert!(set(&["--ttl", "1m"]).is_err(), "one of them is needed");
        assert!(set(&["--deny", "--unlimited", "--ttl", "1m"]).is_err());
        let help = set(&["--help"]).unwrap_err().to_string();
        let usage = help.lines().find(|l| l.starts_with("Usage:")).unwrap();
        assert!(
            usage.contains("<--limit <LIMIT>|--unlimited|--deny>"),
            "{usage}"
        );
    }
}
