//! Self-tests of the Redis test support: real redis-server processes start, answer, stop, come
//! back on the same port and are torn down on drop (also on panic), and three-master clusters
//! form, route keys and can be started side by side.

use crate::support::redis::{RedisCluster, RedisServer};
use std::path::PathBuf;

/// The redis-server process id, from `INFO server`.
fn server_pid(redis: &RedisServer) -> u32 {
    redis
        .cli(&["INFO", "server"])
        .lines()
        .find_map(|l| l.trim().strip_prefix("process_id:")?.parse().ok())
        .expect("INFO server has process_id")
}

#[test]
fn standalone_starts_and_answers_commands() {
    let redis = RedisServer::start();
    assert!(redis.ping());
    assert_eq!(redis.url(), format!("redis://127.0.0.1:{}", redis.port()));
    assert_eq!(redis.cli(&["SET", "greeting", "hello"]).trim(), "OK");
    assert_eq!(redis.cli(&["GET", "greeting"]).trim(), "hello");
    assert_eq!(redis.cli(&["SET", "short", "1", "EX", "100"]).trim(), "OK");
    let keys = redis.keys_with_ttl();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert_eq!(keys[0], ("greeting".to_string(), -1));
    assert_eq!(keys[1].0, "short");
    assert!((1..=100).contains(&keys[1].1), "{keys:?}");
}

#[test]
fn standalone_stops_and_restarts_on_the_same_port() {
    let mut redis = RedisServer::start();
    let port = redis.port();
    assert_eq!(redis.cli(&["SET", "k", "v"]).trim(), "OK");

    redis.stop();
    assert!(!redis.is_running());
    assert!(!redis.ping());
    assert!(redis.try_cli(&["PING"]).is_err());

    redis.restart();
    assert_eq!(redis.port(), port);
    assert!(redis.is_running());
    assert!(redis.ping());
    assert_eq!(redis.cli(&["PING"]).trim(), "PONG");
    // Nothing is persisted: the restarted server is empty.
    assert_eq!(redis.cli(&["DBSIZE"]).trim(), "0");
}

#[test]
fn servers_are_torn_down_on_drop_and_on_panic() {
    let redis = RedisServer::start();
    let (pid, dir) = (server_pid(&redis), redis.dir().to_path_buf());
    drop(redis);
    assert!(!PathBuf::from(format!("/proc/{pid}")).exists());
    assert!(!dir.exists());

    let (tx, rx) = std::sync::mpsc::channel();
    let panicked = std::thread::spawn(move || {
        let redis = RedisServer::start();
        tx.send((server_pid(&redis), redis.dir().to_path_buf()))
            .expect("send");
        panic!("a failing test holding a Redis server");
    })
    .join();
    assert!(panicked.is_err());
    let (pid, dir) = rx.recv().expect("the thread started a server");
    assert!(!PathBuf::from(format!("/proc/{pid}")).exists());
    assert!(!dir.exists());
}

#[test]
fn cluster_forms_and_routes_keys() {
    let cluster = RedisCluster::start();
    let ports = cluster.ports();
    assert_eq!(ports.len(), 3);
    assert_eq!(
        cluster.seeds(),
        ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
    );
    for node in 0..3 {
        let info = cluster.cli(node, &["CLUSTER", "INFO"]);
        assert!(info.contains("cluster_state:ok"), "{info}");
        assert!(info.contains("cluster_slots_assigned:16384"), "{info}");
        assert!(info.contains("cluster_size:3"), "{info}");
    }
    assert_eq!(cluster.cli_cluster(&["SET", "{tag}a", "1"]).trim(), "OK");
    assert_eq!(cluster.cli_cluster(&["GET", "{tag}a"]).trim(), "1");
    assert_eq!(cluster.keys_with_ttl(), vec![("{tag}a".to_string(), -1)]);
}

#[test]
fn two_clusters_start_concurrently() {
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(RedisCluster::start);
        let b = s.spawn(RedisCluster::start);
        (
            a.join().expect("first cluster"),
            b.join().expect("second cluster"),
        )
    });
    let mut all: Vec<u16> = a.ports().into_iter().chain(b.ports()).collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 6);
    assert_eq!(a.cli_cluster(&["SET", "{x}only-in-a", "1"]).trim(), "OK");
    assert_eq!(b.cli_cluster(&["SET", "{y}only-in-b", "2"]).trim(), "OK");
    assert_eq!(a.keys_with_ttl(), vec![("{x}only-in-a".to_string(), -1)]);
    assert_eq!(b.keys_with_ttl(), vec![("{y}only-in-b".to_string(), -1)]);
}
