//! The running server driven by the external `grpcurl` binary: reflection lists the services,
//! health answers, and the README's ShouldRateLimit example returns the documented answer.

use crate::support::*;

fn example_config() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/config/examples/basic.yaml");
    std::fs::read_to_string(path).expect("config/examples/basic.yaml exists")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcurl_lists_services_and_calls_should_rate_limit() {
    let s = TestServer::start(&example_config()).await;
    let addr = s.grpc_addr.to_string();

    let a = addr.clone();
    let (ok, out, err) = tokio::task::spawn_blocking(move || grpcurl(&["-plaintext", &a, "list"]))
        .await
        .expect("join");
    assert!(ok, "grpcurl list failed: {err}");
    for svc in [
        "envoy.service.ratelimit.v3.RateLimitService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    ] {
        assert!(
            out.lines().any(|l| l.trim() == svc),
            "{svc} missing in:\n{out}"
        );
    }

    for service in ["", "ratelimit"] {
        let a = addr.clone();
        let body = format!(r#"{{"service":"{service}"}}"#);
        let (ok, out, err) = tokio::task::spawn_blocking(move || {
            grpcurl(&["-plaintext", "-d", &body, &a, "grpc.health.v1.Health/Check"])
        })
        .await
        .expect("join");
        assert!(ok, "health check {service:?} failed: {err}");
        assert!(out.contains("SERVING"), "{out}");
    }

    // The README's example call (keep in sync with README.md "Try it"): tenant acme may call
    // /login 5 times a minute; the sixth call is over the limit.
    let body = r#"{"domain":"example","descriptors":[{"entries":[{"key":"tenant","value":"acme"},{"key":"path","value":"/login"}]}]}"#;
    let mut codes = Vec::new();
    for i in 0..6 {
        let a = addr.clone();
        let (ok, out, err) = tokio::task::spawn_blocking(move || {
            grpcurl(&[
                "-plaintext",
                "-d",
                body,
                &a,
                "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            ])
        })
        .await
        .expect("join");
        assert!(ok, "ShouldRateLimit via grpcurl failed: {err}");
        let v: serde_json::Value = serde_json::from_str(&out).expect("grpcurl prints JSON");
        codes.push(v["overallCode"].as_str().unwrap_or("?").to_string());
        if i == 0 {
            assert_eq!(
                v["statuses"][0]["currentLimit"]["requestsPerUnit"], 5,
                "{out}"
            );
            assert_eq!(v["statuses"][0]["currentLimit"]["unit"], "MINUTE", "{out}");
            assert_eq!(v["statuses"][0]["limitRemaining"], 4, "{out}");
        }
    }
    assert_eq!(codes, ["OK", "OK", "OK", "OK", "OK", "OVER_LIMIT"]);

    // An invalid request: grpcurl reports InvalidArgument.
    let a = addr.clone();
    let (ok, _out, err) = tokio::task::spawn_blocking(move || {
        grpcurl(&[
            "-plaintext",
            "-d",
            r#"{"domain":"","descriptors":[]}"#,
            &a,
            "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        ])
    })
    .await
    .expect("join");
    assert!(!ok);
    assert!(err.contains("InvalidArgument"), "{err}");
    s.stop().await;
}
