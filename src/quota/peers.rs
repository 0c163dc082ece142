//! Why this file: `RLQS_MAX_STREAMS` is first come, first served, and a connection carries
//! 1 024 streams, so 10 connections of one client could hold every place for a day and keep
//! every Envoy out (issue 50, review 5a). Streams are counted per peer (its IP address; every
//! stream over the Unix socket is one peer, `None`), and one past `RLQS_MAX_STREAMS_PER_PEER`
//! is refused.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;

/// Open streams per peer.
#[derive(Debug, Default)]
pub(super) struct Peers(Mutex<HashMap<Option<IpAddr>, usize>>);

impl Peers {
    fn with<R>(&self, f: impl FnOnce(&mut HashMap<Option<IpAddr>, usize>) -> R) -> R {
        f(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Counts a stream of `peer` in, unless it already holds `cap`.
    pub(super) fn enter(&self, peer: Option<IpAddr>, cap: usize) -> bool {
        self.with(|m| {
            let n = m.entry(peer).or_default();
            if *n >= cap {
                return false;
            }
            *n += 1;
            true
        })
    }

    /// A stream of `peer` ended.
    pub(super) fn leave(&self, peer: Option<IpAddr>) {
        self.with(|m| {
            if let Some(n) = m.get_mut(&peer) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    m.remove(&peer);
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_peer_holds_its_cap_and_no_more() {
        let peers = Peers::default();
        let (a, b) = (
            Some(IpAddr::from([10, 0, 0, 1])),
            Some(IpAddr::from([10, 0, 0, 2])),
        );
        assert!(peers.enter(a, 2) && peers.enter(a, 2));
        assert!(!peers.enter(a, 2), "a third from the same peer");
        assert!(peers.enter(b, 2) && peers.enter(None, 2));
        peers.leave(a);
        assert!(peers.enter(a, 2), "a place freed");
        for p in [a, a, b, None] {
            peers.leave(p);
        }
        assert!(peers.with(|m| m.is_empty()), "nothing kept for peers gone");
    }
}
