//! The HTTP admin endpoints over a real socket: /healthcheck, /json and /rlconfig.

use crate::support::*;

const CONFIG: &str = r#"
domain: web
descriptors:
  - key: client
    value: c1
    rate_limit: {unit: minute, requests_per_unit: 1}
"#;

#[tokio::test]
async fn healthcheck_answers_ok() {
    let s = TestServer::start(CONFIG).await;
    let (status, body) = http(s.http_addr, "GET", "/healthcheck", "").await;
    assert_eq!(status, 200);
    assert!(body.contains("OK"), "{body}");
    s.stop().await;
}

#[tokio::test]
async fn json_endpoint_answers_200_then_429() {
    let s = TestServer::start(CONFIG).await;
    let body = r#"{"domain":"web","descriptors":[{"entries":[{"key":"client","value":"c1"}]}]}"#;
    let (status, out) = http(s.http_addr, "POST", "/json", body).await;
    assert_eq!(status, 200, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("protojson response");
    assert_eq!(v["overallCode"], "OK");
    assert_eq!(v["statuses"][0]["currentLimit"]["requestsPerUnit"], 1);
    assert_eq!(v["statuses"][0]["currentLimit"]["unit"], "MINUTE");

    let (status, out) = http(s.http_addr, "POST", "/json", body).await;
    assert_eq!(status, 429, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("protojson response");
    assert_eq!(v["overallCode"], "OVER_LIMIT");
    assert_eq!(v["statuses"][0]["code"], "OVER_LIMIT");

    // Original proto field names are accepted too, as protojson requires.
    let snake = r#"{"domain":"web","hits_addend":1,"descriptors":[{"entries":[{"key":"client","value":"c2"}]}]}"#;
    let (status, out) = http(s.http_addr, "POST", "/json", snake).await;
    assert_eq!(status, 200, "{out}");
    s.stop().await;
}

#[tokio::test]
async fn json_endpoint_rejects_bad_input_with_400() {
    let s = TestServer::start(CONFIG).await;
    for bad in [
        "not json",
        r#"{"domain":"web","descriptors":"nope"}"#,
        r#"{"domain":"","descriptors":[{"entries":[{"key":"client","value":"c1"}]}]}"#,
        r#"{"domain":"web","descriptors":[]}"#,
        r#"{"domain":"web","unknownField":1,"descriptors":[{"entries":[{"key":"k","value":"v"}]}]}"#,
    ] {
        let (status, out) = http(s.http_addr, "POST", "/json", bad).await;
        assert_eq!(status, 400, "{bad} -> {out}");
        assert!(!out.trim().is_empty(), "the 400 says why");
    }
    s.stop().await;
}

#[tokio::test]
async fn rlconfig_lists_the_loaded_rules() {
    let s = TestServer::start(CONFIG).await;
    let (status, body) = http(s.http_addr, "GET", "/rlconfig", "").await;
    assert_eq!(status, 200);
    assert!(
        body.contains("web.client_c1: unit=MINUTE requests_per_unit=1"),
        "{body}"
    );
    s.stop().await;
}
