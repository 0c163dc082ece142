//! The `GRPC_UDS` relay (src/server/uds_authority.rs) held to what tonic accepts on TCP (issue
//! 38): a PRIORITY frame (valid HTTP/2, which h2's codec cannot re-encode: it panicked the
//! relay) is dropped and the connection goes on; a 1 MiB header list ends the connection; no
//! panic line either way, and the next connection is served.

use crate::support::binary::{serve, SluiceProcess};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

const CONFIG: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/config/examples/basic.yaml");
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// One HTTP/2 frame: 9-byte header and payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// HPACK's integer with an `n`-bit prefix (RFC 7541 5.1), the prefix bits' high part `high`.
fn hpack_int(out: &mut Vec<u8>, high: u8, n: u32, mut v: usize) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(high | v as u8);
        return;
    }
    out.push(high | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128 + 128) as u8);
        v /= 128;
    }
    out.push(v as u8);
}

/// Reads frames until one of `kind` with `flags` (set) comes, or the connection ends: whether
/// it came.
async fn answered(conn: &mut UnixStream, kind: u8, flags: u8) -> bool {
    loop {
        let mut head = [0u8; 9];
        if conn.read_exact(&mut head).await.is_err() {
            return false;
        }
        let len = (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
        let mut payload = vec![0u8; len];
        if conn.read_exact(&mut payload).await.is_err() {
            return false;
        }
        if head[3] == kind && head[4] & flags == flags {
            return true;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unix_socket_relay_drops_priority_and_refuses_huge_header_lists() {
    let dir = tempfile::tempdir().expect("dir");
    let sock = dir.path().join("sluice.sock");
    let mut command = serve(CONFIG);
    command.env("GRPC_UDS", &sock);
    let sluice = SluiceProcess::spawn(command).await;

    // PRIORITY on stream 3, then a PING: its ACK means the relay passed both on.
    let mut conn = UnixStream::connect(&sock).await.expect("connect");
    let mut out = PREFACE.to_vec();
    out.extend(frame(4, 0, 0, &[]));
    out.extend(frame(2, 0, 3, &[0, 0, 0, 0, 16]));
    out.extend(frame(6, 0, 0, b"sluice!!"));
    conn.write_all(&out).await.expect("write");
    assert!(
        answered(&mut conn, 6, 1).await,
        "the PING after a PRIORITY frame was answered:\n{}",
        sluice.log()
    );

    // A request whose header list is 1 MiB (one literal header), in a HEADERS frame and
    // CONTINUATION frames of 16 KiB: the relay ends the connection.
    let mut block = vec![0x83, 0x86]; // :method POST, :scheme http
    block.push(0x44); // :path, literal with incremental indexing, indexed name 4
    hpack_int(&mut block, 0, 7, 1);
    block.push(b'/');
    block.push(0x00);
    hpack_int(&mut block, 0, 7, 1);
    block.push(b'x');
    hpack_int(&mut block, 0, 7, 1 << 20);
    block.extend(std::iter::repeat_n(b'a', 1 << 20));
    let mut conn = UnixStream::connect(&sock).await.expect("connect");
    let mut out = PREFACE.to_vec();
    out.extend(frame(4, 0, 0, &[]));
    let chunks: Vec<&[u8]> = block.chunks(16 * 1024).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let (kind, end) = if i == 0 { (1, 0) } else { (9, 0) };
        let flags = if i + 1 == chunks.len() { 4 | end } else { end };
        out.extend(frame(kind, flags, 1, chunk));
    }
    out.extend(frame(6, 0, 0, b"sluice!!"));
    // The relay may close before it has read everything: a write error is the refusal too.
    let _ = conn.write_all(&out).await;
    assert!(
        !answered(&mut conn, 6, 1).await,
        "a 1 MiB header list ended the connection"
    );

    // The next connection: an ordinary gRPC call through the socket.
    let conn = UnixStream::connect(&sock).await.expect("connect");
    let (mut h2, connection) = h2::client::handshake(conn).await.expect("h2 handshake");
    tokio::spawn(connection);
    let request = http::Request::post("http://localhost/grpc.health.v1.Health/Check")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("request");
    let (response, mut body) = h2.send_request(request, false).expect("send");
    body.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), true)
        .expect("body");
    assert_eq!(response.await.expect("response").status(), 200);
    let log = sluice.log();
    assert!(!log.contains("panicked"), "{log}");
}
