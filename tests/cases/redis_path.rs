//! The Redis path at its limits (issue 10), on real Redis and a real 3-master Cluster: one script
//! call per request on standalone whatever the hash tags, exactness for every algorithm across
//! hash tags and replicas, exact Cluster undo (also across a window roll), bounded abuse with an
//! empty SLOWLOG (on Redis and on Valkey), recovery from a restart under load, and a slow Redis
//! opening the breaker.

use super::store::{redis_settings, redis_store};
use crate::support::proxy::RedisProxy;
use crate::support::redis::{start_cluster, start_redis, RedisCluster};
use crate::support::*;
use sluice::clock::{Clock, ManualClock};
use sluice::config::{Algorithm, Limit, Period};
use sluice::proto::rate_limit_response::Code;
use sluice::service::ServiceOptions;
use sluice::store::breaker::{BreakerSettings, CircuitBreaker};
use sluice::store::redis::{keys, RedisKind, RedisStore};
use sluice::store::{CounterStore, LimitCheck};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const ALGORITHMS: [&str; 4] = [
    "fixed_window",
    "sliding_window",
    "sliding_log",
    "token_bucket",
];

/// Per algorithm: `r=<alg>` admits 50 an hour; `s=<alg>` (another hash tag) admits 1000.
fn exact_config() -> String {
    let mut y = String::from("domain: ex\ncounting: all_or_nothing\ndescriptors:\n");
    for key in ["r", "s"] {
        let rpu = if key == "r" { 50 } else { 1000 };
        for alg in ALGORITHMS {
            y.push_str(&format!(
                "  - key: {key}\n    value: {alg}\n    rate_limit: {{requests_per_unit: {rpu}, unit: hour, algorithm: {alg}}}\n"
            ));
        }
    }
    y
}

#[tokio::test]
async fn three_hash_tags_cost_one_evalsha_on_standalone() {
    let redis = start_redis(&[]).await;
    let yaml = r#"
domain: tags
counting: all_or_nothing
descriptors:
  - key: a
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: b
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: c
    rate_limit: {unit: hour, requests_per_unit: 1}
"#;
    let clock = ManualClock::new(T0);
    let store = redis_store(vec![redis.url()], RedisKind::Single, &clock);
    let s = TestServer::start_on(yaml, ServiceOptions::default(), Some(store), clock).await;
    let req = request(
        "tags",
        vec![
            desc(&[("a", "1")]),
            desc(&[("b", "2")]),
            desc(&[("c", "3")]),
        ],
    );
    // Loads the script (a fresh Redis answers the first EVALSHA with NOSCRIPT).
    let warm = s.call(one("tags", &[("a", "warm")])).await;
    assert_eq!(code(&warm), Code::Ok);
    assert_eq!(redis.cli(&["CONFIG", "RESETSTAT"]).trim(), "OK");
    let r = s.call(req.clone()).await;
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(redis.evalsha_calls(), 1, "three hash tags, one script call");
    // Denied by c: still one call, and nothing charged anywhere (no refund call either).
    let r = s.call(req).await;
    assert_eq!(code(&r), Code::OverLimit);
    assert_eq!(redis.evalsha_calls(), 2);
    assert_eq!(
        r.statuses[0].limit_remaining, 9,
        "a was not charged by the denial"
    );
    assert_eq!(
        r.statuses[1].limit_remaining, 9,
        "b was not charged by the denial"
    );
    s.stop().await;
}

/// 200 concurrent requests spanning two hash tags, through two sluice instances sharing one
/// Redis (or Cluster), admit exactly 50 for every algorithm; the other tag's counter holds
/// exactly the 50 admitted hits afterwards (Cluster: every denied request's charge was undone).
async fn exact_across_tags(urls: Vec<String>, kind: RedisKind) {
    let yaml = exact_config();
    let clock = ManualClock::new(T0);
    let a = TestServer::start_on(
        &yaml,
        ServiceOptions::default(),
        Some(redis_store(urls.clone(), kind, &clock)),
        clock.clone(),
    )
    .await;
    let b = TestServer::start_on(
        &yaml,
        ServiceOptions::default(),
        Some(redis_store(urls, kind, &clock)),
        clock,
    )
    .await;
    for alg in ALGORITHMS {
        let req = request("ex", vec![desc(&[("r", alg)]), desc(&[("s", alg)])]);
        let (ok, over) = super::redis::concurrent(&a, &b, &req, 200).await;
        assert_eq!((ok, over), (50, 150), "{alg}");
        // A check (hits_addend 0) of the other tag: exactly the 50 admitted hits are counted.
        let mut check = desc(&[("s", alg)]);
        check.hits_addend = Some(0);
        let r = a.call(request("ex", vec![check])).await;
        assert_eq!(
            r.statuses[0].limit_remaining, 950,
            "{alg}: s counted exactly 50"
        );
    }
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_algorithm_is_exact_across_hash_tags_on_redis() {
    let redis = start_redis(&[]).await;
    exact_across_tags(vec![redis.url()], RedisKind::Single).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_algorithm_is_exact_across_hash_tags_on_cluster() {
    let cluster = start_cluster().await;
    exact_across_tags(cluster.seeds(), RedisKind::Cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_algorithm_is_exact_across_hash_tags_on_valkey() {
    let valkey = crate::support::redis::start_valkey().await;
    exact_across_tags(vec![valkey.url()], RedisKind::Single).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_algorithm_is_exact_across_hash_tags_on_a_valkey_cluster() {
    let cluster = crate::support::redis::start_valkey_cluster().await;
    exact_across_tags(cluster.seeds(), RedisKind::Cluster).await;
}

/// A clock that moves `step` forward after every read, so the undo of a Cluster request reads a
/// later time than its charge did (a window edge between them, with a step of one period).
#[derive(Debug)]
struct SteppingClock {
    now: Mutex<Duration>,
    step: Mutex<Duration>,
}

impl Clock for SteppingClock {
    fn now(&self) -> Duration {
        let mut now = self.now.lock().expect("clock");
        let t = *now;
        *now += *self.step.lock().expect("clock");
        t
    }
}

fn limit(rpu: u32, period: &str, algorithm: Algorithm) -> Limit {
    Limit {
        requests_per_unit: rpu,
        period: Period::parse(period).expect("period"),
        algorithm,
        burst: if algorithm == Algorithm::TokenBucket {
            rpu - 1
        } else {
            0
        },
    }
}

fn ck(value: &str, limit: Limit, hits: u64) -> LimitCheck {
    LimitCheck::for_tests("undo", value, limit, hits)
}

/// The raw stored value of a key: a string, or a sorted set's members and scores.
fn raw(cluster: &RedisCluster, key: &str) -> String {
    match cluster.cli_cluster(&["TYPE", key]).trim() {
        "zset" => cluster.cli_cluster(&["ZRANGE", key, "0", "-1", "WITHSCORES"]),
        "none" => "<none>".into(),
        _ => cluster.cli_cluster(&["GET", key]),
    }
}

#[tokio::test]
async fn a_cluster_denial_leaves_every_counter_exactly_as_it_was() {
    let cluster = start_cluster().await;
    for alg in Algorithm::ALL {
        for roll in [false, true] {
            let clock = Arc::new(SteppingClock {
                now: Mutex::new(T0 + Duration::from_secs(7)),
                step: Mutex::new(Duration::ZERO),
            });
            let signals = sluice::store::StoreSignals::new("redis-cluster");
            let store = RedisStore::new(&redis_settings(cluster.seeds(), RedisKind::Cluster))
                .expect("store")
                .with_test_clock(clock.clone())
                .reporting_to(&signals);
            // A counter with room (10 a minute) and a full one in another slot.
            let roomy = limit(10, "1m", alg);
            let full = limit(1, "1m", Algorithm::FixedWindow);
            let a_value = format!("a-{}-{roll}", alg.name());
            let mut b_value = format!("b-{}-{roll}", alg.name());
            while keys::slot(&store.key_of(&ck(&b_value, full, 1).key))
                == keys::slot(&store.key_of(&ck(&a_value, roomy, 1).key))
            {
                b_value.push('b');
            }
            // A fixed window keeps its count under `<key>:<window index>`.
            let minute = (T0 + Duration::from_secs(7)).as_micros() / 60_000_000;
            let window = |key: String, alg: Algorithm| {
                if alg == Algorithm::FixedWindow {
                    format!("{key}:{minute}")
                } else {
                    key
                }
            };
            let (a_key, b_key) = (
                window(store.key_of(&ck(&a_value, roomy, 1).key), alg),
                window(
                    store.key_of(&ck(&b_value, full, 1).key),
                    Algorithm::FixedWindow,
                ),
            );
            // Earlier traffic: 3 hits on a, b full.
            for c in [ck(&a_value, roomy, 3), ck(&b_value, full, 1)] {
                assert!(store.decide(&[c]).await.expect("decides").admitted);
            }
            let (a_before, b_before) = (raw(&cluster, &a_key), raw(&cluster, &b_key));
            assert_ne!(a_before, "<none>");
            // The request: a charges in its slot, b denies in the other, a's charge is undone
            // (with `roll`, a whole period later than it was charged).
            if roll {
                *clock.step.lock().expect("clock") = Duration::from_secs(60);
            }
            let d = store
                .decide(&[ck(&a_value, roomy, 1), ck(&b_value, full, 1)])
                .await
                .expect("decides");
            assert!(!d.admitted, "{alg:?}");
            assert!(d.outcomes[0].allowed && !d.outcomes[1].allowed);
            assert_eq!(
                raw(&cluster, &a_key),
                a_before,
                "{alg:?} roll={roll}: a exactly as before"
            );
            assert_eq!(raw(&cluster, &b_key), b_before, "{alg:?} roll={roll}");
            assert_eq!(signals.undo_failures.get(), 0);
        }
    }
}

const ABUSE: &str = r#"
domain: abuse
counting: all_or_nothing
descriptors:
  - key: log
    rate_limit: {requests_per_unit: 100000, unit: hour, algorithm: sliding_log}
  - key: probe
    rate_limit: {requests_per_unit: 1000000, unit: hour}
"#;

/// Sends `req` and, concurrently, a probe request; returns the answer to `req` (or its gRPC
/// error) after checking the probe was answered OK.
async fn with_probe(
    s: &TestServer,
    req: sluice::proto::RateLimitRequest,
) -> Result<sluice::proto::RateLimitResponse, tonic::Status> {
    let mut c1 = s.client().await;
    let mut c2 = s.client().await;
    let (r, probe) = tokio::join!(
        c1.should_rate_limit(req),
        c2.should_rate_limit(one("abuse", &[("probe", "p")]))
    );
    let probe = probe.expect("the probe is answered").into_inner();
    assert_eq!(code(&probe), Code::Ok);
    r.map(|r| r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn abusive_requests_get_clear_answers_and_never_stall_redis() {
    abusive_requests_case(start_redis(&[]).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn abusive_requests_get_clear_answers_and_never_stall_valkey() {
    abusive_requests_case(crate::support::redis::start_valkey().await).await;
}

/// The script's bounds: requests over the caps are refused before the store, and what is
/// accepted never keeps the server busy for 1 ms (its SLOWLOG stays empty).
async fn abusive_requests_case(redis: crate::support::redis::RedisServer) {
    let slowlog = redis.cli(&["CONFIG", "SET", "slowlog-log-slower-than", "1000"]);
    assert_eq!(slowlog.trim(), "OK");
    let clock = ManualClock::new(T0);
    let store = redis_store(vec![redis.url()], RedisKind::Single, &clock);
    let s =
        TestServer::start_on(ABUSE, ServiceOptions::default(), Some(store), clock.clone()).await;
    assert_eq!(redis.cli(&["SLOWLOG", "RESET"]).trim(), "OK");

    for n in [20_000usize, 100_000] {
        let many = request(
            "abuse",
            (0..n).map(|i| desc(&[("log", &i.to_string())])).collect(),
        );
        let e = with_probe(&s, many).await.expect_err("over the cap");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{n}: {e:?}");
        assert!(e.message().contains("MAX_DESCRIPTORS_PER_REQUEST"), "{e:?}");
    }
    let big = "x".repeat(3 * 1024 * 1024);
    let e = with_probe(&s, one("abuse", &[("log", &big)]))
        .await
        .expect_err("over the cap");
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("MAX_DESCRIPTOR_VALUE_BYTES"), "{e:?}");

    // hits_addend 60 000 on a sliding_log of 100 000: one entry, admitted; again: denied.
    let mut heavy = desc(&[("log", "heavy")]);
    heavy.hits_addend = Some(60_000);
    let r = with_probe(&s, request("abuse", vec![heavy.clone()]))
        .await
        .expect("decided");
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 40_000);
    let r = with_probe(&s, request("abuse", vec![heavy]))
        .await
        .expect("decided");
    assert_eq!(code(&r), Code::OverLimit);
    assert_eq!(
        r.statuses[0].limit_remaining, 40_000,
        "a denial charges nothing"
    );

    // A sliding_log holding 100 000 entries (written directly, as 100 000 single hits over the
    // last half hour would have left it).
    let key = "sluice_test:{abuse|log=full}:slw:100000:hour".to_string();
    let t0 = T0.as_micros() as u64;
    let fill = r#"
local t0, n = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 1, n, 1000 do
  local z = {}
  for j = i, math.min(i + 999, n) do
    z[#z + 1] = string.format('%d', t0 - 1800000000 + j)
    z[#z + 1] = string.format('%015d:1:%d', j, j)
  end
  redis.call('ZADD', KEYS[1], unpack(z))
end
redis.call('PEXPIRE', KEYS[1], 7200000)
-- The fill leaves ~10 MB of Lua garbage in the VM every script shares; Redis collects it in
-- steps after later scripts, which put 1.3-2.2 ms GC pauses on sluice's calls in SLOWLOG.
collectgarbage('collect')
return redis.call('ZCARD', KEYS[1])
"#;
    assert_eq!(
        redis
            .cli(&["EVAL", fill, "1", &key, &t0.to_string(), "100000"])
            .trim(),
        "100000"
    );
    assert_eq!(
        redis.cli(&["SLOWLOG", "RESET"]).trim(),
        "OK",
        "the fill itself was slow"
    );
    let full = one("abuse", &[("log", "full")]);
    let r = with_probe(&s, full.clone()).await.expect("decided");
    assert_eq!(code(&r), Code::OverLimit, "100 000 of 100 000 used");
    // Half an hour later the oldest entry leaves: exactly one hit fits.
    clock.advance(Duration::from_secs(1800) + Duration::from_micros(1));
    let r = with_probe(&s, full.clone()).await.expect("decided");
    assert_eq!(code(&r), Code::Ok);
    let r = with_probe(&s, full.clone()).await.expect("decided");
    assert_eq!(code(&r), Code::OverLimit);
    // Two hours later every entry expired: trimmed at most 64 per call, decided at once.
    clock.advance(Duration::from_secs(7200));
    let r = with_probe(&s, full).await.expect("decided");
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 99_999);

    let slow = redis.cli(&["SLOWLOG", "GET", "10"]);
    assert_eq!(
        redis.cli(&["SLOWLOG", "LEN"]).trim(),
        "0",
        "slow calls: {slow}"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn token_bucket_is_exact_at_600k_per_second_on_redis() {
    let redis = start_redis(&[]).await;
    let clock = ManualClock::new(T0);
    let store = redis_store(vec![redis.url()], RedisKind::Single, &clock);
    let tb = Limit {
        requests_per_unit: 600_000,
        period: Period::parse("1s").expect("period"),
        algorithm: Algorithm::TokenBucket,
        burst: 599_999,
    };
    let c = |hits| ck("tb", tb, hits);
    assert!(
        store.decide(&[c(600_000)]).await.expect("ok").admitted,
        "the burst"
    );
    assert!(!store.decide(&[c(1)]).await.expect("ok").admitted);
    clock.advance(Duration::from_millis(500));
    let d = store.decide(&[c(400_000)]).await.expect("ok");
    assert!(!d.admitted, "400 000 more within half a second are refused");
    assert_eq!(d.outcomes[0].remaining, 300_000);
    assert!(store.decide(&[c(300_000)]).await.expect("ok").admitted);
    assert!(!store.decide(&[c(1)]).await.expect("ok").admitted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decisions_resume_after_a_redis_restart_under_load() {
    let mut redis = start_redis(&[]).await;
    let settings = sluice::store::redis::RedisSettings {
        timeout: Duration::from_secs(2),
        ..redis_settings(vec![redis.url()], RedisKind::Single)
    };
    let s = super::store::server_on_redis_settings(ABUSE, &settings).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut load = Vec::new();
    for w in 0..8 {
        let mut client = s.client().await;
        let stop = stop.clone();
        load.push(tokio::spawn(async move {
            let (mut ok, mut unavailable) = (0u64, 0u64);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match client
                    .should_rate_limit(one("abuse", &[("probe", &w.to_string())]))
                    .await
                {
                    Ok(_) => ok += 1,
                    Err(e) if e.code() == tonic::Code::Unavailable => unavailable += 1,
                    Err(e) => panic!("only UNAVAILABLE while Redis restarts: {e:?}"),
                }
                tokio::task::yield_now().await;
            }
            (ok, unavailable)
        }));
    }
    let mut client = s.client().await;
    let probe = one("abuse", &[("probe", "restart")]);
    assert!(client.should_rate_limit(probe.clone()).await.is_ok());
    let redis = tokio::task::spawn_blocking(move || {
        redis.stop();
        redis.restart();
        redis
    })
    .await
    .expect("restart");
    // Without restarting sluice, decisions come back (bounded wait: a broken setup must not
    // hang; how long recovery takes is not what is tested).
    poll_until("decisions resume after the restart", || {
        let (mut client, probe) = (client.clone(), probe.clone());
        async move { client.should_rate_limit(probe).await.map(|_| ()) }
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut total_ok = 0;
    for l in load {
        total_ok += l.await.expect("load task").0;
    }
    assert!(total_ok > 0);
    s.stop().await;
    drop(redis);
}

/// A real redis-server behind the test's holding proxy (sluice connects to the proxy).
async fn proxied_redis() -> (crate::support::redis::RedisServer, RedisProxy) {
    let redis = start_redis(&[]).await;
    let proxy = RedisProxy::start(
        format!("127.0.0.1:{}", redis.port())
            .parse()
            .expect("address"),
    )
    .await;
    (redis, proxy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_slower_than_the_callers_deadline_opens_the_breaker() {
    let (_redis, proxy) = proxied_redis().await;
    // REDIS_TIMEOUT far above the caller's deadline: only the deadline cuts the calls.
    let settings = sluice::store::redis::RedisSettings {
        timeout: Duration::from_secs(30),
        ..redis_settings(vec![proxy.url()], RedisKind::Single)
    };
    let clock = ManualClock::new(T0);
    let signals = sluice::store::StoreSignals::new("redis");
    let redis_store = RedisStore::new(&settings)
        .expect("store")
        .reporting_to(&signals);
    let breaker: Arc<dyn CounterStore> = Arc::new(
        CircuitBreaker::new(
            redis_store,
            BreakerSettings::default(),
            Arc::new(clock.clone()),
        )
        .reporting_to(&signals),
    );
    let s = TestServer::start_on(ABUSE, ServiceOptions::default(), Some(breaker), clock).await;
    let req = one("abuse", &[("probe", "slow")]);
    assert_eq!(code(&s.call(req.clone()).await), Code::Ok);

    proxy.hold(); // Redis answers nothing until released: slower than any deadline
    let mut client = s.client().await;
    for i in 0..sluice::store::breaker::DEFAULT_FAILURE_THRESHOLD {
        let mut r = tonic::Request::new(req.clone());
        r.set_timeout(Duration::from_millis(50));
        let e = client
            .should_rate_limit(r)
            .await
            .expect_err("cut by the deadline");
        assert!(
            matches!(
                e.code(),
                tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
            ),
            "call {i}: {e:?}"
        );
    }
    // The server learns of each cut call when the client's RST_STREAM arrives, which can trail
    // the client's own deadline under load: wait until the fifth drop is recorded.
    eventually("the breaker opens after five cut calls", || {
        let signals = signals.clone();
        async move { signals.breaker_state() == Some(sluice::store::breaker::BreakerState::Open) }
    })
    .await;
    // The breaker is open: the next call (no deadline) is answered at once, without Redis.
    let e = client
        .should_rate_limit(req.clone())
        .await
        .expect_err("breaker open");
    assert_eq!(e.code(), tonic::Code::Unavailable);
    assert!(e.message().contains("circuit open"), "{e:?}");
    proxy.release();
    s.stop().await;
}

#[tokio::test]
async fn the_deny_cache_keeps_only_final_denials_on_cluster() {
    let cluster = start_cluster().await;
    let redis = start_redis(&[]).await;
    let clock = ManualClock::new(T0);
    let one_per_hour = limit(1, "1h", Algorithm::FixedWindow);
    for (urls, kind, domain_tag, cached) in [
        (cluster.seeds(), RedisKind::Cluster, false, false),
        (cluster.seeds(), RedisKind::Cluster, true, true),
        (vec![redis.url()], RedisKind::Single, false, true),
    ] {
        // As the production chain picks it for the kind.
        let finality = match kind {
            RedisKind::Cluster => sluice::store::DenialFinality::DomainTaggedOnly,
            _ => sluice::store::DenialFinality::Always,
        };
        let cache = sluice::store::local_cache::LocalDenyCache::new(
            redis_store(urls, kind, &clock),
            1 << 20,
            Arc::new(clock.clone()),
            finality,
        );
        let mut c = ck(&format!("deny-{kind:?}-{domain_tag}"), one_per_hour, 1);
        c.key.domain_tag = domain_tag;
        let c = [c];
        assert!(cache.decide(&c).await.expect("decides").admitted);
        assert!(!cache.decide(&c).await.expect("decides").admitted);
        assert_eq!(
            cache.len(),
            usize::from(cached),
            "{kind:?} domain_tag={domain_tag}: a counter a request spanning slots may hold a \
             temporary charge on is not cached"
        );
    }
}

/// Concurrent requests on standalone Redis go to the script together (the packed layout: every
/// distinct counter once, answers replayed by sluice); each request still gets the answer it
/// would get alone, in some order: the admitted ones see the shared counter's remaining count
/// down exactly once per value, each consumer's likewise, the denied ones see their full limit
/// with the window's reset as retry, and Redis holds exactly the admitted hits.
#[tokio::test]
async fn batched_requests_answer_as_if_decided_one_by_one() {
    let redis = start_redis(&[]).await;
    let clock = ManualClock::new(T0);
    let settings = sluice::store::redis::RedisSettings {
        pool_size: 1, // one outstanding call: the rest queue and go together
        ..redis_settings(vec![redis.url()], RedisKind::Single)
    };
    let store = RedisStore::new(&settings)
        .expect("store")
        .with_test_clock(Arc::new(clock.clone()));
    let shared = limit(50, "1h", Algorithm::FixedWindow);
    let per_consumer = limit(8, "1h", Algorithm::FixedWindow);
    let checks = |i: usize| {
        let mut consumer = ck("shared", per_consumer, 1);
        let mut entries = consumer.key.entries.to_vec();
        entries.push(("c".into(), format!("{}", i % 10)));
        consumer.key.entries = entries.into();
        vec![ck("shared", shared, 1), consumer]
    };
    // Loads the script, on a counter of its own.
    let warm = store.decide(&[ck("warm", shared, 1)]).await.expect("warm");
    assert!(warm.admitted);
    assert_eq!(redis.cli(&["CONFIG", "RESETSTAT"]).trim(), "OK");

    // One task polls all 100 decisions: each is queued before the batcher runs.
    let all: Vec<Vec<LimitCheck>> = (0..100).map(checks).collect();
    let decisions = futures_util::future::join_all(all.iter().map(|c| store.decide(c))).await;
    let calls = redis.evalsha_calls();
    assert!(calls < 10, "100 requests in {calls} script calls: batched");

    let hour = 3_600_000_000u128;
    let reset = Duration::from_micros((hour - T0.as_micros() % hour) as u64);
    let mut shared_left = Vec::new();
    let mut consumer_left = vec![Vec::new(); 10];
    for (i, d) in decisions.into_iter().enumerate() {
        let d = d.expect("decided");
        assert_eq!(
            d.admitted,
            d.outcomes.iter().all(|o| o.allowed),
            "{i}: {d:?}"
        );
        for o in &d.outcomes {
            assert_eq!(o.reset, reset, "{i}: {d:?}");
            if !o.allowed {
                assert_eq!((o.remaining, o.retry_after), (0, reset), "{i}: {d:?}");
            }
        }
        if d.admitted {
            shared_left.push(d.outcomes[0].remaining);
            consumer_left[i % 10].push(d.outcomes[1].remaining);
        }
    }
    shared_left.sort_unstable();
    assert_eq!(
        shared_left,
        (0..50).collect::<Vec<u32>>(),
        "50 admitted, each saw its own count"
    );
    for (c, left) in consumer_left.iter_mut().enumerate() {
        left.sort_unstable();
        let expected: Vec<u32> = (8 - left.len() as u32..8).collect();
        assert_eq!(*left, expected, "consumer {c}");
    }
    // What Redis holds: exactly the admitted hits, in the current window's key.
    let window = T0.as_micros() / hour;
    let key = store.key_of(&ck("shared", shared, 1).key);
    assert_eq!(redis.cli(&["GET", &format!("{key}:{window}")]).trim(), "50");
    for (c, left) in consumer_left.iter().enumerate() {
        let check = &checks(c)[1];
        let stored = redis.cli(&["GET", &format!("{}:{window}", store.key_of(&check.key))]);
        assert_eq!(stored.trim(), left.len().to_string(), "consumer {c}");
    }
}

/// A usage report (envoyproxy counting records it) that Envoy cancels at its deadline while the
/// call waits for Redis is still recorded: the tokens are spent whether or not Envoy waited for
/// the answer. The proxy holds Redis's script calls, so the report queues behind an outstanding
/// call (one connection) until the caller's 50 ms deadline has cut it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_report_cut_by_the_callers_deadline_is_still_recorded() {
    let (_redis, proxy) = proxied_redis().await;
    let settings = sluice::store::redis::RedisSettings {
        timeout: Duration::from_secs(30),
        pool_size: 1,
        ..redis_settings(vec![proxy.url()], RedisKind::Single)
    };
    let clock = ManualClock::new(T0);
    let store: Arc<dyn CounterStore> = Arc::new(
        RedisStore::new(&settings)
            .expect("store")
            .with_test_clock(Arc::new(clock.clone())),
    );
    let rules = "domain: tokens\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 1000}\n";
    let s = TestServer::start_on(rules, ServiceOptions::default(), Some(store), clock).await;
    assert_eq!(
        code(&s.call(one("tokens", &[("user", "warm")])).await),
        Code::Ok
    );

    proxy.hold();
    // An outstanding call takes the one connection.
    let first = {
        let mut c = s.client().await;
        tokio::spawn(async move {
            c.should_rate_limit(one("tokens", &[("user", "other")]))
                .await
        })
    };
    proxy
        .wait_for("the first call is held", Duration::from_secs(30), |st| {
            st.scripts_held == 1
        })
        .await;
    // The report: 400 tokens, cut by its caller's deadline while it waits.
    let mut report = desc(&[("user", "u")]);
    report.hits_addend = Some(400);
    let mut r = tonic::Request::new(request("tokens", vec![report]));
    r.set_timeout(Duration::from_millis(50));
    let e = s
        .client()
        .await
        .should_rate_limit(r)
        .await
        .expect_err("cut by the deadline");
    assert!(
        matches!(
            e.code(),
            tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
        ),
        "{e:?}"
    );
    proxy.release();
    first
        .await
        .expect("join")
        .expect("the first call is answered");
    // Recorded: a check on the counter sees 400 used.
    let mut peek = desc(&[("user", "u")]);
    peek.hits_addend = Some(0);
    eventually("the cut report is recorded", || {
        let peek = peek.clone();
        let s = &s;
        async move { s.call(request("tokens", vec![peek])).await.statuses[0].limit_remaining == 600 }
    })
    .await;
    s.stop().await;
}
