//! `GRPC_UDS` for every gRPC client. grpc-go (grpcurl) and gRPC-core (Python, C++) put the
//! socket path in `:authority` (`/run/sluice.sock`, or its %-encoding), which is not a valid
//! HTTP/2 authority; hyper's HTTP/2 layer (h2) answers such a request with RST_STREAM
//! PROTOCOL_ERROR and offers no setting to accept it (hyperium/h2#487). Envoy and tonic send a
//! valid one.
//!
//! So each Unix-socket connection is relayed through an in-process pipe: bytes from sluice to
//! the client pass untouched; from the client, after the connection preface, every frame is
//! decoded and re-encoded by h2's own frame codec (HPACK included, so both sides' header tables
//! stay in step), and a `:authority` that is not a valid authority is replaced by `localhost`
//! (a gRPC server does not route on it). Everything else reaches tonic as the client sent it.
//! TCP connections never take this path. The cost is one more copy per byte on a Unix socket.
//!
//! The relay holds the client to what tonic itself accepts on TCP (hyper's HTTP/2 server): frames
//! of at most 16 KiB (the SETTINGS_MAX_FRAME_SIZE sluice advertises) and header lists of at most
//! 16 KiB (a larger one ends the connection), and a connection preface within 10 s. PRIORITY
//! frames are dropped: h2's codec cannot encode one (it panicked the relay), and the server
//! ignores them anyway (RFC 9113 deprecates them).
//!
//! Known limit: the codec drops the padding of padded DATA frames (which gRPC clients do not
//! send), so such a client's flow-control window would drift.

use bytes::Bytes;
use h2::frame::{BytesStr, Frame};
use h2::Codec;
use std::future::poll_fn;
use std::io;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::net::UnixStream;
use tokio_stream::StreamExt;

/// The HTTP/2 connection preface a client sends before its first frame.
const PREFACE_LEN: usize = 24;
/// Bytes in flight in each direction of the in-process pipe.
const PIPE_BYTES: usize = 64 * 1024;
/// Largest frame accepted from the client: HTTP/2's default SETTINGS_MAX_FRAME_SIZE, which
/// tonic advertises (sluice sets no larger one).
const MAX_FRAME: usize = 16 * 1024;
/// Largest header list accepted from the client: hyper's server default, as on TCP.
const MAX_HEADER_LIST: usize = 16 * 1024;
/// How long a client may take to send the connection preface.
const PREFACE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Relays `conn` through a task that fixes `:authority`; returns the end tonic serves.
pub(crate) fn relay(conn: UnixStream) -> DuplexStream {
    let (ours, theirs) = tokio::io::duplex(PIPE_BYTES);
    tokio::spawn(async move {
        if let Err(e) = pump(conn, ours).await {
            tracing::debug!(error = %e, "Unix socket relay ended");
        }
    });
    theirs
}

async fn pump(client: UnixStream, server: DuplexStream) -> io::Result<()> {
    let (mut client_r, mut client_w) = client.into_split();
    let (mut server_r, mut server_w) = tokio::io::split(server);
    let down = async {
        let r = tokio::io::copy(&mut server_r, &mut client_w).await;
        let _ = client_w.shutdown().await;
        r.map(|_| ())
    };
    let up = async move {
        let mut preface = [0u8; PREFACE_LEN];
        tokio::time::timeout(PREFACE_WAIT, client_r.read_exact(&mut preface))
            .await
            .map_err(|_| io::Error::other("no connection preface within 10 s"))??;
        server_w.write_all(&preface).await?;
        let mut from_client: Codec<_, Bytes> =
            Codec::new(tokio::io::join(client_r, tokio::io::sink()));
        from_client.set_max_recv_frame_size(MAX_FRAME);
        from_client.set_max_recv_header_list_size(MAX_HEADER_LIST);
        let mut to_server: Codec<_, Bytes> =
            Codec::new(tokio::io::join(tokio::io::empty(), server_w));
        while let Some(frame) = from_client.next().await {
            let frame = match frame.map_err(|e| io::Error::other(format!("{e:?}")))? {
                Frame::Priority(_) => continue,
                Frame::Headers(h) if h.is_over_size() => {
                    return Err(io::Error::other("a header list over 16 KiB"));
                }
                frame => frame,
            };
            poll_fn(|cx| to_server.poll_ready(cx)).await?;
            to_server
                .buffer(valid_authority(frame))
                .map_err(|e| io::Error::other(format!("{e:?}")))?;
            poll_fn(|cx| to_server.flush(cx)).await?;
        }
        Ok::<(), io::Error>(())
    };
    // Either direction ending ends the connection.
    tokio::select! {
        r = down => r,
        r = up => r,
    }
}

/// A request's `:authority` as h2 accepts it: unchanged when valid, else `localhost`.
fn valid_authority(frame: Frame) -> Frame {
    let Frame::Headers(mut headers) = frame else {
        return frame;
    };
    let pseudo = headers.pseudo_mut();
    let bad = pseudo
        .authority
        .as_ref()
        .is_some_and(|a| ::http::uri::Authority::try_from(a.as_bytes()).is_err());
    if bad {
        pseudo.authority = BytesStr::try_from(Bytes::from_static(b"localhost")).ok();
    }
    Frame::Headers(headers)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_socket_path_is_not_an_authority_but_localhost_is() {
        assert!(::http::uri::Authority::try_from(&b"/run/sluice.sock"[..]).is_err());
        assert!(::http::uri::Authority::try_from(&b"%2Frun%2Fsluice.sock"[..]).is_err());
        assert!(::http::uri::Authority::try_from(&b"localhost"[..]).is_ok());
        assert!(::http::uri::Authority::try_from(&b"sluice:8081"[..]).is_ok());
    }
}
