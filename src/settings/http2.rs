//! The gRPC listener's HTTP/2 and TCP bounds: how many streams one connection may hold open at
//! once (SETTINGS_MAX_CONCURRENT_STREAMS: Envoy's connection pool opens another connection when
//! it reaches it, a client that ignores it gets REFUSED_STREAM), and the keepalive that finds a
//! dead peer (an HTTP/2 PING unanswered within the timeout closes the connection, freeing its
//! RLQS streams; TCP keepalive probes the same idle time for middleboxes).

use crate::server::Http2Limits;
use clap::Args;
use std::time::Duration;

#[derive(Debug, Clone, Args)]
pub struct Http2Args {
    /// Streams one gRPC connection may hold open at once.
    #[arg(long, env = "GRPC_MAX_CONCURRENT_STREAMS",
        default_value_t = Http2Limits::default().max_concurrent_streams,
        value_parser = clap::value_parser!(u32).range(1..))]
    pub grpc_max_concurrent_streams: u32,

    /// Idle time after which the server PINGs a gRPC connection (and TCP keepalive probes it);
    /// `0` sends no keepalive.
    #[arg(long, env = "GRPC_KEEPALIVE_TIME", default_value = "60s",
        value_parser = crate::settings::parse_duration)]
    pub grpc_keepalive_time: Duration,

    /// How long a keepalive PING may go unanswered before the connection is closed.
    #[arg(long, env = "GRPC_KEEPALIVE_TIMEOUT", default_value = "20s",
        value_parser = crate::settings::parse_duration)]
    pub grpc_keepalive_timeout: Duration,
}

impl Http2Args {
    pub fn limits(&self) -> Http2Limits {
        Http2Limits {
            max_concurrent_streams: self.grpc_max_concurrent_streams,
            keepalive: (!self.grpc_keepalive_time.is_zero()).then_some((
                self.grpc_keepalive_time,
                self.grpc_keepalive_timeout.max(Duration::from_millis(1)),
            )),
        }
    }
}
