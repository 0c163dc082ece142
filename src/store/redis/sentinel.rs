//! Redis Sentinel (`REDIS_TYPE=sentinel`, `REDIS_URL=master_name,host:port,...` as
//! envoyproxy/ratelimit takes it): where the master is, asked of the sentinels each time the pool
//! opens a connection. After a failover the old master's connections fail (it died) or answer
//! `READONLY` (it was demoted); either marks them broken, so the next connection is opened to
//! whatever master the sentinels name then. Everything else is the standalone path: one
//! multiplexed pool, one batched script call per request.

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ConnectionInfo, IntoConnectionInfo, RedisError, RedisResult};
use std::fmt;

/// The sentinels to ask, and how to reach the master they name.
pub(super) struct Sentinels {
    /// One client per sentinel, asked in order until one knows the master.
    sentinels: Vec<redis::Client>,
    master_name: String,
    /// `redis` or `rediss`: the master is reached the way the sentinels are (`REDIS_TLS`).
    scheme: &'static str,
    /// Credentials (`REDIS_AUTH`) and database of the master connection.
    master_settings: redis::RedisConnectionInfo,
    tls: Option<(redis::TlsCertificates, bool)>,
}

impl fmt::Debug for Sentinels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sentinels")
            .field("sentinels", &self.sentinels.len())
            .field("master_name", &self.master_name)
            .finish_non_exhaustive()
    }
}

impl Sentinels {
    /// `sentinels` carry `REDIS_SENTINEL_AUTH`; `master_settings` carry `REDIS_AUTH`.
    /// `tls`: the certificates and the skip-hostname flag, for `rediss://` sentinels.
    pub(super) fn new(
        sentinels: Vec<ConnectionInfo>,
        master_name: String,
        master_settings: redis::RedisConnectionInfo,
        tls: Option<(redis::TlsCertificates, bool)>,
    ) -> RedisResult<Self> {
        let scheme = if sentinels.iter().any(super::is_tls) {
            "rediss"
        } else {
            "redis"
        };
        let sentinels = sentinels
            .into_iter()
            .map(|info| client_for(info, tls.as_ref()))
            .collect::<RedisResult<Vec<_>>>()?;
        Ok(Self {
            sentinels,
            master_name,
            scheme,
            master_settings,
            tls,
        })
    }

    /// A connection to the master the sentinels name now, checked to really be the master (a
    /// sentinel can lag behind a failover for a moment).
    pub(super) async fn connect_master(
        &self,
        config: &AsyncConnectionConfig,
    ) -> RedisResult<MultiplexedConnection> {
        let (host, port) = self.master_address(config).await?;
        // An IPv6 address needs brackets in a URL.
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        };
        let info = format!("{}://{host}:{port}", self.scheme)
            .into_connection_info()?
            .set_redis_settings(self.master_settings.clone());
        let client = client_for(info, self.tls.as_ref())?;
        let mut conn = client
            .get_multiplexed_async_connection_with_config(config)
            .await?;
        let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut conn).await?;
        match role.first() {
            Some(redis::Value::BulkString(r)) if r.as_slice() == b"master" => Ok(conn),
            Some(redis::Value::SimpleString(r)) if r == "master" => Ok(conn),
            _ => Err(failed(format!(
                "the sentinels name {host}:{port} as master of {:?}, but it is not a master (yet)",
                self.master_name
            ))),
        }
    }

    /// `SENTINEL get-master-addr-by-name`, asked of each sentinel in turn.
    async fn master_address(&self, config: &AsyncConnectionConfig) -> RedisResult<(String, u16)> {
        let mut last = None;
        for sentinel in &self.sentinels {
            let asked = async {
                let mut conn = sentinel
                    .get_multiplexed_async_connection_with_config(config)
                    .await?;
                redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(&self.master_name)
                    .query_async::<Option<(String, u16)>>(&mut conn)
                    .await
            };
            match asked.await {
                Ok(Some(addr)) => return Ok(addr),
                Ok(None) => {
                    last = Some(failed(format!(
                        "a sentinel does not know a master named {:?}",
                        self.master_name
                    )))
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| failed("no sentinel given".into())))
    }
}

fn client_for(
    info: ConnectionInfo,
    tls: Option<&(redis::TlsCertificates, bool)>,
) -> RedisResult<redis::Client> {
    match tls {
        Some((certs, skip)) if super::is_tls(&info) => {
            super::settings::tls_client(info, certs, *skip)
        }
        _ => redis::Client::open(info),
    }
}

/// An I/O-kind error, so the store counts it as Redis being unreachable (transient), which it
/// is while the sentinels elect a new master.
fn failed(message: String) -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::NotConnected,
        message,
    ))
}
