//! The gRPC accept loop's connection stream. It ends on drain only after taking every connection
//! already waiting in the kernel's accept backlog, so a client whose TCP handshake completed
//! gets served and a graceful HTTP/2 GOAWAY instead of a reset when the listener closes.

use super::signal::ShutdownWatch;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::Stream;

/// Accepted connections until the drain trigger, then the backlog, then the end.
pub(crate) struct DrainingIncoming {
    listener: TcpListener,
    drain: Pin<Box<dyn Future<Output = ()> + Send>>,
    draining: bool,
}

impl DrainingIncoming {
    pub(crate) fn new(listener: TcpListener, drain: ShutdownWatch) -> Self {
        Self {
            listener,
            drain: Box::pin(drain.triggered()),
            draining: false,
        }
    }
}

impl Stream for DrainingIncoming {
    type Item = io::Result<TcpStream>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if !self.draining && self.drain.as_mut().poll(cx).is_ready() {
            self.draining = true;
        }
        match self.listener.poll_accept(cx) {
            Poll::Ready(Ok((stream, _peer))) => {
                // Envoy's 20 ms budget makes Nagle's delay on small HTTP/2 frames unaffordable;
                // a failing socket option is not worth dropping the connection over.
                let _ = stream.set_nodelay(true);
                Poll::Ready(Some(Ok(stream)))
            }
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
