//! The running server driven by the external `grpcurl` binary: reflection lists the services,
//! health answers, and the services and the first answer README.md shows are what it prints.

use crate::support::*;

/// The first fenced block of `lang` in README.md's "Try it" section.
fn readme_block(lang: &str) -> String {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let try_it = readme.split("## Try it").nth(1).expect("a Try it section");
    let start = try_it
        .find(&format!("```{lang}\n"))
        .unwrap_or_else(|| panic!("a {lang} block in Try it"))
        + lang.len()
        + 4;
    let len = try_it[start..].find("```").expect("the block ends");
    try_it[start..start + len].to_string()
}

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
    // Exactly the services README.md "Try it" shows.
    let mut listed: Vec<&str> = out
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    listed.sort_unstable();
    let readme = readme_block("text");
    let mut documented: Vec<&str> = readme.lines().map(str::trim).collect();
    documented.sort_unstable();
    assert_eq!(
        listed, documented,
        "README.md's service list vs grpcurl list"
    );

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
            // The answer README.md shows, but for the time left in the minute.
            let mut documented: serde_json::Value =
                serde_json::from_str(&readme_block("json")).expect("README's answer is JSON");
            documented["statuses"][0]["durationUntilReset"] =
                v["statuses"][0]["durationUntilReset"].clone();
            assert_eq!(v, documented, "README.md's first answer vs grpcurl's");
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
