//! TLS end to end, over real sockets with certificates generated at test time: the gRPC server
//! with TLS and mutual TLS (tonic clients that trust a CA, or not, and present a client
//! certificate, or not), certificate and CA reload after an atomic rename and after a
//! Kubernetes-style `..data` symlink swap, start-up failures that name the file, the real binary
//! configured by envoyproxy's env vars, and the Redis store over TLS to a real `redis-server`
//! with and without client certificates.

use crate::cases::store::{redis_settings, server_on_redis_settings};
use crate::support::binary::{self, SluiceProcess, BIN};
use crate::support::certs::{self, Ca, Leaf, TlsFiles};
use crate::support::redis::{RedisCluster, RedisServer};
use crate::support::*;
use sluice::clock::ManualClock;
use sluice::proto::rate_limit_response::Code;
use sluice::proto::rate_limit_service_client::RateLimitServiceClient;
use sluice::server::tls::TlsSettings;
use sluice::server::{self, Running, ServerConfig};
use sluice::store::redis::{RedisKind, RedisTlsSettings};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

const RULES: &str = "\
domain: tls
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 1000}
";

async fn start_tls(settings: TlsSettings) -> Running {
    let config = ServerConfig {
        grpc_tls: Some(settings),
        ..ServerConfig::for_tests(rules(RULES), Arc::new(ManualClock::new(T0)))
    };
    server::start(config).await.expect("TLS server starts")
}

/// Fast reloads, so the reload tests take a fraction of a second per step.
fn fast(settings: TlsSettings) -> TlsSettings {
    TlsSettings {
        reload_interval: Duration::from_millis(100),
        ..settings
    }
}

/// One decision over a NEW TLS connection to `addr` (so it sees the certificate served now),
/// trusting only `server_ca` for the server and presenting `identity` if given. Any failure,
/// during the handshake or of the call, comes back as text.
async fn call_tls(
    addr: SocketAddr,
    server_ca: &str,
    identity: Option<&Leaf>,
) -> Result<Code, String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(server_ca))
        .domain_name("localhost");
    if let Some(id) = identity {
        tls = tls.identity(Identity::from_pem(&id.cert_pem, &id.key_pem));
    }
    let endpoint = Endpoint::from_shared(format!("https://127.0.0.1:{}", addr.port()))
        .map_err(|e| format!("endpoint: {e}"))?
        .tls_config(tls)
        .map_err(|e| format!("tls config: {e}"))?
        .connect_timeout(Duration::from_secs(10))
        .timeout(Duration::from_secs(10));
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    let answer = RateLimitServiceClient::new(channel)
        .should_rate_limit(one("tls", &[("k", "v")]))
        .await
        .map_err(|e| format!("call: {e:?}"))?;
    Ok(code(&answer.into_inner()))
}

async fn assert_ok(addr: SocketAddr, server_ca: &str, identity: Option<&Leaf>, what: &str) {
    match call_tls(addr, server_ca, identity).await {
        Ok(Code::Ok) => {}
        other => panic!("{what}: expected an OK decision, got {other:?}"),
    }
}

async fn assert_refused(addr: SocketAddr, server_ca: &str, identity: Option<&Leaf>, what: &str) {
    if let Ok(code) = call_tls(addr, server_ca, identity).await {
        panic!("{what}: expected the connection to be refused, got a decision {code:?}");
    }
}

/// Polls until a fresh connection with these credentials gets a decision (a reload took
/// effect). Panics with the last answer after the poll cap.
async fn eventually_ok(addr: SocketAddr, server_ca: &str, identity: Option<&Leaf>, what: &str) {
    poll_until(what, || async {
        match call_tls(addr, server_ca, identity).await {
            Ok(Code::Ok) => Ok(()),
            other => Err(other),
        }
    })
    .await
}

#[tokio::test]
async fn grpc_tls_serves_clients_that_trust_the_ca_and_refuses_the_others() {
    let files = TlsFiles::new("sluice test CA");
    let running = start_tls(TlsSettings::new(&files.server_cert, &files.server_key)).await;
    let addr = running.grpc_addr();

    assert_ok(addr, &files.ca.pem, None, "a client that trusts the CA").await;
    // A client certificate is not asked for, and not in the way either.
    assert_ok(
        addr,
        &files.ca.pem,
        Some(&files.client),
        "a client with a cert",
    )
    .await;

    let stranger = Ca::new("another CA");
    assert_refused(addr, &stranger.pem, None, "a client that trusts another CA").await;

    // Plaintext gRPC on the TLS port gets no answer.
    let plaintext = async {
        let mut client = RateLimitServiceClient::connect(format!("http://{addr}"))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        client
            .should_rate_limit(one("tls", &[("k", "v")]))
            .await
            .map(|_| ())
            .map_err(|e| format!("call: {e}"))
    };
    let outcome = tokio::time::timeout(Duration::from_secs(30), plaintext)
        .await
        .expect("a plaintext client is answered or cut off, not left hanging");
    assert!(outcome.is_err(), "plaintext gRPC must be refused");

    // The HTTP admin port stays plaintext.
    let (status, _) = http(running.http_addr(), "GET", "/healthcheck", "").await;
    assert_eq!(status, 200);

    // The decisions above went through the service (limit 1000/hour: three charged so far).
    let answer = call_tls(addr, &files.ca.pem, None).await;
    assert_eq!(answer, Ok(Code::Ok));
    running.stop().await.expect("clean stop");
}

#[tokio::test]
async fn mutual_tls_requires_a_client_certificate_signed_by_the_client_ca() {
    let files = TlsFiles::new("sluice test CA");
    let running = start_tls(
        TlsSettings::new(&files.server_cert, &files.server_key).with_client_ca(&files.ca_cert),
    )
    .await;
    let addr = running.grpc_addr();

    assert_refused(addr, &files.ca.pem, None, "a client without a certificate").await;
    assert_ok(
        addr,
        &files.ca.pem,
        Some(&files.client),
        "a client signed by the CA",
    )
    .await;
    let other = Ca::new("another CA").client("impostor");
    assert_refused(addr, &files.ca.pem, Some(&other), "a client of another CA").await;
    // The refusals did not hurt the server: the good client is still served.
    assert_ok(
        addr,
        &files.ca.pem,
        Some(&files.client),
        "the good client again",
    )
    .await;
    running.stop().await.expect("clean stop");
}

/// Server certificate rotation by renaming new files over the old ones (what cert-manager's
/// CSI driver or a `mv` does), client CA rotation, and a corrupt certificate that is ignored.
#[tokio::test]
async fn certificates_and_client_ca_reload_after_an_atomic_rename() {
    let dir = tempfile::tempdir().expect("tempdir");
    let old_ca = Ca::new("server CA 1");
    let old = old_ca.server();
    let clients = Ca::new("client CA 1");
    let client = clients.client("client 1");
    let cert = certs::write(dir.path(), "tls.crt", &old.cert_pem);
    let key = certs::write(dir.path(), "tls.key", &old.key_pem);
    let client_ca = certs::write(dir.path(), "ca.crt", &clients.pem);
    let running = start_tls(fast(
        TlsSettings::new(&cert, &key).with_client_ca(&client_ca),
    ))
    .await;
    let addr = running.grpc_addr();
    assert_ok(addr, &old_ca.pem, Some(&client), "before any change").await;

    // A new server certificate from another CA (key first, then certificate: the moment in
    // between, with a key that fits no certificate, is skipped).
    let new_ca = Ca::new("server CA 2");
    let new = new_ca.server();
    certs::replace_atomically(&key, &new.key_pem);
    certs::replace_atomically(&cert, &new.cert_pem);
    eventually_ok(
        addr,
        &new_ca.pem,
        Some(&client),
        "a client trusting the new CA",
    )
    .await;
    assert_refused(
        addr,
        &old_ca.pem,
        Some(&client),
        "a client trusting the old CA",
    )
    .await;

    // Garbage in the certificate file (written in place), then a new client CA. The watcher
    // reads the CA before the certificate, so once the new CA is in force the garbage has been
    // read too: and the new server certificate is still the one served.
    std::fs::write(&cert, "this is not a certificate\n").expect("write garbage");
    let clients2 = Ca::new("client CA 2");
    let client2 = clients2.client("client 2");
    certs::replace_atomically(&client_ca, &clients2.pem);
    eventually_ok(
        addr,
        &new_ca.pem,
        Some(&client2),
        "a client of the new client CA",
    )
    .await;
    assert_refused(
        addr,
        &new_ca.pem,
        Some(&client),
        "a client of the old client CA",
    )
    .await;
    assert_refused(addr, &old_ca.pem, Some(&client2), "the old server CA").await;
    running.stop().await.expect("clean stop");
}

/// A Kubernetes Secret volume: `tls.crt`, `tls.key` and `ca.crt` are symlinks into `..data`,
/// itself a symlink to a timestamped directory; an update writes a new directory and swaps
/// `..data` atomically (a new symlink renamed over it), so all three files change at once.
struct SecretVolume {
    root: tempfile::TempDir,
    generation: u32,
}

impl SecretVolume {
    fn new(cert: &str, key: &str, ca: &str) -> Self {
        let root = tempfile::tempdir().expect("tempdir");
        let mut volume = Self {
            root,
            generation: 0,
        };
        volume.update(cert, key, ca);
        for name in ["tls.crt", "tls.key", "ca.crt"] {
            std::os::unix::fs::symlink(Path::new("..data").join(name), volume.path(name))
                .expect("file symlink");
        }
        volume
    }

    fn path(&self, name: &str) -> PathBuf {
        self.root.path().join(name)
    }

    /// Writes a new generation and points `..data` at it, as the kubelet does.
    fn update(&mut self, cert: &str, key: &str, ca: &str) {
        self.generation += 1;
        let gen = format!(
            "..2026_01_01_00_00_{:02}.{}",
            self.generation, self.generation
        );
        let dir = self.path(&gen);
        std::fs::create_dir(&dir).expect("generation dir");
        certs::write(&dir, "tls.crt", cert);
        certs::write(&dir, "tls.key", key);
        certs::write(&dir, "ca.crt", ca);
        let tmp = self.path("..data_tmp");
        std::os::unix::fs::symlink(&gen, &tmp).expect("..data_tmp symlink");
        std::fs::rename(&tmp, self.path("..data")).expect("swap ..data");
    }
}

#[tokio::test]
async fn certificates_reload_after_a_kubernetes_secret_symlink_swap() {
    let ca1 = Ca::new("CA 1");
    let server1 = ca1.server();
    let client1 = ca1.client("client 1");
    let mut volume = SecretVolume::new(&server1.cert_pem, &server1.key_pem, &ca1.pem);
    let running = start_tls(fast(
        TlsSettings::new(volume.path("tls.crt"), volume.path("tls.key"))
            .with_client_ca(volume.path("ca.crt")),
    ))
    .await;
    let addr = running.grpc_addr();
    assert_ok(addr, &ca1.pem, Some(&client1), "generation 1").await;

    // Everything rotates to a new CA at once.
    let ca2 = Ca::new("CA 2");
    let server2 = ca2.server();
    let client2 = ca2.client("client 2");
    volume.update(&server2.cert_pem, &server2.key_pem, &ca2.pem);
    eventually_ok(addr, &ca2.pem, Some(&client2), "generation 2").await;
    assert_refused(addr, &ca1.pem, Some(&client1), "generation 1's client").await;
    assert_refused(
        addr,
        &ca2.pem,
        Some(&client1),
        "a client cert of the old CA",
    )
    .await;

    // A broken generation: garbage certificate, same key, a new client CA. The CA applies
    // (it parses), the certificate does not: the generation-2 certificate keeps serving.
    let ca3 = Ca::new("CA 3");
    let client3 = ca3.client("client 3");
    volume.update(
        "-----BEGIN CERTIFICATE-----\ngarbage\n",
        &server2.key_pem,
        &ca3.pem,
    );
    eventually_ok(addr, &ca2.pem, Some(&client3), "generation 3's client CA").await;
    assert_refused(
        addr,
        &ca2.pem,
        Some(&client2),
        "a client of the replaced CA",
    )
    .await;
    running.stop().await.expect("clean stop");
}

async fn start_error(settings: TlsSettings) -> String {
    let config = ServerConfig {
        grpc_tls: Some(settings),
        ..ServerConfig::for_tests(rules(RULES), Arc::new(ManualClock::new(T0)))
    };
    match server::start(config).await {
        Ok(running) => {
            running.stop().await.expect("clean stop");
            panic!("the server started with broken TLS files");
        }
        Err(e) => e.to_string(),
    }
}

#[tokio::test]
async fn broken_tls_files_stop_the_start_naming_the_file() {
    let files = TlsFiles::new("sluice test CA");
    let dir = files.dir();
    let missing = dir.join("missing.crt");
    let e = start_error(TlsSettings::new(&missing, &files.server_key)).await;
    assert!(e.contains(&missing.display().to_string()), "{e}");
    assert!(e.contains("certificate"), "{e}");

    let garbage = certs::write(dir, "garbage.pem", "hello\n");
    let e = start_error(TlsSettings::new(&garbage, &files.server_key)).await;
    assert!(e.contains(&garbage.display().to_string()), "{e}");
    let e = start_error(TlsSettings::new(&files.server_cert, &garbage)).await;
    assert!(e.contains(&garbage.display().to_string()), "{e}");
    assert!(e.contains("private key"), "{e}");

    // The client's key with the server's certificate.
    let e = start_error(TlsSettings::new(&files.server_cert, &files.client_key)).await;
    assert!(e.contains(&files.client_key.display().to_string()), "{e}");
    assert!(e.contains("does not belong"), "{e}");

    let e = start_error(
        TlsSettings::new(&files.server_cert, &files.server_key).with_client_ca(&garbage),
    )
    .await;
    assert!(e.contains(&garbage.display().to_string()), "{e}");
    assert!(e.contains("client CA"), "{e}");
}

/// The binary configured only by envoyproxy's env vars serves mutual TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_mutual_tls_from_envoyproxy_env_vars() {
    let files = TlsFiles::new("sluice test CA");
    let config = certs::write(files.dir(), "rules.yaml", RULES);
    let mut command = binary::serve(&config);
    command
        .env("GRPC_SERVER_USE_TLS", "true")
        .env("GRPC_SERVER_TLS_CERT", &files.server_cert)
        .env("GRPC_SERVER_TLS_KEY", &files.server_key)
        .env("GRPC_CLIENT_TLS_CACERT", &files.ca_cert);
    let mut sluice = SluiceProcess::spawn(command).await;
    let addr = sluice.grpc;
    assert_eq!(
        call_tls(addr, &files.ca.pem, Some(&files.client)).await,
        Ok(Code::Ok),
        "the binary serves mTLS:\n{}",
        sluice.log()
    );
    assert_refused(addr, &files.ca.pem, None, "no client certificate").await;
    sluice.child.start_kill().expect("kill sluice");
    let _ = sluice.exit().await;
}

#[test]
fn the_binary_refuses_to_start_on_a_missing_certificate_and_names_it() {
    let files = TlsFiles::new("sluice test CA");
    let config = certs::write(files.dir(), "rules.yaml", RULES);
    let missing = files.dir().join("nope").join("tls.crt");
    let out = std::process::Command::new(BIN)
        .args(["serve", "--config", config.to_str().expect("utf-8 path")])
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", "0")
        .env("HOST", "127.0.0.1")
        .env("PORT", "0")
        .env("GRPC_SERVER_USE_TLS", "1")
        .env("GRPC_SERVER_TLS_CERT", &missing)
        .env("GRPC_SERVER_TLS_KEY", &files.server_key)
        .env_remove("REDIS_URL")
        .env_remove("GRPC_CLIENT_TLS_CACERT")
        .output()
        .expect("run sluice");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&missing.display().to_string()), "{stderr}");
}

// ---------------------------------------------------------------------------------------------
// Redis over TLS
// ---------------------------------------------------------------------------------------------

async fn start_redis_tls(files: &Arc<TlsFiles>, auth_clients: bool) -> RedisServer {
    let files = Arc::clone(files);
    tokio::task::spawn_blocking(move || RedisServer::start_tls(&files, auth_clients))
        .await
        .expect("start redis-server with TLS")
}

fn redis_tls(ca: Option<&Path>, client: Option<(&Path, &Path)>) -> RedisTlsSettings {
    RedisTlsSettings {
        ca_cert: ca.map(Path::to_path_buf),
        client_cert: client.map(|(c, _)| c.to_path_buf()),
        client_key: client.map(|(_, k)| k.to_path_buf()),
        skip_hostname_verification: false,
    }
}

/// A sluice whose store is the Redis at `redis`'s `rediss://` URL with these TLS settings.
async fn sluice_on(redis: &RedisServer, tls: RedisTlsSettings) -> TestServer {
    let settings = sluice::store::redis::RedisSettings {
        tls,
        ..redis_settings(vec![redis.tls_url()], RedisKind::Single)
    };
    server_on_redis_settings(RULES, &settings).await
}

/// [`sluice_on`] for a connection that is expected to fail: a failed connect costs the whole
/// Redis timeout (the pool waits that long for a connection), once for the start-up probe and
/// once per call, so the timeout is short here. A TLS failure itself is immediate.
async fn failing_sluice_on(redis: &RedisServer, tls: RedisTlsSettings) -> TestServer {
    let settings = sluice::store::redis::RedisSettings {
        tls,
        timeout: Duration::from_millis(500),
        ..redis_settings(vec![redis.tls_url()], RedisKind::Single)
    };
    server_on_redis_settings(RULES, &settings).await
}

async fn decide(s: &TestServer) -> Result<Code, tonic::Code> {
    s.client()
        .await
        .should_rate_limit(one("tls", &[("k", "v")]))
        .await
        .map(|r| code(&r.into_inner()))
        .map_err(|e| e.code())
}

/// The keys sluice wrote, read back through `redis-cli --tls`.
fn sluice_keys(redis: &RedisServer) -> Vec<String> {
    redis
        .tls_cli(&["KEYS", "sluice_test:*"])
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

#[tokio::test]
async fn redis_over_tls_trusting_the_ca_charges_the_counter() {
    let files = Arc::new(TlsFiles::new("redis CA"));
    let redis = start_redis_tls(&files, false).await;

    let s = sluice_on(&redis, redis_tls(Some(&files.ca_cert), None)).await;
    let answer = s.call(one("tls", &[("k", "v")])).await;
    assert_eq!(code(&answer), Code::Ok);
    assert_eq!(answer.statuses[0].limit_remaining, 999, "charged once");
    let keys = sluice_keys(&redis);
    assert_eq!(keys.len(), 1, "one counter in Redis: {keys:?}");
    assert!(keys[0].contains("tls"), "{keys:?}");

    // Without the CA only the system roots are trusted, and they did not sign this Redis.
    let untrusting = failing_sluice_on(&redis, RedisTlsSettings::default()).await;
    assert_eq!(decide(&untrusting).await, Err(tonic::Code::Unavailable));

    untrusting.stop().await;
    s.stop().await;
}

#[tokio::test]
async fn redis_requiring_client_certificates_takes_only_the_configured_one() {
    let files = Arc::new(TlsFiles::new("redis CA"));
    let redis = start_redis_tls(&files, true).await;

    let anonymous = failing_sluice_on(&redis, redis_tls(Some(&files.ca_cert), None)).await;
    assert_eq!(decide(&anonymous).await, Err(tonic::Code::Unavailable));

    let stranger = Ca::new("another CA").client("stranger");
    let stranger_cert = certs::write(files.dir(), "stranger.crt", &stranger.cert_pem);
    let stranger_key = certs::write(files.dir(), "stranger.key", &stranger.key_pem);
    let impostor = failing_sluice_on(
        &redis,
        redis_tls(Some(&files.ca_cert), Some((&stranger_cert, &stranger_key))),
    )
    .await;
    assert_eq!(decide(&impostor).await, Err(tonic::Code::Unavailable));
    assert!(
        sluice_keys(&redis).is_empty(),
        "refused clients wrote nothing"
    );

    let authenticated = sluice_on(
        &redis,
        redis_tls(
            Some(&files.ca_cert),
            Some((&files.client_cert, &files.client_key)),
        ),
    )
    .await;
    assert_eq!(decide(&authenticated).await, Ok(Code::Ok));
    assert_eq!(sluice_keys(&redis).len(), 1);

    authenticated.stop().await;
    impostor.stop().await;
    anonymous.stop().await;
}

#[tokio::test]
async fn redis_hostname_verification_can_be_skipped() {
    let files = TlsFiles::new("redis CA");
    // Redis presents a certificate for a name, while sluice connects to 127.0.0.1.
    let named = files.ca.server_named("redis.example.internal");
    certs::write(files.dir(), "server.crt", &named.cert_pem);
    certs::write(files.dir(), "server.key", &named.key_pem);
    let files = Arc::new(files);
    let redis = start_redis_tls(&files, false).await;

    let strict = failing_sluice_on(&redis, redis_tls(Some(&files.ca_cert), None)).await;
    assert_eq!(decide(&strict).await, Err(tonic::Code::Unavailable));

    let lenient = sluice_on(
        &redis,
        RedisTlsSettings {
            skip_hostname_verification: true,
            ..redis_tls(Some(&files.ca_cert), None)
        },
    )
    .await;
    assert_eq!(decide(&lenient).await, Ok(Code::Ok));

    // Skipping the name check still verifies the chain: another CA's Redis is refused.
    let other = TlsFiles::new("another CA");
    let unrelated = failing_sluice_on(
        &redis,
        RedisTlsSettings {
            skip_hostname_verification: true,
            ..redis_tls(Some(&other.ca_cert), None)
        },
    )
    .await;
    assert_eq!(decide(&unrelated).await, Err(tonic::Code::Unavailable));

    unrelated.stop().await;
    lenient.stop().await;
    strict.stop().await;
}

#[tokio::test]
async fn redis_cluster_over_tls_with_client_certificates() {
    let files = Arc::new(TlsFiles::new("redis cluster CA"));
    let for_start = Arc::clone(&files);
    let cluster = tokio::task::spawn_blocking(move || RedisCluster::start_tls(&for_start, true))
        .await
        .expect("start a Redis Cluster with TLS");
    let tls = redis_tls(
        Some(&files.ca_cert),
        Some((&files.client_cert, &files.client_key)),
    );
    let settings = sluice::store::redis::RedisSettings {
        tls: tls.clone(),
        ..redis_settings(cluster.tls_seeds(), RedisKind::Cluster)
    };
    let s = server_on_redis_settings(RULES, &settings).await;
    // Enough distinct counters to land on every master (each one its own TLS connection).
    let values: Vec<String> = (0..12).map(|i| format!("v{i}")).collect();
    for v in &values {
        let answer = s.call(one("tls", &[("k", v)])).await;
        assert_eq!(code(&answer), Code::Ok, "{v}");
        assert_eq!(answer.statuses[0].limit_remaining, 999, "{v}");
    }
    let per_node: Vec<usize> = (0..3).map(|i| sluice_keys(cluster.node(i)).len()).collect();
    assert_eq!(per_node.iter().sum::<usize>(), values.len(), "{per_node:?}");
    assert!(
        per_node.iter().all(|n| *n > 0),
        "every master holds counters: {per_node:?}"
    );
    // And through redirects from one node.
    let first_key = sluice_keys(cluster.node(0))[0].clone();
    assert_eq!(cluster.tls_cli_cluster(&["EXISTS", &first_key]).trim(), "1");

    // The same cluster refuses a client without a certificate.
    let anonymous = sluice::store::redis::RedisSettings {
        tls: redis_tls(Some(&files.ca_cert), None),
        timeout: Duration::from_millis(500),
        ..redis_settings(cluster.tls_seeds(), RedisKind::Cluster)
    };
    let refused = server_on_redis_settings(RULES, &anonymous).await;
    assert_eq!(decide(&refused).await, Err(tonic::Code::Unavailable));

    refused.stop().await;
    s.stop().await;
}

#[tokio::test]
async fn broken_redis_tls_files_stop_the_store_naming_the_file() {
    let files = TlsFiles::new("redis CA");
    let garbage = certs::write(files.dir(), "garbage.pem", "hello\n");
    let missing = files.dir().join("missing.pem");
    let url = vec!["rediss://127.0.0.1:1".to_string()];
    for (tls, named) in [
        (redis_tls(Some(&missing), None), &missing),
        (redis_tls(Some(&garbage), None), &garbage),
        (
            redis_tls(None, Some((&garbage, &files.client_key))),
            &garbage,
        ),
        (
            redis_tls(None, Some((&files.client_cert, &garbage))),
            &garbage,
        ),
        // The server's key with the client's certificate.
        (
            redis_tls(None, Some((&files.client_cert, &files.server_key))),
            &files.server_key,
        ),
    ] {
        let settings = sluice::store::redis::RedisSettings {
            tls,
            ..redis_settings(url.clone(), RedisKind::Single)
        };
        let e = sluice::store::redis::RedisStore::new(&settings)
            .map(|_| ())
            .expect_err("broken TLS files are refused");
        assert!(e.to_string().contains(&named.display().to_string()), "{e}");
    }
    // The same files are not read at all for a plaintext Redis.
    let settings = sluice::store::redis::RedisSettings {
        tls: redis_tls(Some(&missing), None),
        ..redis_settings(vec!["redis://127.0.0.1:1".into()], RedisKind::Single)
    };
    assert!(sluice::store::redis::RedisStore::new(&settings).is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sluice_bench_speaks_mutual_tls() {
    let files = TlsFiles::new("sluice test CA");
    let running = start_tls(
        TlsSettings::new(&files.server_cert, &files.server_key).with_client_ca(&files.ca_cert),
    )
    .await;
    let path = |p: &std::path::Path| p.display().to_string();
    let mut args: Vec<String> = [
        "--target",
        &format!("https://127.0.0.1:{}", running.grpc_addr().port()),
        "--domain",
        "tls",
        "--descriptor",
        "k=v{id}",
        "--consumers",
        "10",
        "--concurrency",
        "2",
        "--connections",
        "1",
        "--duration",
        "200ms",
        "--ca-cert",
        &path(&files.ca_cert),
        "--tls-server-name",
        "localhost",
        "--seed",
        "1",
    ]
    .map(String::from)
    .to_vec();
    let without_client_cert = args.clone();
    args.extend([
        "--client-cert".into(),
        path(&files.client_cert),
        "--client-key".into(),
        path(&files.client_key),
    ]);
    let summary = crate::support::binary::bench(&args)
        .await
        .expect("bench runs");
    let decisions = summary["decisions"].as_u64().expect("decisions");
    assert!(decisions > 0, "{summary}");
    assert_eq!(summary["errors"], 0, "{summary}");
    assert_eq!(summary["ok"], decisions, "1000 an hour: nothing denied");
    // Without its client certificate the server refuses it.
    match crate::support::binary::bench(&without_client_cert).await {
        Err(e) => assert!(e.contains("cannot connect"), "{e}"),
        Ok(s) => assert!(s["decisions"] == 0 && s["errors"] != 0, "{s}"),
    }
    running.stop().await.expect("stops");
}

/// `/json` on the plaintext HTTP port follows gRPC's TLS (issue 38): with mutual TLS on gRPC it
/// is refused (it has no client certificate to check) unless `JSON_ENDPOINT` turns it on, and
/// `is_negative_hits` is refused there unless `JSON_ALLOW_NEGATIVE_HITS`; with plaintext gRPC
/// both are served, and refunds can be turned off.
#[tokio::test]
async fn json_follows_grpc_tls_and_refuses_refunds_with_it() {
    let files = TlsFiles::new("sluice test CA");
    let mtls =
        || TlsSettings::new(&files.server_cert, &files.server_key).with_client_ca(&files.ca_cert);
    let charge = r#"{"domain":"tls","descriptors":[{"entries":[{"key":"k","value":"v"}]}]}"#;
    let refund = r#"{"domain":"tls","descriptors":[{"entries":[{"key":"k","value":"v"}],"hitsAddend":1,"isNegativeHits":true}]}"#;
    let start = |tls: Option<TlsSettings>, serve: Option<bool>, refunds: Option<bool>| {
        let config = ServerConfig {
            grpc_tls: tls,
            json_endpoint: serve,
            json_negative_hits: refunds,
            ..ServerConfig::for_tests(rules(RULES), Arc::new(ManualClock::new(T0)))
        };
        async move { server::start(config).await.expect("server starts") }
    };
    let status = |running: &Running, body: &'static str| {
        let addr = running.http_addr();
        async move { http_request(addr, "POST", "/json", &[], body).await.0 }
    };
    // mTLS on gRPC: /json refused by default, whatever the body.
    let tls = start(Some(mtls()), None, None).await;
    assert_eq!(status(&tls, charge).await, 403);
    assert_eq!(status(&tls, refund).await, 403);
    tls.stop().await.expect("stop");
    // Turned on: decisions served, refunds still refused.
    let tls = start(Some(mtls()), Some(true), None).await;
    assert_eq!(status(&tls, charge).await, 200);
    assert_eq!(status(&tls, refund).await, 403);
    tls.stop().await.expect("stop");
    // Plaintext gRPC: both served (envoyproxy's behaviour); refunds can be refused.
    let plain = start(None, None, None).await;
    assert_eq!(status(&plain, charge).await, 200);
    assert_eq!(status(&plain, refund).await, 200);
    plain.stop().await.expect("stop");
    let plain = start(None, None, Some(false)).await;
    assert_eq!(status(&plain, refund).await, 403);
    assert_eq!(status(&plain, charge).await, 200);
    plain.stop().await.expect("stop");
}
