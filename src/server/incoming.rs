//! The gRPC accept loop's connection stream. It ends on drain only after taking every connection
//! already waiting in the kernel's accept backlog, so a client whose TCP handshake completed
//! gets served and a graceful HTTP/2 GOAWAY instead of a reset when the listener closes. The
//! same loop serves a TCP port and, with `GRPC_UDS`, a Unix socket.

use super::signal::ShutdownWatch;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::DuplexStream;
use tokio::net::{TcpListener, TcpStream, UnixListener};
use tokio_stream::Stream;

/// A listening socket the loop accepts from.
pub(crate) trait Accept {
    type Conn;
    fn poll_accept_conn(&self, cx: &mut Context<'_>) -> Poll<io::Result<Self::Conn>>;
}

/// A TCP listener, and the idle time after which its connections are probed (TCP keepalive).
pub(crate) struct Tcp(pub TcpListener, pub Option<Duration>);

impl Accept for Tcp {
    type Conn = TcpStream;
    fn poll_accept_conn(&self, cx: &mut Context<'_>) -> Poll<io::Result<TcpStream>> {
        self.0.poll_accept(cx).map_ok(|(stream, _peer)| {
            // Envoy's 20 ms budget makes Nagle's delay on small HTTP/2 frames unaffordable;
            // a failing socket option is not worth dropping the connection over.
            let _ = stream.set_nodelay(true);
            if let Some(idle) = self.1 {
                let probes = socket2::TcpKeepalive::new()
                    .with_time(idle)
                    .with_interval(Duration::from_secs(10));
                let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&probes);
            }
            stream
        })
    }
}

impl Accept for UnixListener {
    type Conn = DuplexStream;
    /// Each connection goes through the relay that makes a socket-path `:authority` valid
    /// (grpc-go and gRPC-core clients send one; see `uds_authority`).
    fn poll_accept_conn(&self, cx: &mut Context<'_>) -> Poll<io::Result<DuplexStream>> {
        self.poll_accept(cx)
            .map_ok(|(stream, _peer)| super::uds_authority::relay(stream))
    }
}

/// Accepted connections until the drain trigger, then the backlog, then the end.
pub(crate) struct DrainingIncoming<L> {
    listener: L,
    drain: Pin<Box<dyn Future<Output = ()> + Send>>,
    draining: bool,
}

impl<L> DrainingIncoming<L> {
    pub(crate) fn new(listener: L, drain: ShutdownWatch) -> Self {
        Self {
            listener,
            drain: Box::pin(drain.triggered()),
            draining: false,
        }
    }
}

impl<L: Accept + Unpin> Stream for DrainingIncoming<L> {
    type Item = io::Result<L::Conn>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if !self.draining && self.drain.as_mut().poll(cx).is_ready() {
            self.draining = true;
        }
        match self.listener.poll_accept_conn(cx) {
            Poll::Ready(Ok(stream)) => Poll::Ready(Some(Ok(stream))),
            // While serving, tonic logs accept errors and keeps going; while draining, an error
            // (say, out of file descriptors) ends the backlog sweep instead of spinning on it.
            Poll::Ready(Err(_)) if self.draining => Poll::Ready(None),
            Poll::Ready(Err(e)) => Poll::Ready(Some(Err(e))),
            // Backlog empty: dropping the stream now closes the listening socket.
            Poll::Pending if self.draining => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}
