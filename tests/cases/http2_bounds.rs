//! The gRPC listener's HTTP/2 bounds (issue 38): a connection may hold at most
//! `GRPC_MAX_CONCURRENT_STREAMS` streams (advertised in the server's SETTINGS, which Envoy's
//! connection pool and every HTTP/2 client obey; h2 refuses a stream past it), and a peer that
//! stops answering keepalive PINGs is disconnected, freeing whatever streams it held.

use crate::support::binary::{serve, SluiceProcess};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CONFIG: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/config/examples/basic.yaml");

/// The SETTINGS_MAX_CONCURRENT_STREAMS a real HTTP/2 client (h2, as under tonic and hyper)
/// gets from sluice, after one request has gone both ways (so the server's SETTINGS applied).
async fn advertised_streams(sluice: &SluiceProcess) -> usize {
    let tcp = TcpStream::connect(sluice.grpc).await.expect("connect");
    let (mut send, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(connection);
    let request = http::Request::post(format!(
        "http://{}/grpc.health.v1.Health/Check",
        sluice.grpc
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(())
    .expect("request");
    let (response, mut body) = send.send_request(request, false).expect("send");
    // An empty HealthCheckRequest: a 5-byte gRPC frame of length 0.
    body.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), true)
        .expect("body");
    let response = response.await.expect("response");
    assert_eq!(response.status(), 200);
    send.current_max_send_streams()
}

#[tokio::test]
async fn a_connection_holds_at_most_the_stated_number_of_streams() {
    let mut command = serve(CONFIG);
    command.env("GRPC_MAX_CONCURRENT_STREAMS", "4");
    let sluice = SluiceProcess::spawn(command).await;
    assert_eq!(advertised_streams(&sluice).await, 4);
    let default = SluiceProcess::spawn(serve(CONFIG)).await;
    assert_eq!(advertised_streams(&default).await, 1024, "the default");
}

/// A peer that completes the HTTP/2 preface and then never reads or answers again: sluice's
/// keepalive PING goes unanswered and sluice closes the connection (EOF on the socket). The
/// wait is for sluice to act, bounded only so a regression fails instead of hanging.
#[tokio::test]
async fn a_peer_that_stops_answering_pings_is_disconnected() {
    let mut command = serve(CONFIG);
    command.env("GRPC_KEEPALIVE_TIME", "1s");
    command.env("GRPC_KEEPALIVE_TIMEOUT", "1s");
    let sluice = SluiceProcess::spawn(command).await;
    let mut tcp = TcpStream::connect(sluice.grpc).await.expect("connect");
    // The client preface and an empty SETTINGS frame; then silence (no SETTINGS ack, no PONG).
    tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .expect("preface");
    let mut got = Vec::new();
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        tcp.read_to_end(&mut got),
    )
    .await;
    assert!(
        matches!(read, Ok(Ok(_)) | Ok(Err(_))),
        "the connection was still open after 60 s of unanswered keepalive"
    );
    // Among what sluice sent: a PING (frame type 6) that was never answered.
    let mut frames = Vec::new();
    let mut at = 0;
    while at + 9 <= got.len() {
        let len = (usize::from(got[at]) << 16)
            | (usize::from(got[at + 1]) << 8)
            | usize::from(got[at + 2]);
        frames.push(got[at + 3]);
        at += 9 + len;
    }
    assert!(
        frames.contains(&6),
        "sluice sent a keepalive PING: frame types {frames:?}"
    );
}
