//! A test-owned TCP link with latency and partitions: what lies between a region and its home
//! store. Every byte is delivered `delay` after it was read, in order, each way (a round trip
//! costs twice the delay); [`Link::cut`] partitions the link (every open connection is closed
//! and new ones are refused until [`Link::heal`]).
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// A delaying, cuttable TCP proxy to one upstream.
pub struct Link {
    addr: SocketAddr,
    cut: Arc<watch::Sender<bool>>,
    /// Connections accepted so far.
    connections: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl Link {
    /// Listens on a free loopback port; each connection goes to `upstream`, `delay` each way.
    pub async fn start(upstream: SocketAddr, delay: Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the link");
        let addr = listener.local_addr().expect("link address");
        let cut = Arc::new(watch::Sender::new(false));
        let connections = Arc::new(AtomicU64::new(0));
        let accept = {
            let (cut, connections) = (Arc::clone(&cut), Arc::clone(&connections));
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    if *cut.borrow() {
                        drop(client);
                        continue;
                    }
                    connections.fetch_add(1, Ordering::Relaxed);
                    let cut = cut.subscribe();
                    tokio::spawn(connection(client, upstream, delay, cut));
                }
            })
        };
        Self {
            addr,
            cut,
            connections,
            accept,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `redis://127.0.0.1:PORT` of the link.
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Partitions: open connections close, new ones are refused.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Ends the partition.
    pub fn heal(&self) {
        self.cut.send_replace(false);
    }

    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut.send_replace(true);
    }
}

async fn connection(
    client: TcpStream,
    upstream: SocketAddr,
    delay: Duration,
    cut: watch::Receiver<bool>,
) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let closed = Arc::new(AtomicBool::new(false));
    let up = pipe(cr, sw, delay, cut.clone(), Arc::clone(&closed));
    let down = pipe(sr, cw, delay, cut, closed);
    tokio::join!(up, down);
}

/// Copies `from` to `to`, each chunk delivered `delay` after it was read, until either side
/// closes or the link is cut.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
    mut cut: watch::Receiver<bool>,
    closed: Arc<AtomicBool>,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let mut cut2 = cut.clone();
    let writer = async move {
        loop {
            let next = tokio::select! {
                biased;
                _ = cut2.wait_for(|c| *c) => None,
                m = rx.recv() => m,
            };
            let Some((due, bytes)) = next else { break };
            tokio::select! {
                biased;
                _ = cut2.wait_for(|c| *c) => break,
                _ = tokio::time::sleep_until(due) => {}
            }
            if *cut2.borrow() {
                break; // never a byte through the cut
            }
            if to.write_all(&bytes).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    };
    let flag = Arc::clone(&closed);
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = tokio::select! {
                r = from.read(&mut buf) => match r {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                },
                _ = cut.wait_for(|c| *c) => break,
            };
            if flag.load(Ordering::Relaxed) {
                break;
            }
            let due = tokio::time::Instant::now() + delay;
            if tx.send((due, buf[..n].to_vec())).is_err() {
                break;
            }
        }
        drop(tx);
    };
    tokio::join!(reader, writer);
    closed.store(true, Ordering::Relaxed);
}
