//! A test-owned TCP proxy between sluice and a real `redis-server` that can hold Redis script
//! calls: while holding, every `EVAL`/`EVALSHA` sluice sends (and whatever follows it on the
//! same connection, so order is kept) is buffered instead of forwarded, and counted. Other
//! commands (connection setup such as `CLIENT SETINFO`, health `PING`s) pass while nothing is
//! buffered on their connection, so new pooled connections can still be opened during a hold.
//! Replies from Redis are always forwarded. The proxy parses the RESP commands sluice sends
//! (arrays of bulk strings), so counts are per command, not per byte pattern, and a command split
//! over several TCP reads (or several commands in one read, pipelining) is handled.
//!
//! Dropping the proxy closes its listener and every proxied connection, held bytes included.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// What the proxy has seen, observable through [`RedisProxy::wait_for`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Whether script calls are being held.
    pub holding: bool,
    /// Connections accepted from sluice so far.
    pub connections: usize,
    /// `EVAL`/`EVALSHA` (and `_RO`) commands received from sluice so far, held or not.
    pub scripts_seen: usize,
    /// Script commands buffered right now (received, not forwarded to Redis).
    pub scripts_held: usize,
    /// Requests those held script calls decide (sluice sends concurrent requests to a
    /// standalone Redis together: ARGV[3] of `decide.lua` counts them).
    pub requests_held: usize,
    /// Commands of any kind buffered right now.
    pub commands_held: usize,
    /// Bytes from sluice the proxy could not parse as RESP commands (forwarded as they are);
    /// should stay 0, or the counts above are not to be trusted.
    pub unparsed_bytes: usize,
}

pub struct RedisProxy {
    addr: SocketAddr,
    stats: watch::Sender<ProxyStats>,
    accept: JoinHandle<()>,
}

impl RedisProxy {
    /// Listens on a free loopback port and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the Redis proxy");
        let addr = listener.local_addr().expect("proxy address");
        let (stats, _) = watch::channel(ProxyStats::default());
        let accept = tokio::spawn(accept_loop(listener, upstream, stats.clone()));
        Self {
            addr,
            stats,
            accept,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `redis://127.0.0.1:PORT` of the proxy, for sluice's `REDIS_URL`.
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// From now on, script calls are buffered instead of forwarded.
    pub fn hold(&self) {
        self.stats.send_modify(|s| s.holding = true);
    }

    /// Forwards everything buffered (per connection, in order) and stops holding.
    pub fn release(&self) {
        self.stats.send_modify(|s| s.holding = false);
    }

    pub fn stats(&self) -> ProxyStats {
        self.stats.borrow().clone()
    }

    /// Waits until `condition` holds for the proxy's stats and returns them. `cap` only bounds
    /// a hang (a broken setup); the test never depends on how long this takes.
    pub async fn wait_for(
        &self,
        what: &str,
        cap: Duration,
        condition: impl FnMut(&ProxyStats) -> bool,
    ) -> ProxyStats {
        let mut rx = self.stats.subscribe();
        let reached = match tokio::time::timeout(cap, rx.wait_for(condition)).await {
            Ok(Ok(s)) => s.clone(),
            Ok(Err(_)) => unreachable!("the proxy owns the sender"),
            Err(_) => panic!(
                "Redis proxy: {what} did not happen within {cap:?}; stats: {:?}",
                self.stats()
            ),
        };
        reached
    }
}

impl Drop for RedisProxy {
    fn drop(&mut self) {
        // The accept task owns the JoinSet of connection tasks: aborting it drops the set,
        // which aborts every connection task and closes their sockets.
        self.accept.abort();
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    stats: watch::Sender<ProxyStats>,
) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((client, _)) = accepted else { continue };
                let _ = client.set_nodelay(true);
                stats.send_modify(|s| s.connections += 1);
                connections.spawn(proxy_connection(client, upstream, stats.clone()));
            }
            // Reap finished connection tasks so the set does not grow without bound.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn proxy_connection(
    client: TcpStream,
    upstream: SocketAddr,
    stats: watch::Sender<ProxyStats>,
) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return; // dropping `client` closes it, as a dead Redis would
    };
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, server_write) = server.into_split();
    let replies = async {
        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
        let _ = client_write.shutdown().await;
    };
    let requests = forward_requests(&mut client_read, server_write, &stats);
    // Either side closing ends the connection; the other half is dropped with it.
    tokio::select! {
        () = replies => {}
        () = requests => {}
    }
}

/// Client -> Redis: parse commands; forward them, or buffer them while holding.
async fn forward_requests(
    client: &mut tokio::net::tcp::OwnedReadHalf,
    mut server: tokio::net::tcp::OwnedWriteHalf,
    stats: &watch::Sender<ProxyStats>,
) {
    let mut hold = stats.subscribe();
    let mut input: Vec<u8> = Vec::new();
    // Commands buffered on this connection, in order, and how many of them are scripts.
    let mut held: Vec<u8> = Vec::new();
    let mut held_commands = 0usize;
    let mut held_scripts = 0usize;
    let mut held_requests = 0usize;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        tokio::select! {
            read = client.read(&mut buf) => {
                let n = match read {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                input.extend_from_slice(&buf[..n]);
                let mut out: Vec<u8> = Vec::new();
                let mut consumed = 0;
                while consumed < input.len() {
                    match parse_command(&input[consumed..]) {
                        Parsed::Incomplete => break,
                        Parsed::Invalid => {
                            // Not RESP as expected: pass the rest through untouched.
                            let rest = input.len() - consumed;
                            stats.send_modify(|s| s.unparsed_bytes += rest);
                            if held_commands > 0 {
                                held.extend_from_slice(&input[consumed..]);
                            } else {
                                out.extend_from_slice(&input[consumed..]);
                            }
                            consumed = input.len();
                        }
                        Parsed::Command { len, name, requests } => {
                            let frame = &input[consumed..consumed + len];
                            let script = is_script(&name);
                            let requests = if script { requests } else { 0 };
                            let holding = stats.borrow().holding;
                            if held_commands > 0 || (holding && script) {
                                held.extend_from_slice(frame);
                                held_commands += 1;
                                held_scripts += usize::from(script);
                                held_requests += requests;
                                stats.send_modify(|s| {
                                    s.commands_held += 1;
                                    s.requests_held += requests;
                                    s.scripts_held += usize::from(script);
                                    s.scripts_seen += usize::from(script);
                                });
                            } else {
                                out.extend_from_slice(frame);
                                if script {
                                    stats.send_modify(|s| s.scripts_seen += 1);
                                }
                            }
                            consumed += len;
                        }
                    }
                }
                input.drain(..consumed);
                if !out.is_empty() && server.write_all(&out).await.is_err() {
                    return;
                }
            }
            // (The watch guard is dropped inside the async block: `send_modify` below needs the
            // lock.)
            released = async { hold.wait_for(|s| !s.holding).await.is_ok() },
                if held_commands > 0 => {
                if !released {
                    return;
                }
                if server.write_all(&held).await.is_err() {
                    return;
                }
                held.clear();
                stats.send_modify(|s| {
                    s.commands_held -= held_commands;
                    s.scripts_held -= held_scripts;
                    s.requests_held -= held_requests;
                });
                held_commands = 0;
                held_scripts = 0;
                held_requests = 0;
            }
        }
    }
}

fn is_script(name: &[u8]) -> bool {
    ["EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO"]
        .iter()
        .any(|n| name.eq_ignore_ascii_case(n.as_bytes()))
}

enum Parsed {
    /// One whole command: its length in bytes, its first word (the command name) and, for a
    /// script call of `decide.lua`, the number of requests it decides (1 otherwise).
    Command {
        len: usize,
        name: Vec<u8>,
        requests: usize,
    },
    Incomplete,
    Invalid,
}

/// Parses one RESP command as clients send them: `*<n>\r\n` then `n` bulk strings
/// `$<len>\r\n<bytes>\r\n`.
fn parse_command(input: &[u8]) -> Parsed {
    let Some((count, mut pos)) = parse_header(input, 0, b'*') else {
        return incomplete_or_invalid(input, b'*');
    };
    let mut name = Vec::new();
    let mut numkeys = usize::MAX;
    let mut requests = 1;
    let (mut packed, mut counters) = (false, 0);
    for i in 0..count {
        let Some((len, start)) = parse_header(input, pos, b'$') else {
            return incomplete_or_invalid(&input[pos..], b'$');
        };
        let end = start + len;
        if input.len() < end + 2 {
            return Parsed::Incomplete;
        }
        if &input[end..end + 2] != b"\r\n" {
            return Parsed::Invalid;
        }
        let word = &input[start..end];
        let number = || std::str::from_utf8(word).ok()?.parse::<usize>().ok();
        if i == 0 {
            name = word.to_vec();
        } else if i == 2 {
            numkeys = number().unwrap_or(usize::MAX);
        } else if numkeys != usize::MAX && i == 3 + numkeys + 1 {
            // EVALSHA sha numkeys KEYS... ARGV[1] ARGV[2] ARGV[3]: ARGV[2] "p" is the packed
            // layout, whose request count follows the counters' limits and periods.
            packed = word == b"p";
        } else if numkeys != usize::MAX && i == 3 + numkeys + 2 {
            requests = number().unwrap_or(1);
            if packed {
                counters = requests;
                requests = 1;
            }
        } else if packed && numkeys != usize::MAX && i == 3 + numkeys + 3 + 2 * counters {
            requests = number().unwrap_or(1);
        }
        pos = end + 2;
    }
    Parsed::Command {
        len: pos,
        name,
        requests,
    }
}

/// `<marker><decimal>\r\n` at `pos`: the number and the position after the line.
fn parse_header(input: &[u8], pos: usize, marker: u8) -> Option<(usize, usize)> {
    let rest = input.get(pos..)?;
    if rest.first() != Some(&marker) {
        return None;
    }
    let line_end = rest.windows(2).position(|w| w == b"\r\n")?;
    let number = std::str::from_utf8(&rest[1..line_end]).ok()?.parse().ok()?;
    Some((number, pos + line_end + 2))
}

/// Why [`parse_header`] failed: not enough bytes yet, or bytes that are not RESP.
fn incomplete_or_invalid(rest: &[u8], marker: u8) -> Parsed {
    match rest.first() {
        None => Parsed::Incomplete,
        Some(b) if *b != marker => Parsed::Invalid,
        Some(_) => {
            match rest.windows(2).position(|w| w == b"\r\n") {
                // A whole line that does not parse as a number.
                Some(_) => Parsed::Invalid,
                None if rest.len() > 32 => Parsed::Invalid,
                None => Parsed::Incomplete,
            }
        }
    }
}
