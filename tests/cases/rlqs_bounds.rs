//! What one RLQS peer can take from the others (issue 38, item 2), over real gRPC with Envoy's
//! message types on a manual clock: at the bucket cap each stream keeps its fair share (a peer
//! full of junk sheds its excess, a newcomer gets its normal assignment, past its share it is
//! denied, never ALLOW_ALL); reports sent faster than `RLQS_MIN_REPORT_INTERVAL` are merged, not
//! worked one by one, and lose no usage; a stream ends at the connection's age, its assignments
//! re-sent for the reconnect.

use super::quota::{strategy_of, ttl_of, usage, Stream, YAML};
use crate::support::{self, http, rules, TestServer};
use sluice::clock::ManualClock;
use sluice::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use sluice::proto::envoy::service::rate_limit_quota::v3::RateLimitQuotaUsageReports;
use sluice::quota::QuotaSettings;
use sluice::ServerConfig;
use std::sync::Arc;
use std::time::Duration;

/// Bounded waits, so a stream that never answers fails the test instead of hanging it.
const BOUND: Duration = Duration::from_secs(60);

fn limited_junk(prefix: &str, n: usize) -> Vec<BucketQuotaUsage> {
    (0..n)
        .map(|i| usage(&[("x-api-key", &format!("{prefix}{i}"))], 1, 0))
        .collect()
}

/// Each of `lines` is a line of `/metrics`.
async fn assert_metrics(server: &TestServer, lines: &[&str]) {
    let (_, metrics) = http(server.http_addr, "GET", "/metrics", "").await;
    for line in lines {
        assert!(metrics.lines().any(|l| l == *line), "{line} in:\n{metrics}");
    }
}

/// Kinds of action in a response: (token buckets, DENY_ALL, abandons).
fn kinds(
    actions: &[sluice::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction],
) -> (usize, usize, usize) {
    let count = |want: fn(Result<u32, &str>) -> bool| {
        actions.iter().filter(|a| want(strategy_of(a))).count()
    };
    (
        count(|s| s.is_ok()),
        count(|s| s == Err("deny_all")),
        count(|s| s == Err("abandon")),
    )
}

/// Scaled down: 100 buckets per stream, 200 in all. Two peers fill the cap with junk under the
/// limited key; a third stream's new bucket gets its token bucket (before: DENY_ALL for 15 s,
/// the two peers keeping every newcomer out); the third stream grows to its fair share (200 / 3
/// streams = 66) and past it is denied; at their next reports the two junk peers shed down to
/// 66 each, their least used first.
#[tokio::test]
async fn at_the_bucket_cap_each_stream_keeps_its_fair_share() {
    let clock = ManualClock::new(support::T0);
    let config = ServerConfig {
        quota: QuotaSettings {
            max_buckets_per_stream: 100,
            max_buckets: 200,
            ..QuotaSettings::default()
        },
        ..ServerConfig::for_tests(rules(YAML), Arc::new(clock.clone()))
    };
    let server = TestServer::start_config(config, clock.clone()).await;
    let (mut a, mut b) = (Stream::open(&server).await, Stream::open(&server).await);
    assert_eq!(
        kinds(&a.report("rlqs", limited_junk("a", 100)).await),
        (100, 0, 0)
    );
    assert_eq!(
        kinds(&b.report("rlqs", limited_junk("b", 100)).await),
        (100, 0, 0)
    );
    let mut c = Stream::open(&server).await;
    c.newcomer_is_paced().await;
    // The newcomer asks for 70 more: 65 fit its share of 66, 5 are denied (never ALLOW_ALL).
    clock.advance(Duration::from_secs(1));
    let mut more = vec![usage(&[("x-api-key", "newcomer")], 1, 0)];
    more.extend(limited_junk("c", 70));
    assert_eq!(kinds(&c.report("rlqs", more).await), (66, 5, 0));
    // The junk peers report again: each sheds 34 of its 100.
    clock.advance(Duration::from_secs(1));
    for (s, prefix) in [(&mut a, "a"), (&mut b, "b")] {
        let actions = s.report("rlqs", limited_junk(prefix, 100)).await;
        assert_eq!(kinds(&actions), (66, 0, 34), "stream {prefix}");
    }
    let lines = [
        "sluice_rlqs_refused_total{reason=\"over_total_bucket_cap\"} 5",
        "sluice_rlqs_refused_total{reason=\"over_fair_share\"} 68",
        "sluice_rlqs_buckets{domain=\"rlqs\"} 198",
    ];
    assert_metrics(&server, &lines).await;
    server.stop().await;
}

/// Twenty reports sent back to back, after a first one: sluice works them as one (one response,
/// two bucket reports counted in all) once `RLQS_MIN_REPORT_INTERVAL` has passed, and every
/// request they reported is counted. (Before: twenty responses, twenty rounds of store work.)
#[tokio::test]
async fn reports_sooner_than_the_interval_are_merged_and_lose_nothing() {
    let server = TestServer::start(YAML).await;
    let mut s = Stream::open(&server).await;
    let first = s
        .report("rlqs", vec![usage(&[("x-api-key", "k")], 0, 0)])
        .await;
    assert_eq!(first.len(), 1);
    let tx = s.tx.clone();
    let sender = tokio::spawn(async move {
        for _ in 0..20 {
            let report = RateLimitQuotaUsageReports {
                domain: "rlqs".into(),
                bucket_quota_usages: vec![usage(&[("x-api-key", "k")], 1, 1)],
            };
            tx.send(report).await.expect("report sent");
        }
    });
    sender.await.expect("sender");
    let merged = tokio::time::timeout(BOUND, s.rx.message())
        .await
        .expect("answered")
        .expect("stream alive")
        .expect("a response");
    assert_eq!(merged.bucket_action.len(), 1, "one bucket, one action");
    // One more, once the clock has moved past the interval: answered at once, and the counts
    // show every report was taken, the twenty as one.
    server.clock.advance(Duration::from_secs(2));
    let last = s
        .report("rlqs", vec![usage(&[("x-api-key", "k")], 0, 0)])
        .await;
    assert_eq!(last.len(), 1);
    let lines = [
        "sluice_rlqs_bucket_reports_total{domain=\"rlqs\"} 3",
        "sluice_rlqs_reported_requests_total{domain=\"rlqs\",result=\"allowed\"} 20",
        "sluice_rlqs_reported_requests_total{domain=\"rlqs\",result=\"denied\"} 20",
    ];
    assert_metrics(&server, &lines).await;
    server.stop().await;
}

/// `GRPC_MAX_CONNECTION_AGE` (here 300 ms, jittered 0.9-1.1x): an RLQS stream, which never ends
/// by itself and so kept its connection open past any age, is ended once that old: its
/// assignment sent again with the 60 s reconnect TTL, then OK. (Before: it stayed open.)
#[tokio::test]
async fn an_rlqs_stream_ends_at_the_connections_age() {
    let clock = ManualClock::new(support::T0);
    let config = ServerConfig {
        connection_age: Some(sluice::server::ConnectionAge {
            max: Duration::from_millis(300),
        }),
        ..ServerConfig::for_tests(rules(YAML), Arc::new(clock.clone()))
    };
    let server = TestServer::start_config(config, clock).await;
    let mut s = Stream::open(&server).await;
    let actions = s
        .report("rlqs", vec![usage(&[("x-api-key", "k")], 1, 0)])
        .await;
    assert_eq!(
        (strategy_of(&actions[0]), ttl_of(&actions[0])),
        (Ok(10), 15)
    );
    let farewell = tokio::time::timeout(BOUND, s.rx.message())
        .await
        .expect("the stream ends at its age")
        .expect("stream alive")
        .expect("the farewell");
    let a = &farewell.bucket_action[0];
    assert_eq!(
        (strategy_of(a), ttl_of(a)),
        (Ok(10), 60),
        "re-sent for the reconnect"
    );
    let end = tokio::time::timeout(BOUND, s.rx.message())
        .await
        .expect("then it ends");
    assert!(matches!(end, Ok(None)), "ended with OK: {end:?}");
    server.stop().await;
}

/// Issue 50 (review 9): `GRPC_MAX_CONNECTION_AGE=18446744073709551615` was taken, then the
/// connection age (and every RLQS stream's) was jittered with `Duration::mul_f64`, which
/// panicked at start. Now the real binary refuses it as a settings error naming the variable,
/// and exits without a panic; Go's longest duration (what envoyproxy takes) still starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absurd_connection_age_is_a_settings_error_not_a_panic() {
    use crate::support::binary::{serve, SluiceProcess};
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("rlqs.yaml");
    std::fs::write(&config, YAML).expect("config");
    let mut cmd = serve(&config);
    cmd.env("GRPC_MAX_CONNECTION_AGE", "18446744073709551615");
    let out = tokio::time::timeout(BOUND, cmd.output())
        .await
        .expect("exits at once")
        .expect("ran");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "a settings error: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr
            .contains("GRPC_MAX_CONNECTION_AGE 18446744073709551615 is longer than 2562047h47m16s"),
        "{stderr}"
    );
    let mut cmd = serve(&config);
    cmd.env("GRPC_MAX_CONNECTION_AGE", "2562047h47m16s");
    let sluice = SluiceProcess::spawn(cmd).await;
    let mut s = open_at(sluice.grpc).await;
    let actions = s
        .report("rlqs", vec![usage(&[("x-api-key", "k")], 1, 0)])
        .await;
    // On the binary's real clock: a token bucket of whatever the window still has.
    assert!(strategy_of(&actions[0]).is_ok(), "served: {actions:?}");
}

/// An RLQS stream to `addr`.
async fn open_at(addr: std::net::SocketAddr) -> Stream {
    use sluice::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("RLQS connect");
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let rx = client
        .stream_rate_limit_quotas(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("stream opens")
        .into_inner();
    Stream { tx, rx }
}

/// Issue 50 (review 5b, 5c): a first report must name a configured domain of at most 1 KiB.
/// Scaled down from the review: with `RLQS_MAX_BUCKETS=100`, two `rlqs` streams at the cap and
/// 40 streams each naming a junk domain; before, each junk domain joined the fair-share census
/// (the newcomer's share 100 / 41 domains / 3 streams = 0) and a third `rlqs` stream's first
/// limited bucket got DENY_ALL. Now every junk stream, and one of a 5 000-byte domain, is ended
/// with INVALID_ARGUMENT and the newcomer gets its token bucket.
#[tokio::test]
async fn only_a_configured_domain_opens_a_stream_and_junk_domains_take_no_share() {
    let clock = ManualClock::new(support::T0);
    let config = ServerConfig {
        quota: QuotaSettings {
            max_buckets: 100,
            ..QuotaSettings::default()
        },
        ..ServerConfig::for_tests(rules(YAML), Arc::new(clock.clone()))
    };
    let server = TestServer::start_config(config, clock.clone()).await;
    let (mut a, mut b) = (Stream::open(&server).await, Stream::open(&server).await);
    assert_eq!(
        kinds(&a.report("rlqs", limited_junk("a", 60)).await),
        (60, 0, 0)
    );
    let (paced, denied, _) = kinds(&b.report("rlqs", limited_junk("b", 60)).await);
    assert_eq!(paced + denied, 60);
    let mut junk = Vec::new();
    for i in 0..40 {
        let mut s = Stream::open(&server).await;
        let err = s.refused(&format!("junk-{i}"), Vec::new()).await;
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains("configured domain"), "{err:?}");
        junk.push(s);
    }
    let mut long = Stream::open(&server).await;
    let err = long.refused(&"r".repeat(5_000), Vec::new()).await;
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(
        err.message()
            .contains("5000 bytes; no config names a domain longer than 1024"),
        "{err:?}"
    );
    let mut c = Stream::open(&server).await;
    c.newcomer_is_paced().await;
    let lines = [
        "sluice_rlqs_refused_total{reason=\"bad_domain\"} 41",
        "sluice_rlqs_streams{domain=\"rlqs\"} 3",
    ];
    assert_metrics(&server, &lines).await;
    server.stop().await;
}

/// Issue 50 (review 5a): a stream holding no tracked bucket (its first report named no
/// limited bucket, or every bucket it held was abandoned) is ended after
/// `RLQS_IDLE_STREAM_TIMEOUT` (200 ms here) on sluice's clock, with DEADLINE_EXCEEDED; one
/// holding a limited bucket is not. (Before: it held its place until the connection's age,
/// 24 h.) On a manual clock: the stream's timer wakes on real time and reads that clock, so the
/// test moves the clock and waits (bounded) for the end.
#[tokio::test]
async fn a_stream_holding_no_bucket_times_out() {
    let clock = ManualClock::new(support::T0);
    let config = ServerConfig {
        quota: QuotaSettings {
            idle_stream_timeout: Duration::from_millis(200),
            ..QuotaSettings::default()
        },
        ..ServerConfig::for_tests(rules(YAML), Arc::new(clock.clone()))
    };
    let server = TestServer::start_config(config, clock.clone()).await;
    // A first report of nothing; one of a bucket no limit names (answered ALLOW_ALL, untracked).
    let mut empty = Stream::open(&server).await;
    empty
        .tx
        .send(RateLimitQuotaUsageReports {
            domain: "rlqs".into(),
            bucket_quota_usages: Vec::new(),
        })
        .await
        .expect("sent");
    let mut unlimited = Stream::open(&server).await;
    let actions = unlimited
        .report("rlqs", vec![usage(&[("other", "x")], 1, 0)])
        .await;
    assert_eq!(strategy_of(&actions[0]), Err("allow_all"));
    let mut held = Stream::open(&server).await;
    held.newcomer_is_paced().await;
    // Not yet: the clock has not moved.
    assert_metrics(&server, &["sluice_rlqs_streams{domain=\"rlqs\"} 3"]).await;
    clock.advance(Duration::from_secs(1));
    for s in [&mut empty, &mut unlimited] {
        let err = tokio::time::timeout(BOUND, s.rx.message())
            .await
            .expect("the stream is ended")
            .expect_err("with a status");
        assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
        assert!(
            err.message()
                .contains("no limited bucket for 200ms (RLQS_IDLE_STREAM_TIMEOUT)"),
            "{err:?}"
        );
    }
    // The stream holding a bucket lives on and is answered.
    let actions = held
        .report("rlqs", vec![usage(&[("x-api-key", "newcomer")], 1, 0)])
        .await;
    assert!(strategy_of(&actions[0]).is_ok(), "{actions:?}");
    let lines = [
        "sluice_rlqs_refused_total{reason=\"idle_stream\"} 2",
        "sluice_rlqs_streams{domain=\"rlqs\"} 1",
    ];
    assert_metrics(&server, &lines).await;
    server.stop().await;
}

/// Issue 50 (review 5a): `RLQS_MAX_STREAMS_PER_PEER` (2 here) keeps one client from holding the
/// stream table: its third stream is refused with RESOURCE_EXHAUSTED while another peer
/// (127.0.0.2) still opens one, and a place its ended stream frees is taken again.
#[tokio::test]
async fn one_peer_holds_at_most_its_streams() {
    let clock = ManualClock::new(support::T0);
    let config = ServerConfig {
        quota: QuotaSettings {
            max_streams_per_peer: 2,
            ..QuotaSettings::default()
        },
        ..ServerConfig::for_tests(rules(YAML), Arc::new(clock.clone()))
    };
    let server = TestServer::start_config(config, clock).await;
    let from = |ip: [u8; 4]| open_from(server.grpc_addr, ip);
    let mut one = from([127, 0, 0, 1]).await.expect("first");
    let _two = from([127, 0, 0, 1]).await.expect("second");
    let Err(err) = from([127, 0, 0, 1]).await else {
        panic!("a third stream from the same peer was opened");
    };
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().contains("RLQS_MAX_STREAMS_PER_PEER"),
        "{err:?}"
    );
    let mut other = from([127, 0, 0, 2]).await.expect("another peer");
    served(&mut other, "other").await;
    // The first stream ends (its Envoy closes it): its place is free once the end is seen.
    served(&mut one, "one").await;
    let Stream { tx, mut rx } = one;
    drop(tx);
    let end = tokio::time::timeout(BOUND, rx.message())
        .await
        .expect("ends");
    assert!(matches!(end, Ok(None)), "{end:?}");
    let mut again = from([127, 0, 0, 1]).await.expect("a freed place");
    served(&mut again, "again").await;
    let lines = ["sluice_rlqs_refused_total{reason=\"over_peer_stream_cap\"} 1"];
    assert_metrics(&server, &lines).await;
    server.stop().await;
}

/// `s` reports a bucket of its own and gets a token bucket.
async fn served(s: &mut Stream, key: &str) {
    let actions = s
        .report("rlqs", vec![usage(&[("x-api-key", key)], 1, 0)])
        .await;
    assert!(strategy_of(&actions[0]).is_ok(), "{key}: {actions:?}");
}

/// An RLQS stream to `addr` from the local address `ip`, or the status it is refused with.
async fn open_from(addr: std::net::SocketAddr, ip: [u8; 4]) -> Result<Stream, tonic::Status> {
    use sluice::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .local_address(Some(ip.into()))
        .connect()
        .await
        .expect("RLQS connect");
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let rx = RateLimitQuotaServiceClient::new(channel)
        .stream_rate_limit_quotas(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    Ok(Stream { tx, rx })
}
