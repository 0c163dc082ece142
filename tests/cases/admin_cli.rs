//! The admin API as operators reach it: the binary's own listener (never the RLS nor the HTTP
//! port), `sluice admin` and grpcurl against two replicas on Redis, the audit lines, the refusal
//! to open a reachable listener without authentication, and client certificates.

use super::admin::{entries, RULES};
use crate::support::binary::{bin, serve, SluiceProcess};
use crate::support::certs::{self, Ca, TlsFiles};
use crate::support::redis::start_redis;
use crate::support::{grpcurl, http, one, rules, TestServer, T0};
use sluice::app::Ingredients;
use sluice::clock::ManualClock;
use sluice::proto::sluice::admin::v1 as pb;
use sluice::proto::sluice::admin::v1::admin_client::AdminClient;
use sluice::server::tls::TlsSettings;
use sluice::server::ServerConfig;
use std::sync::Arc;
use std::time::Duration;

const OPS: &str = "ops-token-0123456789";
const VIEWER: &str = "viewer-token-0123456";

/// `sluice admin <args>` with the ops token; (success, stdout, stderr).
async fn sluice_admin(url: &str, token: Option<&str>, args: &[&str]) -> (bool, String, String) {
    let mut cmd = std::process::Command::new(bin());
    cmd.arg("admin").arg("--url").arg(url);
    if let Some(t) = token {
        cmd.arg("--token").arg(t);
    }
    cmd.args(args).env_remove("SLUICE_ADMIN_TOKEN");
    let out = tokio::task::spawn_blocking(move || cmd.output().expect("run sluice admin"))
        .await
        .expect("join");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

async fn grpcurl_async(args: Vec<String>) -> (bool, String, String) {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        grpcurl(&args)
    })
    .await
    .expect("join")
}

fn json(out: &str) -> serde_json::Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

#[tokio::test]
async fn sluice_admin_and_grpcurl_drive_two_replicas_on_their_own_listener() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = certs::write(dir.path(), "rules.yaml", RULES);
    let tokens = certs::write(
        dir.path(),
        "tokens",
        &format!("ops read,write {OPS}\nviewer read {VIEWER}\n"),
    );
    let redis = start_redis(&[]).await;
    let replica = || {
        let mut c = serve(&config);
        c.env("REDIS_URL", redis.url())
            .env("ADMIN_TOKENS_FILE", &tokens);
        SluiceProcess::spawn(c)
    };
    let (a, b) = (replica().await, replica().await);
    let (admin_a, admin_b) = (a.admin_url(), b.admin_url());
    let admin_b_addr = admin_b.trim_start_matches("http://").to_string();

    // The admin service is on its own listener only.
    let (ok, listed, err) = grpcurl_async(vec![
        "-plaintext".into(),
        admin_b_addr.clone(),
        "list".into(),
    ])
    .await;
    assert!(ok, "{err}");
    assert!(listed.contains("sluice.admin.v1.Admin"), "{listed}");
    assert!(!listed.contains("ratelimit"), "{listed}");
    let (ok, listed, err) =
        grpcurl_async(vec!["-plaintext".into(), a.grpc.to_string(), "list".into()]).await;
    assert!(ok, "{err}");
    assert!(!listed.contains("sluice.admin"), "{listed}");
    let body = r#"{"domain":"api","entries":[{"key":"tenant","value":"acme"}]}"#;
    let (ok, _, err) = grpcurl_async(vec![
        "-plaintext".into(),
        "-d".into(),
        body.into(),
        a.grpc.to_string(),
        "sluice.admin.v1.Admin/Inspect".into(),
    ])
    .await;
    assert!(!ok, "the RLS port must not serve the admin API");
    assert!(
        err.contains("Unimplemented") || err.contains("not expose"),
        "{err}"
    );
    let (status, _) = http(a.http, "POST", "/sluice.admin.v1.Admin/Inspect", body).await;
    assert_eq!(status, 404, "the HTTP port must not serve the admin API");

    // 7 requests through replica a; replica b's admin API sees them, charging nothing.
    let mut rls = sluice::RateLimitServiceClient::connect(a.grpc_url())
        .await
        .expect("connect");
    for _ in 0..7 {
        rls.should_rate_limit(one("api", &[("tenant", "acme")]))
            .await
            .expect("call");
    }
    let (ok, out, err) =
        sluice_admin(&admin_b, Some(VIEWER), &["inspect", "api", "tenant=acme"]).await;
    assert!(ok, "{err}");
    let limit = &json(&out)["limits"][0];
    assert_eq!(limit["usage"], "7", "{out}");
    assert_eq!(limit["remaining"], 3, "{out}");
    let (ok, out, err) = grpcurl_async(vec![
        "-plaintext".into(),
        "-H".into(),
        format!("authorization: Bearer {VIEWER}"),
        "-d".into(),
        body.into(),
        admin_b_addr.clone(),
        "sluice.admin.v1.Admin/Inspect".into(),
    ])
    .await;
    assert!(ok, "{err}");
    assert_eq!(json(&out)["limits"][0]["remaining"], 3, "{out}");

    // Writes: refused without a token or with the read scope; done with the write scope.
    let (ok, _, err) = sluice_admin(&admin_a, None, &["reset", "api", "tenant=acme"]).await;
    assert!(!ok && err.contains("Unauthenticated"), "{err}");
    let (ok, _, err) = sluice_admin(&admin_a, Some(VIEWER), &["reset", "api", "tenant=acme"]).await;
    assert!(!ok && err.contains("PermissionDenied"), "{err}");
    let (ok, out, err) = sluice_admin(
        &admin_a,
        Some(OPS),
        &["reset", "api", "tenant=acme", "--reason", "ticket 4411"],
    )
    .await;
    assert!(ok, "{err}");
    assert_eq!(json(&out)["counters"], "1", "{out}");
    let (ok, _, err) = sluice_admin(
        &admin_a,
        Some(OPS),
        &[
            "override",
            "set",
            "api",
            "tenant=acme",
            "--limit",
            "50",
            "--ttl",
            "1m",
            "--reason",
            "launch",
        ],
    )
    .await;
    assert!(ok, "{err}");
    let (ok, out, err) = sluice_admin(&admin_b, Some(VIEWER), &["override", "list"]).await;
    assert!(ok, "{err}");
    let listed = &json(&out)["overrides"];
    assert_eq!(listed[0]["requestsPerUnit"], 50, "{out}");
    assert_eq!(listed[0]["setBy"], "ops", "{out}");

    // Every write has its outcome line, after its attempt line (the refused ones never
    // reached a write).
    let log = a.log();
    let attempts = log.lines().filter(|l| l.contains("admin write attempt"));
    assert_eq!(attempts.count(), 2, "{log}");
    let audit: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("admin write") && !l.contains("admin write attempt"))
        .collect();
    assert_eq!(audit.len(), 2, "{log}");
    assert!(
        audit[0].contains("caller=\"ops\"") || audit[0].contains("caller=ops"),
        "{}",
        audit[0]
    );
    assert!(audit[0].contains("operation=\"reset\"") || audit[0].contains("operation=reset"));
    assert!(audit[0].contains("ticket 4411") && audit[0].contains("1 counters reset"));
    assert!(audit[1].contains("set_override") && audit[1].contains("50 until"));
    assert!(audit[1].contains("before=\"none\""), "{}", audit[1]);
}

#[tokio::test]
async fn a_reachable_admin_listener_without_authentication_refuses_to_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = certs::write(dir.path(), "rules.yaml", RULES);
    let mut c = serve(&config);
    c.env("ADMIN_HOST", "0.0.0.0");
    let out = c.output().await.expect("run sluice");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("without authentication"), "{err}");
    assert!(err.contains("ADMIN_TOKENS_FILE"), "{err}");
    // With tokens, it starts on that address (and warns that tokens travel in plaintext).
    let tokens = certs::write(dir.path(), "tokens", &format!("ops write {OPS}\n"));
    let mut c = serve(&config);
    c.env("ADMIN_HOST", "0.0.0.0")
        .env("ADMIN_TOKENS_FILE", &tokens);
    let s = SluiceProcess::spawn(c).await;
    assert!(s.admin_url().starts_with("http://0.0.0.0:"), "{}", s.log());
    assert!(s.log().contains("in plaintext"), "{}", s.log());
    // A tokens file that does not parse is a start-up error naming its line.
    let bad = certs::write(dir.path(), "bad-tokens", "ops write\n");
    let mut c = serve(&config);
    c.env("ADMIN_TOKENS_FILE", &bad);
    let out = c.output().await.expect("run sluice");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("bad-tokens:1"), "{err}");
}

/// A client certificate the admin CA signed names the caller; another CA's, or none, gets no
/// connection.
#[tokio::test]
async fn client_certificates_authenticate_admin_callers() {
    let files = TlsFiles::new("sluice admin CA");
    let clock = ManualClock::new(T0 + Duration::from_secs(600));
    let base = Ingredients::for_tests(rules(RULES), Arc::new(clock.clone()));
    let mut config = ServerConfig::from_ingredients(base);
    if let Some(a) = config.admin.as_mut() {
        a.tls = Some(
            TlsSettings::new(&files.server_cert, &files.server_key).with_client_ca(&files.ca_cert),
        );
        a.auth.client_cert_scopes = Some(sluice::admin::Scopes::ALL);
    }
    let s = TestServer::start_config(config, clock).await;
    let addr = s
        .running
        .as_ref()
        .and_then(|r| r.admin_addr())
        .expect("admin");
    let client = |cert: Option<(&str, &str)>| {
        let mut tls = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&files.ca.pem))
            .domain_name("localhost");
        if let Some((c, k)) = cert {
            tls = tls.identity(tonic::transport::Identity::from_pem(c, k));
        }
        let endpoint = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
            .expect("endpoint")
            .tls_config(tls)
            .expect("tls");
        async move {
            let channel = endpoint.connect().await?;
            let mut c = AdminClient::new(channel);
            c.set_override(pb::SetOverrideRequest {
                domain: "api".into(),
                entries: entries(&[("tenant", "acme")]),
                limit: Some(pb::set_override_request::Limit::RequestsPerUnit(20)),
                ttl_seconds: 60,
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner())
            .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
        }
    };
    let o = client(Some((&files.client.cert_pem, &files.client.key_pem)))
        .await
        .expect("the CA's client writes");
    assert_eq!(o.set_by, "sluice test client");
    let stranger = Ca::new("another CA").client("mallory");
    assert!(
        client(Some((&stranger.cert_pem, &stranger.key_pem)))
            .await
            .is_err(),
        "another CA's certificate is refused"
    );
    assert!(client(None).await.is_err(), "no certificate is refused");
    // Nothing but the CA's client changed anything: one override, by it.
    let mut plain = admin_over_tls(&files, addr).await;
    let listed = plain
        .list_overrides(pb::ListOverridesRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert_eq!(listed.overrides.len(), 1);
    assert_eq!(listed.overrides[0].set_by, "sluice test client");
    s.stop().await;
}

async fn admin_over_tls(
    files: &TlsFiles,
    addr: std::net::SocketAddr,
) -> AdminClient<tonic::transport::Channel> {
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(&files.ca.pem))
        .domain_name("localhost")
        .identity(tonic::transport::Identity::from_pem(
            &files.client.cert_pem,
            &files.client.key_pem,
        ));
    let channel = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
        .expect("endpoint")
        .tls_config(tls)
        .expect("tls")
        .connect()
        .await
        .expect("connect");
    AdminClient::new(channel)
}
