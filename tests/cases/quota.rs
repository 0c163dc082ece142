//! The Rate Limit Quota Service in process, over real gRPC with Envoy's own message types, on a
//! manual clock: what an assignment reserves on the counter (seen through the RLS on the same
//! counter), how a report reconciles it, how a second stream's share counts the first's
//! reservation, and what bad input and the caps get. The behaviour through real Envoy is in
//! `rlqs.rs`.

use crate::support::{self, http, rules, TestServer};
use sluice::clock::ManualClock;
use sluice::proto::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use sluice::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use sluice::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use sluice::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use sluice::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use sluice::proto::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use sluice::quota::QuotaSettings;
use sluice::ServerConfig;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

pub const YAML: &str = "
domain: rlqs
descriptors:
  - key: x-api-key
    rate_limit: { unit: minute, requests_per_unit: 600 }
";

/// One open RLQS stream: reports go in, responses come out.
pub struct Stream {
    pub tx: mpsc::Sender<RateLimitQuotaUsageReports>,
    pub rx: tonic::Streaming<RateLimitQuotaResponse>,
}

impl Stream {
    pub async fn open(server: &TestServer) -> Self {
        let mut client =
            RateLimitQuotaServiceClient::connect(format!("http://{}", server.grpc_addr))
                .await
                .expect("RLQS connect");
        let (tx, rx) = mpsc::channel(4);
        let rx = client
            .stream_rate_limit_quotas(ReceiverStream::new(rx))
            .await
            .expect("stream opens")
            .into_inner();
        Self { tx, rx }
    }

    /// Sends one report and returns the next response (its answer, unless sluice sent one of
    /// its own first: see [`Stream::response`]).
    pub async fn report(
        &mut self,
        domain: &str,
        usages: Vec<BucketQuotaUsage>,
    ) -> Vec<BucketAction> {
        self.tx
            .send(RateLimitQuotaUsageReports {
                domain: domain.to_string(),
                bucket_quota_usages: usages,
            })
            .await
            .expect("report sent");
        self.response().await
    }

    /// The next response, whatever caused it (a report, a window's end, an assignment that
    /// expired: RLQS responses answer no report in particular).
    pub async fn response(&mut self) -> Vec<BucketAction> {
        self.rx
            .message()
            .await
            .expect("stream alive")
            .expect("a response")
            .bucket_action
    }
}

impl Stream {
    /// Sends one report and returns the status the stream is ended with.
    pub async fn refused(&mut self, domain: &str, usages: Vec<BucketQuotaUsage>) -> tonic::Status {
        self.tx
            .send(RateLimitQuotaUsageReports {
                domain: domain.to_string(),
                bucket_quota_usages: usages,
            })
            .await
            .expect("report sent");
        // Bounded, so a stream left open fails the test instead of hanging it.
        let bound = std::time::Duration::from_secs(60);
        tokio::time::timeout(bound, self.rx.message())
            .await
            .expect("the stream is ended in time")
            .expect_err("the stream is ended")
    }

    /// A first report of the bucket `{x-api-key: newcomer}` gets its normal assignment: 600 a
    /// minute, a token bucket of 10 a second, for 15 s.
    pub async fn newcomer_is_paced(&mut self) {
        let actions = self
            .report("rlqs", vec![usage(&[("x-api-key", "newcomer")], 1, 0)])
            .await;
        assert_eq!(
            (strategy_of(&actions[0]), ttl_of(&actions[0])),
            (Ok(10), 15),
            "the newcomer's normal assignment: 600 a minute, 10 tokens a second"
        );
    }
}

pub fn usage(pairs: &[(&str, &str)], allowed: u64, denied: u64) -> BucketQuotaUsage {
    BucketQuotaUsage {
        bucket_id: Some(bucket(pairs)),
        num_requests_allowed: allowed,
        num_requests_denied: denied,
        time_elapsed: None,
    }
}

fn bucket(pairs: &[(&str, &str)]) -> BucketId {
    BucketId {
        bucket: pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

/// A token bucket's tokens per one-second fill, or the blanket rule's name.
pub fn strategy_of(a: &BucketAction) -> Result<u32, &'static str> {
    let Some(Action::QuotaAssignmentAction(q)) = &a.bucket_action else {
        return Err("abandon");
    };
    match q
        .rate_limit_strategy
        .as_ref()
        .and_then(|s| s.strategy.as_ref())
    {
        Some(Strategy::TokenBucket(tb)) => Ok(tb.tokens_per_fill.unwrap_or(0)),
        Some(Strategy::BlanketRule(r)) if *r == BlanketRule::AllowAll as i32 => Err("allow_all"),
        Some(Strategy::BlanketRule(_)) => Err("deny_all"),
        _ => Err("none"),
    }
}

pub fn ttl_of(a: &BucketAction) -> i64 {
    match &a.bucket_action {
        Some(Action::QuotaAssignmentAction(q)) => {
            q.assignment_time_to_live.map_or(0, |d| d.seconds)
        }
        _ => 0,
    }
}

/// What the RLS says the counter of `{x-api-key: key}` has left, without charging it.
async fn remaining(server: &TestServer, key: &str) -> u32 {
    let mut d = support::desc(&[("x-api-key", key)]);
    d.hits_addend = Some(0);
    let r = server.call(support::request("rlqs", vec![d])).await;
    r.statuses[0].limit_remaining
}

#[tokio::test]
async fn an_assignment_reserves_its_tokens_and_the_next_report_reconciles_them() {
    let server = TestServer::start(YAML).await;
    let mut a = Stream::open(&server).await;
    // The clock stands at the start of a minute: 60 s left. One request reported (Envoy's
    // first request of a bucket): 599 left, all of it this stream's (alone), paced over the
    // minute: 10/s, and 6 s of it (the report period and a full bucket) reserved.
    let actions = a
        .report("rlqs", vec![usage(&[("x-api-key", "k1")], 1, 0)])
        .await;
    assert_eq!(actions.len(), 1);
    assert_eq!(strategy_of(&actions[0]), Ok(10));
    assert_eq!(ttl_of(&actions[0]), 15);
    assert_eq!(remaining(&server, "k1").await, 600 - 1 - 60, "60 reserved");
    // Ten used: the reservation is given back but for those ten, and a new one made.
    let actions = a
        .report("rlqs", vec![usage(&[("x-api-key", "k1")], 10, 3)])
        .await;
    assert_eq!(strategy_of(&actions[0]), Ok(10));
    assert_eq!(remaining(&server, "k1").await, 600 - 11 - 60);
    // Used more than reserved (Envoy's bucket started full): the excess is charged.
    let actions = a
        .report("rlqs", vec![usage(&[("x-api-key", "k1")], 65, 0)])
        .await;
    assert_eq!(strategy_of(&actions[0]), Ok(9), "524 left over 60 s");
    assert_eq!(remaining(&server, "k1").await, 600 - 76 - 54);

    // A second stream on the same counter: its share counts the first one's reservation as
    // part of what the window has (470 + 54 over 60 s, split evenly: neither has a measured
    // demand yet), so it gets about half, and reserves 6 s of it.
    let mut b = Stream::open(&server).await;
    let actions = b
        .report("rlqs", vec![usage(&[("x-api-key", "k1")], 1, 0)])
        .await;
    assert_eq!(
        strategy_of(&actions[0]),
        Ok(5),
        "(469 + 54) / 60 / 2 = 4.4, rounded up"
    );
    assert_eq!(remaining(&server, "k1").await, 600 - 77 - 54 - 30);
    server.stop().await;
}

#[tokio::test]
async fn a_spent_budget_is_deny_all_until_the_window_ends_and_the_next_window_starts_afresh() {
    let server = TestServer::start(YAML).await;
    let clock: ManualClock = server.clock.clone();
    let mut a = Stream::open(&server).await;
    let actions = a
        .report("rlqs", vec![usage(&[("x-api-key", "k2")], 600, 0)])
        .await;
    assert_eq!(strategy_of(&actions[0]), Err("deny_all"));
    assert_eq!(ttl_of(&actions[0]), 60, "until the window's end");
    assert_eq!(remaining(&server, "k2").await, 0);
    clock.advance(std::time::Duration::from_secs(60));
    let actions = a
        .report("rlqs", vec![usage(&[("x-api-key", "k2")], 0, 40)])
        .await;
    assert_eq!(strategy_of(&actions[0]), Ok(10), "a fresh window");
    server.stop().await;
}

#[tokio::test]
async fn bad_bucket_reports_are_ignored_and_counted_and_the_bucket_cap_never_answers_allow_all() {
    let clock = ManualClock::new(support::T0);
    let config = ServerConfig {
        quota: QuotaSettings {
            max_buckets_per_stream: 2,
            ..QuotaSettings::default()
        },
        ..ServerConfig::for_tests(rules(YAML), Arc::new(clock.clone()))
    };
    let server = TestServer::start_config(config, clock).await;
    let mut s = Stream::open(&server).await;
    let huge = "v".repeat(100_000);
    let actions = s
        .report(
            "rlqs",
            vec![
                usage(&[("x-api-key", "a")], 1, 0),
                usage(&[("x-api-key", "b")], 1, 0),
                // Past the cap of 2: not tracked, and denied until its next report (review
                // A1: ALLOW_ALL for an hour before, its usage charged nowhere).
                usage(&[("x-api-key", "c")], 1, 0),
                // Ignored: an empty bucket id, a huge value, an absurd count, no id at all.
                usage(&[], 1, 0),
                usage(&[("x-api-key", &huge)], 1, 0),
                usage(&[("x-api-key", "a")], u64::MAX, 0),
                BucketQuotaUsage::default(),
            ],
        )
        .await;
    let named: Vec<(String, Result<u32, &str>, i64)> = actions
        .iter()
        .map(|a| {
            let id = a.bucket_id.as_ref().map(|b| b.bucket["x-api-key"].clone());
            (id.unwrap_or_default(), strategy_of(a), ttl_of(a))
        })
        .collect();
    assert_eq!(
        named,
        vec![
            ("a".to_string(), Ok(10), 15),
            ("b".to_string(), Ok(10), 15),
            ("c".to_string(), Err("deny_all"), 15),
        ]
    );
    // An unknown domain ends the stream (issue 50: it held a place, and a share, for nothing).
    let mut other = Stream::open(&server).await;
    let err = other
        .refused("nope", vec![usage(&[("x-api-key", "a")], 1, 0)])
        .await;
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");

    let (_, metrics) = http(server.http_addr, "GET", "/metrics", "").await;
    for (reason, n) in [
        ("over_bucket_cap", 1),
        ("empty", 2),
        ("too_large", 1),
        ("absurd_count", 1),
        ("bad_domain", 1),
    ] {
        let line = format!("sluice_rlqs_refused_total{{reason=\"{reason}\"}} {n}");
        assert!(metrics.contains(&line), "{line} in:\n{metrics}");
    }
    assert!(
        metrics.contains("sluice_rlqs_buckets{domain=\"rlqs\"} 2"),
        "{metrics}"
    );

    // The debug view: both tracked buckets, values redacted (they are often API keys).
    let (status, body) = http(server.http_addr, "GET", "/debug/rlqs?domain=rlqs", "").await;
    assert_eq!(status, 200, "{body}");
    let doc: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(doc["values_shown"], false);
    let buckets = &doc["streams"][0]["buckets"];
    assert_eq!(
        buckets["x-api-key=<1 bytes>"]["action"], "token_bucket",
        "{body}"
    );
    assert_eq!(doc["streams"][0]["buckets_total"], 2);
    assert!(!body.contains("\"x-api-key=a\""), "{body}");
    let (status, _) = http(server.http_addr, "GET", "/debug/rlqs?limit=x", "").await;
    assert_eq!(status, 400);
    server.stop().await;
}

#[tokio::test]
async fn idle_buckets_are_abandoned_and_give_their_reservation_back() {
    let server = TestServer::start(YAML).await;
    let mut s = Stream::open(&server).await;
    let k = [("x-api-key", "idle")];
    s.report("rlqs", vec![usage(&k, 1, 0)]).await;
    assert_eq!(remaining(&server, "idle").await, 600 - 1 - 60);
    for _ in 0..2 {
        let actions = s.report("rlqs", vec![usage(&k, 0, 0)]).await;
        assert!(strategy_of(&actions[0]).is_ok(), "still assigned");
    }
    let actions = s.report("rlqs", vec![usage(&k, 0, 0)]).await;
    assert_eq!(
        strategy_of(&actions[0]),
        Err("abandon"),
        "three idle reports"
    );
    assert_eq!(
        remaining(&server, "idle").await,
        599,
        "nothing held for it any more"
    );
    let (_, metrics) = http(server.http_addr, "GET", "/metrics", "").await;
    assert!(
        metrics.contains("sluice_rlqs_buckets{domain=\"rlqs\"} 0"),
        "{metrics}"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_new_config_applies_to_buckets_already_held() {
    let server = TestServer::start(YAML).await;
    let mut s = Stream::open(&server).await;
    let team = [("team", "a")];
    let actions = s.report("rlqs", vec![usage(&team, 1, 0)]).await;
    assert_eq!(
        strategy_of(&actions[0]),
        Err("allow_all"),
        "no limit for `team` yet"
    );
    let mut late = Stream::open(&server).await;
    let err = late.refused("late", vec![usage(&[("k", "v")], 1, 0)]).await;
    assert_eq!(
        err.code(),
        tonic::Code::InvalidArgument,
        "an unknown domain"
    );
    // A reload (or an xDS push) adds a limit for `team` and the domain `late`.
    let limiter = server.running.as_ref().expect("running").limiter();
    limiter.replace_rules(support::rules_of(&[
        (
            "rlqs.yaml",
            "domain: rlqs\ndescriptors:\n  - key: x-api-key\n    rate_limit: { unit: minute, requests_per_unit: 600 }\n  - key: team\n    rate_limit: { unit: minute, requests_per_unit: 60 }\n",
        ),
        (
            "late.yaml",
            "domain: late\ndescriptors:\n  - key: k\n    rate_limit: { unit: minute, requests_per_unit: 120 }\n",
        ),
    ]));
    let actions = s.report("rlqs", vec![usage(&team, 1, 0)]).await;
    assert_eq!(
        strategy_of(&actions[0]),
        Ok(1),
        "the held bucket now has its limit"
    );
    let mut late = Stream::open(&server).await;
    let actions = late.report("late", vec![usage(&[("k", "v")], 1, 0)]).await;
    assert_eq!(
        strategy_of(&actions[0]),
        Ok(2),
        "a new stream, once configured"
    );
    let (_, metrics) = http(server.http_addr, "GET", "/metrics", "").await;
    assert!(
        metrics.contains("sluice_rlqs_streams{domain=\"late\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("sluice_rlqs_buckets{domain=\"late\"} 1"),
        "{metrics}"
    );
    server.stop().await;
}

/// A report above tonic's default 4 MiB message cap (Envoy reports every bucket it holds in one
/// message) is taken, its oversized bucket ids refused, and the stream lives on.
#[tokio::test]
async fn a_report_above_four_mebibytes_is_taken_and_the_stream_lives_on() {
    let server = TestServer::start(YAML).await;
    let mut s = Stream::open(&server).await;
    let big = "v".repeat(5_000);
    let keys: Vec<String> = (0..1_100).map(|n| format!("{n}{big}")).collect();
    let usages = keys
        .iter()
        .map(|k| usage(&[("x-api-key", k)], 1, 0))
        .collect();
    // Every id is over MAX_DESCRIPTOR_VALUE_BYTES: refused, and nothing to answer.
    s.tx.send(RateLimitQuotaUsageReports {
        domain: "rlqs".into(),
        bucket_quota_usages: usages,
    })
    .await
    .expect("report sent");
    let actions = s
        .report("rlqs", vec![usage(&[("x-api-key", "k")], 1, 0)])
        .await;
    assert_eq!(strategy_of(&actions[0]), Ok(10));
    let (_, metrics) = http(server.http_addr, "GET", "/metrics", "").await;
    assert!(
        metrics.contains("sluice_rlqs_refused_total{reason=\"too_large\"} 1100"),
        "{metrics}"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_first_report_without_a_domain_is_refused_and_every_gauge_returns_to_zero() {
    let server = TestServer::start(YAML).await;
    // The proto requires the domain in a stream's first report: without it nothing the stream
    // reports could be recorded, so the stream ends with INVALID_ARGUMENT.
    let mut s = Stream::open(&server).await;
    s.tx.send(RateLimitQuotaUsageReports {
        domain: String::new(),
        bucket_quota_usages: vec![usage(&[("x-api-key", "k9")], 5, 0)],
    })
    .await
    .expect("report sent");
    let status = s.rx.message().await.expect_err("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");

    // A stream with a domain, then its end: its gauges go back to 0.
    let mut a = Stream::open(&server).await;
    let actions = a
        .report("rlqs", vec![usage(&[("x-api-key", "k8")], 5, 0)])
        .await;
    assert_eq!(actions.len(), 1);
    let (_, metrics) = http(server.http_addr, "GET", "/metrics", "").await;
    assert!(
        metrics.contains("sluice_rlqs_streams{domain=\"rlqs\"} 1")
            && metrics.contains("sluice_rlqs_buckets{domain=\"rlqs\"} 1"),
        "{metrics}"
    );
    drop(a);
    drop(s);
    let addr = server.http_addr;
    support::eventually("every RLQS gauge back to 0", || async move {
        let (_, m) = http(addr, "GET", "/metrics", "").await;
        m.lines()
            .filter(|l| {
                l.starts_with("sluice_rlqs_streams") || l.starts_with("sluice_rlqs_buckets")
            })
            .all(|l| l.ends_with(" 0"))
    })
    .await;
    let (_, metrics) = http(server.http_addr, "GET", "/metrics", "").await;
    assert!(
        metrics.contains("sluice_rlqs_streams{domain=\"rlqs\"} 0"),
        "{metrics}"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_report_straddling_a_window_end_is_split_on_the_injected_clock() {
    let server = TestServer::start(YAML).await;
    let clock: ManualClock = server.clock.clone();
    let mut a = Stream::open(&server).await;
    // At the start of a minute: 10/s, 60 reserved.
    let actions = a
        .report("rlqs", vec![usage(&[("x-api-key", "k3")], 1, 0)])
        .await;
    assert_eq!(strategy_of(&actions[0]), Ok(10));
    assert_eq!(remaining(&server, "k3").await, 600 - 1 - 60);
    // 70 s later (the window ended 10 s ago, on the service's clock alone): of the 70 used
    // since the last report, the 10 after the window's end count in the new window; the rest
    // and the old reservation stay with the window that closed. The new window has 590 left
    // over 50 s: 11.8/s, rounded up to 12, and 6 s of it (72) reserved.
    clock.advance(std::time::Duration::from_secs(70));
    let actions = a
        .report("rlqs", vec![usage(&[("x-api-key", "k3")], 70, 0)])
        .await;
    assert_eq!(strategy_of(&actions[0]), Ok(12));
    assert_eq!(remaining(&server, "k3").await, 600 - 10 - 72);
    server.stop().await;
}

/// An RLQS bucket on an `in_flight` limit: a bucket names no request, so it takes no slot; it is
/// allowed (for one assignment's time) while a slot is free and denied until the first lease
/// ends while every slot is held, never paced as if slots were a rate.
#[tokio::test]
async fn a_bucket_on_an_in_flight_limit_is_allowed_while_a_slot_is_free() {
    const SLOTS: &str = "
domain: ai
descriptors:
  - key: tenant
    in_flight: {max: 2, lease: 5s, id_key: request_id, done_key: request_done}
";
    let server = TestServer::start(SLOTS).await;
    let mut a = Stream::open(&server).await;
    let actions = a.report("ai", vec![usage(&[("tenant", "t")], 3, 0)]).await;
    assert_eq!(strategy_of(&actions[0]), Err("allow_all"), "slots free");
    assert_eq!(ttl_of(&actions[0]), 15, "renewed like any assignment");
    for id in ["a", "b"] {
        let r = server
            .call(support::one("ai", &[("tenant", "t"), ("request_id", id)]))
            .await;
        assert_eq!(
            support::code(&r),
            sluice::proto::rate_limit_response::Code::Ok,
            "{id} takes a slot"
        );
    }
    let actions = a.report("ai", vec![usage(&[("tenant", "t")], 3, 0)]).await;
    assert_eq!(strategy_of(&actions[0]), Err("deny_all"), "every slot held");
    assert_eq!(ttl_of(&actions[0]), 5, "until the first lease ends");
    let r = server
        .call(support::one(
            "ai",
            &[("tenant", "t"), ("request_done", "a")],
        ))
        .await;
    assert_eq!(
        support::code(&r),
        sluice::proto::rate_limit_response::Code::Ok
    );
    let actions = a.report("ai", vec![usage(&[("tenant", "t")], 0, 4)]).await;
    assert_eq!(strategy_of(&actions[0]), Err("allow_all"), "a slot freed");
    server.stop().await;
}

/// Review A1 (issue 38): two streams reporting 10 000 junk buckets each, then a third stream's
/// new bucket. Junk the config does not limit (the review's `{k: <i>}`) is not tracked, so it
/// fills no cap and the newcomer gets its normal assignment (ALLOW_ALL before, for an hour, its
/// usage charged nowhere). Junk under the limited key that fills the caps: `rlqs_bounds.rs`.
#[tokio::test]
async fn junk_buckets_never_make_a_newcomer_allow_all() {
    let server = TestServer::start(YAML).await;
    let junk = |prefix: &str, key: &str| -> Vec<BucketQuotaUsage> {
        (0..10_000)
            .map(|i| usage(&[(key, &format!("{prefix}{i}"))], 1, 0))
            .collect()
    };
    let (mut a, mut b) = (Stream::open(&server).await, Stream::open(&server).await);
    for (s, prefix) in [(&mut a, "a"), (&mut b, "b")] {
        let actions = s.report("rlqs", junk(prefix, "k")).await;
        assert_eq!(actions.len(), 10_000);
        assert!(actions
            .iter()
            .all(|x| strategy_of(x) == Err("allow_all") && ttl_of(x) == 3600));
    }
    let mut c = Stream::open(&server).await;
    c.newcomer_is_paced().await;
    server.stop().await;
    // Junk that names the limit: rlqs_bounds.rs.
}

/// Reviews A1 and A2 (issue 38): a bucket its Envoy stops reporting is abandoned after
/// `RLQS_BUCKET_TIMEOUT` (it held its place under the caps for as long as the stream lived),
/// and a stream that never sends a first report is ended after `RLQS_FIRST_REPORT_TIMEOUT`.
/// Both run on sluice's clock (a manual one here); the stream's timer wakes on real time and
/// reads that clock, so the test moves the clock and waits for the answer.
#[tokio::test]
async fn unreported_buckets_and_silent_streams_time_out() {
    let clock = ManualClock::new(support::T0);
    let config = ServerConfig {
        quota: QuotaSettings {
            bucket_timeout: std::time::Duration::from_millis(200),
            first_report_timeout: std::time::Duration::from_millis(200),
            ..QuotaSettings::default()
        },
        ..ServerConfig::for_tests(rules(YAML), Arc::new(clock.clone()))
    };
    let server = TestServer::start_config(config, clock.clone()).await;
    let mut s = Stream::open(&server).await;
    let actions = s
        .report(
            "rlqs",
            vec![
                usage(&[("x-api-key", "a")], 1, 0),
                usage(&[("x-api-key", "b")], 1, 0),
            ],
        )
        .await;
    assert_eq!(actions.len(), 2);
    clock.advance(std::time::Duration::from_secs(1));
    // Bounded, so a stream that never abandons fails the test instead of hanging it.
    let bound = std::time::Duration::from_secs(60);
    let abandoned = tokio::time::timeout(bound, s.rx.message())
        .await
        .expect("the timed-out buckets are abandoned")
        .expect("stream alive")
        .expect("the abandons")
        .bucket_action;
    let mut gone: Vec<(String, Result<u32, &str>)> = abandoned
        .iter()
        .map(|a| {
            let id = a.bucket_id.as_ref().map(|b| b.bucket["x-api-key"].clone());
            (id.unwrap_or_default(), strategy_of(a))
        })
        .collect();
    gone.sort();
    assert_eq!(
        gone,
        [
            ("a".to_string(), Err("abandon")),
            ("b".to_string(), Err("abandon"))
        ]
    );
    let (_, metrics) = http(server.http_addr, "GET", "/metrics", "").await;
    for line in [
        "sluice_rlqs_buckets{domain=\"rlqs\"} 0",
        "sluice_rlqs_refused_total{reason=\"bucket_timeout\"} 2",
    ] {
        assert!(metrics.contains(line), "{line} in:\n{metrics}");
    }

    // A stream that says nothing.
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{}", server.grpc_addr))
        .await
        .expect("RLQS connect");
    let (_tx, rx) = mpsc::channel::<RateLimitQuotaUsageReports>(1);
    let mut silent = client
        .stream_rate_limit_quotas(ReceiverStream::new(rx))
        .await
        .expect("stream opens")
        .into_inner();
    clock.advance(std::time::Duration::from_secs(1));
    let err = tokio::time::timeout(bound, silent.message())
        .await
        .expect("the silent stream is ended")
        .expect_err("ended");
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
    server.stop().await;
}

/// RLQS buckets on a leased limit (issue 40) draw from the same budget as the replicas' slices:
/// a report and its reservation are charged on the window's counter the slices are granted
/// from, so slices and assignments together never admit more than the limit, and the bucket
/// is denied once the slices have taken the rest.
async fn a_bucket_on_a_leased_limit_shares_the_slices_budget(kind: &str) {
    let yaml = YAML.replace(
        "  - key: x-api-key\n",
        "  - key: x-api-key\n    leased: {max_slice: 60}\n",
    );
    assert_ne!(yaml, YAML);
    let (store, clock, _backend) = crate::cases::store::make_store(kind).await;
    let server =
        TestServer::start_on(&yaml, sluice::ServiceOptions::default(), Some(store), clock).await;
    let rls = || support::one("rlqs", &[("x-api-key", "k9")]);
    let ok = |r: &sluice::proto::RateLimitResponse| {
        support::code(r) == sluice::proto::rate_limit_response::Code::Ok
    };
    // One RLS request: the replica's first slice of the window (max_slice / 8 = 7), 1 spent.
    assert!(ok(&server.call(rls()).await), "{kind}");
    assert_eq!(
        remaining(&server, "k9").await,
        600 - 7,
        "{kind}: the slice granted"
    );
    // Envoy's first report of the bucket: 1 used, and 6 s of a 10/s share ((600 - 8) / 60 s)
    // reserved, on the same counter.
    let mut a = Stream::open(&server).await;
    let actions = a
        .report("rlqs", vec![usage(&[("x-api-key", "k9")], 1, 0)])
        .await;
    assert_eq!(strategy_of(&actions[0]), Ok(10), "{kind}");
    assert_eq!(remaining(&server, "k9").await, 600 - 7 - 1 - 60, "{kind}");
    // The RLS spends the rest through its slices, and no more: 600 less the bucket's 1 used
    // and 60 reserved (one replica drains its last slice: nothing stranded).
    let mut admitted = 1;
    for _ in 0..700 {
        admitted += u32::from(ok(&server.call(rls()).await));
    }
    assert_eq!(
        admitted,
        600 - 1 - 60,
        "{kind}: RLS admitted past the bucket's share"
    );
    assert_eq!(remaining(&server, "k9").await, 0, "{kind}");
    // The bucket used its reservation: charged nothing more, and the window is spent.
    let actions = a
        .report("rlqs", vec![usage(&[("x-api-key", "k9")], 60, 5)])
        .await;
    assert_eq!(strategy_of(&actions[0]), Err("deny_all"), "{kind}");
    assert_eq!(remaining(&server, "k9").await, 0, "{kind}");
    server.stop().await;
}

test_with_stores!(a_bucket_on_a_leased_limit, [memory, redis, cluster], kind => a_bucket_on_a_leased_limit_shares_the_slices_budget);
