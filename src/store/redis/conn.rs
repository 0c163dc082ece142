//! Connections: bb8 manages a few multiplexed connections (replaced when a call finds one
//! broken), and [`Conn`] is the handle one call runs on, standalone or Cluster.

use super::sentinel;
use super::settings::{with_auth, RedisSettings};
use super::{classify, is_transport};
use crate::store::StoreError;
use redis::aio::MultiplexedConnection;
use redis::cluster_async::ClusterConnection;
use redis::{ErrorKind, RedisError, ServerErrorKind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A multiplexed connection shared by every in-flight call, and a flag set when a call on it
/// fails at the transport level, so the pool replaces it (after a Redis restart, say).
pub struct PooledConn {
    pub(super) conn: MultiplexedConnection,
    pub(super) broken: Broken,
}

/// Marks connections broken. A transport failure on one connection usually means Redis went
/// away (a restart, a failover), so it also retires every connection opened before it: the
/// next call then gets a fresh connection instead of another dead one.
#[derive(Clone, Debug)]
pub(super) struct Broken {
    pub(super) this: Arc<AtomicBool>,
    /// Failures seen by the pool so far, and how many there had been when this one connected.
    pub(super) epoch: Arc<AtomicU64>,
    pub(super) born: u64,
}

impl Broken {
    pub(super) fn set(&self) {
        if !self.this.swap(true, Ordering::Relaxed) {
            self.epoch.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(super) fn is_set(&self) -> bool {
        self.this.load(Ordering::Relaxed) || self.epoch.load(Ordering::Relaxed) != self.born
    }
}

/// bb8 manager for [`PooledConn`]. A call checks a connection out only long enough to clone its
/// handle (the clone shares the one socket and its writer task), so bb8 keeps `REDIS_POOL_SIZE`
/// multiplexed connections open and hands them out in turn, while the number of calls in flight
/// is unbounded and concurrent commands are written in batches (auto-pipelining). bb8-redis's
/// own manager never reports a multiplexed connection as broken, so it needs a PING on every
/// checkout (a second round trip per decision) to notice a restarted Redis; this one checks the
/// flag a failed call set, without I/O.
#[derive(Debug)]
pub struct Manager {
    pub(super) target: Target,
    pub(super) epoch: Arc<AtomicU64>,
    pub(super) config: redis::AsyncConnectionConfig,
    pub(super) errors: ConnectErrors,
}

/// Where the pool's connections go.
#[derive(Debug)]
pub(super) enum Target {
    Direct(redis::Client),
    /// Wherever the sentinels say the master is, asked anew for each connection.
    Sentinel(sentinel::Sentinels),
}

/// The sentinels of `settings` (their URLs as `infos`, with `REDIS_SENTINEL_AUTH`) and how to
/// reach the master they name (`REDIS_AUTH`, the same TLS).
pub(super) fn sentinels(
    settings: &RedisSettings,
    infos: Vec<redis::ConnectionInfo>,
    certs: Option<redis::TlsCertificates>,
) -> Result<sentinel::Sentinels, StoreError> {
    let Some(s) = &settings.sentinel else {
        return Err(StoreError::Permanent(
            "REDIS_TYPE=sentinel needs the master's name (REDIS_URL=master_name,host:port,...)"
                .into(),
        ));
    };
    if infos.is_empty() {
        return Err(StoreError::Permanent(
            "REDIS_TYPE=sentinel needs at least one sentinel address after the master's name"
                .into(),
        ));
    }
    let mut master = redis::RedisConnectionInfo::default();
    if let Some(auth) = &settings.auth {
        master = with_auth(master, auth);
    }
    let tls = certs.map(|c| (c, settings.tls.skip_hostname_verification));
    sentinel::Sentinels::new(infos, s.master_name.clone(), master, tls)
        .map_err(|e| StoreError::Permanent(format!("Redis Sentinel client: {e}")))
}

/// Logs why the pool could not connect. bb8 hands connection errors to its error sink only (a
/// caller just times out), so without this a rejected certificate or a wrong CA would never be
/// told. Each distinct error is logged once until a connection succeeds again, so a Redis that
/// stays down does not flood the log.
#[derive(Debug, Clone, Default)]
pub(super) struct ConnectErrors {
    pub(super) last: Arc<Mutex<Option<String>>>,
}

impl ConnectErrors {
    pub(super) fn connected(&self) {
        if let Ok(mut last) = self.last.lock() {
            *last = None;
        }
    }
}

impl bb8::ErrorSink<RedisError> for ConnectErrors {
    fn sink(&self, error: RedisError) {
        let message = error.to_string();
        if let Ok(mut last) = self.last.lock() {
            if last.as_deref() != Some(message.as_str()) {
                tracing::warn!(error = %message, "cannot connect to Redis");
                *last = Some(message);
            }
        }
    }

    fn boxed_clone(&self) -> Box<dyn bb8::ErrorSink<RedisError>> {
        Box::new(self.clone())
    }
}

impl bb8::ManageConnection for Manager {
    type Connection = PooledConn;
    type Error = RedisError;

    async fn connect(&self) -> Result<PooledConn, RedisError> {
        let conn = match &self.target {
            Target::Direct(client) => {
                client
                    .get_multiplexed_async_connection_with_config(&self.config)
                    .await?
            }
            Target::Sentinel(sentinels) => sentinels.connect_master(&self.config).await?,
        };
        self.errors.connected();
        Ok(PooledConn {
            conn,
            broken: Broken {
                this: Arc::new(AtomicBool::new(false)),
                born: self.epoch.load(Ordering::Relaxed),
                epoch: self.epoch.clone(),
            },
        })
    }

    /// No I/O: a connection is valid until a call on it failed at the transport level.
    async fn is_valid(&self, conn: &mut PooledConn) -> Result<(), RedisError> {
        if conn.broken.is_set() {
            Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "connection marked broken",
            )))
        } else {
            Ok(())
        }
    }

    fn has_broken(&self, conn: &mut PooledConn) -> bool {
        conn.broken.is_set()
    }
}

/// A connection handle for one call.
#[derive(Clone)]
pub(super) enum Conn {
    Single(MultiplexedConnection, Broken),
    Cluster(ClusterConnection),
}

impl Conn {
    /// Runs `run` on this connection; a transport failure marks a pooled connection broken.
    pub(super) async fn query<T>(
        &mut self,
        run: impl AsyncFnOnce(&mut Conn) -> redis::RedisResult<T>,
    ) -> Result<T, StoreError> {
        let broken = match self {
            Conn::Single(_, broken) => Some(broken.clone()),
            Conn::Cluster(_) => None,
        };
        let r = run(self).await;
        if let (Err(e), Some(broken)) = (&r, broken) {
            // READONLY: this server was demoted to a replica. Sentinel also closes the clients of
            // a server it reconfigures, so this is the fallback if that close is missed: the
            // next connection goes to the master the sentinels name.
            if is_transport(e) || e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly) {
                broken.set();
            }
        }
        r.map_err(classify)
    }
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Conn::Single(c, _) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::Single(c, _) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c, _) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}
