//! The quota service's demand boards on every store (memory, a real Redis, a real 3-master
//! Cluster): postings of two replicas meet on one counter's board, expire by themselves, can be
//! withdrawn, and a board holds a bounded number of streams.

use crate::cases::store::redis_settings;
use crate::support::redis::{start_cluster, start_redis};
use sluice::clock::ManualClock;
use sluice::config::{Limit, Unit};
use sluice::store::demand::{DemandBoard, MemoryBoard, Posting, MAX_POSTINGS_PER_BOARD};
use sluice::store::redis::{RedisKind, RedisStore};
use sluice::store::{CounterKey, LimitCheck};
use std::sync::Arc;
use std::time::Duration;

const FRESH: Duration = Duration::from_secs(15);

fn key(value: &str) -> CounterKey {
    LimitCheck::for_tests("rlqs", value, Limit::fixed(600, Unit::Minute), 1).key
}

fn posting(stream: &str, rate: Option<f64>, reserved: u64) -> Posting {
    Posting {
        stream: Arc::from(stream),
        rate,
        reserved,
    }
}

/// Two boards over one backend, as two replicas would have (each its own client), the clock
/// they share, and what keeps the backend alive.
async fn two_replicas(
    kind: &str,
) -> (
    [Arc<dyn DemandBoard>; 2],
    ManualClock,
    Box<dyn std::any::Any>,
) {
    let clock = ManualClock::new(crate::support::T0);
    let redis = |urls: Vec<String>, kind: RedisKind, clock: &ManualClock| -> Arc<dyn DemandBoard> {
        Arc::new(
            RedisStore::new(&redis_settings(urls, kind))
                .expect("redis store")
                .with_test_clock(Arc::new(clock.clone()))
                .board(),
        )
    };
    match kind {
        "memory" => {
            // One process: both "replicas" are the same board.
            let b: Arc<dyn DemandBoard> =
                Arc::new(MemoryBoard::new(Arc::new(clock.clone()), 1_000_000));
            ([Arc::clone(&b), b], clock, Box::new(()))
        }
        "redis" | "valkey" => {
            let server = if kind == "redis" {
                start_redis(&[]).await
            } else {
                crate::support::redis::start_valkey().await
            };
            let boards = [
                redis(vec![server.url()], RedisKind::Single, &clock),
                redis(vec![server.url()], RedisKind::Single, &clock),
            ];
            (boards, clock, Box::new(server))
        }
        "cluster" | "valkey_cluster" => {
            let cluster = if kind == "cluster" {
                start_cluster().await
            } else {
                crate::support::redis::start_valkey_cluster().await
            };
            let boards = [
                redis(cluster.seeds(), RedisKind::Cluster, &clock),
                redis(cluster.seeds(), RedisKind::Cluster, &clock),
            ];
            (boards, clock, Box::new(cluster))
        }
        other => panic!("unknown store kind {other}"),
    }
}

fn sorted(mut p: Vec<Posting>) -> Vec<Posting> {
    p.sort_by(|a, b| a.stream.cmp(&b.stream));
    p
}

test_with_all_stores!(
    postings_of_two_replicas_meet_expire_and_withdraw,
    kind => |kind: &'static str| async move {
        let ([a, b], clock, _backend) = two_replicas(kind).await;
        let k = key("k1");
        let seen = a.post(&k, &posting("r1-1", Some(4.0), 24), FRESH).await.expect("post");
        assert_eq!(seen, vec![posting("r1-1", Some(4.0), 24)]);
        clock.advance(Duration::from_secs(5));
        let seen = sorted(b.post(&k, &posting("r2-1", None, 0), FRESH).await.expect("post"));
        assert_eq!(
            seen,
            vec![posting("r1-1", Some(4.0), 24), posting("r2-1", None, 0)],
            "the second replica reads the first one's posting"
        );
        // Another counter's board is another board.
        let other = b.post(&key("k2"), &posting("r2-1", Some(1.0), 6), FRESH).await.expect("post");
        assert_eq!(other.len(), 1);
        // A posting is replaced, not added, when its stream posts again.
        let seen = sorted(a.post(&k, &posting("r1-1", Some(2.5), 12), FRESH).await.expect("post"));
        assert_eq!(seen[0], posting("r1-1", Some(2.5), 12));
        assert_eq!(seen.len(), 2);
        // r2-1 posted at +5 s; 16 s later it has expired, r1-1 (posted at +5 s too) as well:
        // a third stream finds only itself.
        clock.advance(Duration::from_secs(16));
        let seen = a.post(&k, &posting("r1-2", Some(1.0), 0), FRESH).await.expect("post");
        assert_eq!(seen, vec![posting("r1-2", Some(1.0), 0)], "expired postings are gone");
        b.post(&k, &posting("r2-2", Some(3.0), 18), FRESH).await.expect("post");
        a.withdraw(&k, "r1-2").await.expect("withdraw");
        let seen = b.post(&k, &posting("r2-2", Some(3.0), 18), FRESH).await.expect("post");
        assert_eq!(seen, vec![posting("r2-2", Some(3.0), 18)], "withdrawn");
    }
);

test_with_all_stores!(
    a_board_holds_a_bounded_number_of_streams,
    kind => |kind: &'static str| async move {
        let ([a, _], _clock, _backend) = two_replicas(kind).await;
        let k = key("crowded");
        for n in 0..MAX_POSTINGS_PER_BOARD {
            a.post(&k, &posting(&format!("s-{n}"), Some(1.0), 1), FRESH).await.expect("post");
        }
        let seen = a.post(&k, &posting("late", Some(1.0), 1), FRESH).await.expect("post");
        assert_eq!(seen.len(), MAX_POSTINGS_PER_BOARD);
        assert!(!seen.iter().any(|p| &*p.stream == "late"), "no room for one more");
        // A stream already on the board still updates its posting.
        let seen = a.post(&k, &posting("s-7", Some(9.0), 3), FRESH).await.expect("post");
        assert!(seen.contains(&posting("s-7", Some(9.0), 3)));
    }
);

#[tokio::test]
async fn the_memory_board_is_bounded_overall_and_sweeps_expired_postings() {
    let clock = ManualClock::new(crate::support::T0);
    let board = MemoryBoard::new(Arc::new(clock.clone()), 3);
    for n in 0..3 {
        board
            .post(&key(&format!("k{n}")), &posting("s", None, 0), FRESH)
            .await
            .expect("post");
    }
    let seen = board
        .post(&key("k3"), &posting("s", None, 0), FRESH)
        .await
        .expect("post");
    assert!(seen.is_empty(), "full: the fourth posting is not kept");
    clock.advance(FRESH + Duration::from_secs(1));
    let seen = board
        .post(&key("k3"), &posting("s", None, 0), FRESH)
        .await
        .expect("post");
    assert_eq!(seen.len(), 1, "the expired ones were swept to make room");
}
