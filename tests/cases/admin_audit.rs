//! The admin API's record (issue 50 item 4): every write leaves an attempt line and an outcome
//! line whatever `LOG_LEVEL` says, a write whose caller goes away (its deadline, RST_STREAM)
//! still applies, is recorded and bumps the generation, caller-controlled text cannot forge an
//! audit line, and `reason` / `limit_name` are capped on every write.

use super::admin::{admin, entries, RULES};
use crate::support::binary::{serve, SluiceProcess};
use crate::support::redis::start_redis;
use crate::support::{certs, eventually, http, one, rules, TestServer, T0};
use sluice::app::Ingredients;
use sluice::clock::ManualClock;
use sluice::proto::sluice::admin::v1 as pb;
use sluice::proto::sluice::admin::v1::admin_client::AdminClient;
use sluice::server::ServerConfig;
use sluice::store::admin::{CounterAdmin, OverrideId, ResetCount, StoredOverride};
use sluice::store::redis::{RedisKind, RedisStore};
use sluice::store::{BoxFuture, StoreError, StoreStack};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;
use tonic::transport::Channel;

/// A store's admin side whose writes wait at a gate the test opens: the test knows a write
/// reached the store, and lets it through only once its caller has gone.
#[derive(Debug)]
struct Gated {
    inner: Arc<dyn CounterAdmin>,
    /// A permit per write that reached the store call.
    entered: Semaphore,
    /// A permit per write let through.
    open: Semaphore,
}

impl Gated {
    fn new(inner: Arc<dyn CounterAdmin>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            entered: Semaphore::new(0),
            open: Semaphore::new(0),
        })
    }

    async fn hold(&self) {
        self.entered.add_permits(1);
        if let Ok(p) = self.open.acquire().await {
            p.forget();
        }
    }

    /// Waits until a write reached the store call.
    async fn reached(&self) {
        self.entered.acquire().await.expect("gate").forget();
    }
}

impl CounterAdmin for Gated {
    fn reset<'a>(
        &'a self,
        domain: &'a str,
        prefix: &'a [(String, String)],
        domain_tag: bool,
    ) -> BoxFuture<'a, Result<ResetCount, StoreError>> {
        Box::pin(async move {
            self.hold().await;
            self.inner.reset(domain, prefix, domain_tag).await
        })
    }

    fn overrides(&self) -> BoxFuture<'_, Result<(u64, Vec<StoredOverride>), StoreError>> {
        self.inner.overrides()
    }

    fn generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        self.inner.generation()
    }

    fn put_override<'a>(
        &'a self,
        o: &'a StoredOverride,
        now_ms: u64,
        max: usize,
    ) -> BoxFuture<'a, Result<Option<StoredOverride>, StoreError>> {
        Box::pin(async move {
            self.hold().await;
            self.inner.put_override(o, now_ms, max).await
        })
    }

    fn delete_override<'a>(
        &'a self,
        id: &'a OverrideId,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<Option<StoredOverride>, StoreError>> {
        Box::pin(async move {
            self.hold().await;
            self.inner.delete_override(id, now_ms).await
        })
    }
}

/// What this test's thread logs, as the binary's text format writes it, filtered as the binary
/// filters at `LOG_LEVEL=warn`. The servers the test starts run their admin tasks on the
/// test's (current-thread) runtime, so their lines land here too.
#[derive(Debug, Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log").extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn start() -> (Self, tracing::subscriber::DefaultGuard) {
        let log = Self::default();
        let writer = log.clone();
        let filter = sluice::admin::audit::always_on(tracing_subscriber::EnvFilter::new("warn"));
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        (log, tracing::subscriber::set_default(subscriber))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("log")).into_owned()
    }

    /// Attempt lines of `operation`.
    fn attempts(&self, operation: &str) -> usize {
        let op = format!("operation=\"{operation}\"");
        self.text()
            .lines()
            .filter(|l| l.contains("admin write attempt") && l.contains(&op))
            .count()
    }

    /// Outcome lines of `operation` that went through.
    fn done(&self, operation: &str) -> usize {
        let op = format!("operation=\"{operation}\"");
        self.text()
            .lines()
            .filter(|l| l.contains("result=\"ok\"") && l.contains(&op))
            .count()
    }
}

/// Calls `write` with a deadline until one runs out while the write is held at the gate, then
/// lets it through. The deadline is the server's (see [`with_server_deadline`]): when its answer
/// arrives the handler is gone, never to be polled again. A deadline can also run out before
/// the handler started (no attempt line: nothing was written, nor ever will be): then a longer
/// one.
async fn cut_by_deadline<F, Fut>(log: &Captured, gate: &Gated, operation: &str, mut write: F)
where
    F: FnMut(Duration) -> Fut,
    Fut: Future<Output = String>,
{
    let mut deadline = Duration::from_millis(50);
    loop {
        let before = log.attempts(operation);
        let status = write(deadline).await;
        assert_eq!(status, "1", "CANCELLED, the server's spent deadline");
        if log.attempts(operation) > before {
            break;
        }
        deadline *= 2;
        assert!(
            deadline < Duration::from_secs(60),
            "never reached the write"
        );
    }
    gate.reached().await;
    gate.open.add_permits(1);
}

/// One admin call over plain HTTP/2 with `grpc-timeout`; its `grpc-status`. Why not tonic's
/// client: it enforces the deadline itself, dropping the call (an RST_STREAM the server sees a
/// little later). h2 leaves it to the server, whose answer (CANCELLED, "Timeout expired") is
/// sent as the handler is dropped.
async fn with_server_deadline(
    s: &TestServer,
    method: &str,
    m: impl prost::Message,
    deadline: Duration,
) -> String {
    let addr = s
        .running
        .as_ref()
        .and_then(|r| r.admin_addr())
        .expect("admin");
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut h2, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(connection);
    let request = http::Request::post(format!("http://{addr}/sluice.admin.v1.Admin/{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-timeout", format!("{}m", deadline.as_millis()))
        .body(())
        .expect("request");
    let body = m.encode_to_vec();
    let mut framed = vec![0u8];
    framed.extend_from_slice(&u32::try_from(body.len()).expect("len").to_be_bytes());
    framed.extend_from_slice(&body);
    let (response, mut out) = h2.send_request(request, false).expect("send");
    out.send_data(framed.into(), true).expect("queued");
    let response = response.await.expect("response headers");
    let status = |h: &http::HeaderMap| {
        h.get("grpc-status")
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    };
    if let Some(code) = status(response.headers()) {
        return code;
    }
    let mut body = response.into_body();
    while let Some(data) = body.data().await {
        data.expect("data");
    }
    let trailers = body.trailers().await.expect("trailers").unwrap_or_default();
    status(&trailers).expect("grpc-status")
}

async fn server_on(mut stack: StoreStack, clock: &ManualClock) -> (TestServer, Arc<Gated>) {
    let gate = Gated::new(Arc::clone(&stack.admin));
    stack.admin = gate.clone();
    let base = Ingredients::for_tests(rules(RULES), Arc::new(clock.clone()));
    let config = ServerConfig::from_ingredients(Ingredients {
        store: stack,
        ..base
    });
    (TestServer::start_config(config, clock.clone()).await, gate)
}

fn acme_override() -> pb::SetOverrideRequest {
    pb::SetOverrideRequest {
        domain: "api".into(),
        entries: entries(&[("tenant", "acme")]),
        limit: Some(pb::set_override_request::Limit::RequestsPerUnit(50)),
        ttl_seconds: 600,
        ..Default::default()
    }
}

async fn listed(c: &mut AdminClient<Channel>) -> usize {
    c.list_overrides(pb::ListOverridesRequest::default())
        .await
        .expect("list")
        .into_inner()
        .overrides
        .len()
}

/// An override set by a call its deadline cut, and one deleted by a call its client dropped
/// (RST_STREAM), both held at the store until the caller was gone: each is applied, has its
/// attempt and outcome lines and its metric, and moved the generation.
#[tokio::test]
async fn a_write_whose_caller_goes_away_still_applies_is_audited_and_bumps_the_generation() {
    let (log, _guard) = Captured::start();
    let clock = ManualClock::new(T0 + Duration::from_secs(600));
    let stack = StoreStack::memory(Arc::new(clock.clone()), 100_000);
    let (s, gate) = server_on(stack, &clock).await;
    let mut c = admin(&s).await;

    let g0 = gate.generation().await.expect("generation");
    let set = |deadline| with_server_deadline(&s, "SetOverride", acme_override(), deadline);
    cut_by_deadline(&log, &gate, "set_override", set).await;
    eventually("the set's outcome line", || async {
        log.done("set_override") == 1
    })
    .await;
    assert_eq!(listed(&mut c).await, 1, "{}", log.text());
    let g1 = gate.generation().await.expect("generation");
    assert!(g1 > g0, "the generation moved: {g0} -> {g1}");

    // The same write, its client gone (the call dropped: RST_STREAM) while the store held it.
    let mut dropped = c.clone();
    let call = tokio::spawn(async move {
        let m = pb::DeleteOverrideRequest {
            domain: "api".into(),
            entries: entries(&[("tenant", "acme")]),
            ..Default::default()
        };
        dropped.delete_override(m).await
    });
    gate.reached().await;
    call.abort();
    assert!(call.await.is_err(), "the call was dropped, not answered");
    gate.open.add_permits(1);
    eventually("the delete's outcome line", || async {
        log.done("delete_override") == 1
    })
    .await;
    assert_eq!(listed(&mut c).await, 0, "{}", log.text());
    assert!(gate.generation().await.expect("generation") > g1);

    let metrics = http(s.http_addr, "GET", "/metrics", "").await.1;
    for op in ["set_override", "delete_override"] {
        let series = format!("operation=\"{op}\",result=\"ok\"}} 1");
        assert!(metrics.contains(&series), "{series} in\n{metrics}");
        assert_eq!(log.attempts(op), 1, "{}", log.text());
    }
    s.stop().await;
}

/// A reset its deadline cut while the store held it, on Redis: acme's counters go, the
/// outcome line is written, and the generation every replica polls moved twice (before the
/// scans and after them).
#[tokio::test]
async fn a_reset_cut_by_its_deadline_still_resets_and_bumps_the_generation_on_redis() {
    let (log, _guard) = Captured::start();
    let redis = start_redis(&[]).await;
    let clock = ManualClock::new(T0 + Duration::from_secs(600));
    let settings = super::store::redis_settings(vec![redis.url()], RedisKind::Single);
    let stack = RedisStore::new(&settings)
        .expect("redis store")
        .with_test_clock(Arc::new(clock.clone()))
        .into_stack();
    let (s, gate) = server_on(stack, &clock).await;
    let mut c = admin(&s).await;
    let acme = [("tenant", "acme")];
    for _ in 0..3 {
        s.call(one("api", &acme)).await;
    }
    assert_eq!(super::admin::inspect(&mut c, &acme).await.usage, 3);
    let g0 = gate.generation().await.expect("generation");
    let reset = |deadline| {
        let m = pb::ResetRequest {
            domain: "api".into(),
            prefix: entries(&acme),
            reason: "cut".into(),
        };
        with_server_deadline(&s, "Reset", m, deadline)
    };
    cut_by_deadline(&log, &gate, "reset", reset).await;
    eventually("the reset's outcome line", || async {
        log.done("reset") == 1
    })
    .await;
    assert!(log.text().contains("1 counters reset"), "{}", log.text());
    assert_eq!(super::admin::inspect(&mut c, &acme).await.usage, 0);
    let g1 = gate.generation().await.expect("generation");
    assert_eq!(g1, g0 + 2, "bumped before the scans and after");
    s.stop().await;
}

/// The forging text of the review: a newline, then what looks like another caller's line.
const FORGED: &str =
    "x\n2026-01-01T00:00:00Z  INFO sluice::audit: admin write caller=\"bob\" operation=\"reset\"";

/// The binary at `LOG_LEVEL=warn` (envoyproxy's default): every write still has its attempt and
/// outcome lines, and text a caller controls (entry values, a limit name, a reason) stays in
/// its field: one line per record, none forged, in the text format and in JSON.
#[tokio::test]
async fn audit_lines_are_written_at_log_level_warn_and_cannot_be_forged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = certs::write(dir.path(), "rules.yaml", RULES);
    for format in ["text", "json"] {
        let mut cmd = serve(&config);
        // `sluice::server=info` only for the line the test reads the addresses from; the
        // level is warn, and nothing names the audit target.
        cmd.env("LOG_LEVEL", "warn")
            .env("RUST_LOG", "warn,sluice::server=info")
            .env("LOG_FORMAT", format);
        let p = SluiceProcess::spawn(cmd).await;
        let mut c = AdminClient::connect(admin_url(&p, format))
            .await
            .expect("connect");
        c.set_override(pb::SetOverrideRequest {
            entries: entries(&[("tenant", FORGED)]),
            limit_name: FORGED.into(),
            reason: FORGED.into(),
            ..acme_override()
        })
        .await
        .expect("set");
        c.reset(pb::ResetRequest {
            domain: "api".into(),
            prefix: entries(&[("tenant", FORGED)]),
            reason: FORGED.into(),
        })
        .await
        .expect("reset");
        c.delete_override(pb::DeleteOverrideRequest {
            domain: "api".into(),
            entries: entries(&[("tenant", FORGED)]),
            limit_name: FORGED.into(),
            reason: FORGED.into(),
        })
        .await
        .expect("delete");
        let audit = |log: &str| -> Vec<String> {
            let lines = log.lines().filter(|l| l.contains("sluice::audit"));
            lines.map(str::to_string).collect()
        };
        eventually("six audit lines", || {
            let n = audit(&p.log()).len();
            async move { n >= 6 }
        })
        .await;
        let log = p.log();
        let lines = audit(&log);
        assert_eq!(lines.len(), 6, "two per write:\n{log}");
        assert!(
            !log.lines().any(|l| l.starts_with("2026-01-01")),
            "a forged line:\n{log}"
        );
        for (line, (op, phase)) in lines.iter().zip([
            ("set_override", "admin write attempt"),
            ("set_override", "admin write"),
            ("reset", "admin write attempt"),
            ("reset", "admin write"),
            ("delete_override", "admin write attempt"),
            ("delete_override", "admin write"),
        ]) {
            if format == "json" {
                let v: serde_json::Value =
                    serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
                assert_eq!(v["operation"], op, "{line}");
                assert_eq!(v["message"], phase, "{line}");
                assert_eq!(v["reason"], FORGED, "{line}");
                assert_eq!(v["target_entries"], format!("tenant={FORGED}"), "{line}");
            } else {
                assert!(line.contains(" INFO sluice::audit: "), "{line}");
                assert!(line.contains(&format!("operation=\"{op}\"")), "{line}");
                let at = line.find(phase).expect("the message");
                assert!(!line[at + phase.len()..].starts_with(" attempt"), "{line}");
            }
        }
    }
}

/// The admin listener's URL from the listening line, in either log format.
fn admin_url(p: &SluiceProcess, format: &str) -> String {
    if format == "text" {
        return p.admin_url();
    }
    let log = p.log();
    let line = log.lines().find(|l| l.contains("sluice listening"));
    let v: serde_json::Value = serde_json::from_str(line.expect("the listening line"))
        .unwrap_or_else(|e| panic!("{e}: {log}"));
    format!("http://{}", v["admin"].as_str().expect("admin"))
}

/// `reason` and `limit_name` are capped on every write, delete included.
#[tokio::test]
async fn reasons_and_limit_names_past_1_kib_are_refused_on_every_write() {
    let s = TestServer::start(RULES).await;
    let mut c = admin(&s).await;
    let long = "r".repeat(1025);
    let acme = entries(&[("tenant", "acme")]);
    let e = c
        .reset(pb::ResetRequest {
            domain: "api".into(),
            prefix: acme.clone(),
            reason: long.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().starts_with("reason"), "{e:?}");
    for (reason, limit_name, field) in [
        (long.clone(), String::new(), "reason"),
        (String::new(), long.clone(), "limit_name"),
    ] {
        let e = c
            .delete_override(pb::DeleteOverrideRequest {
                domain: "api".into(),
                entries: acme.clone(),
                limit_name: limit_name.clone(),
                reason: reason.clone(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().starts_with(field), "{e:?}");
        let e = c
            .set_override(pb::SetOverrideRequest {
                limit_name,
                reason,
                ..acme_override()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().starts_with(field), "{e:?}");
    }
    // 1 KiB exactly is fine.
    c.reset(pb::ResetRequest {
        domain: "api".into(),
        prefix: acme,
        reason: "r".repeat(1024),
    })
    .await
    .expect("a 1 KiB reason");
    s.stop().await;
}
