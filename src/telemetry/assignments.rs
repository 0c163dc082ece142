//! What the quota service has assigned, per open RLQS stream and bucket, for
//! `/debug/rlqs`: an operator asking "why does Envoy deny this key" sees the token rate, the
//! TTL, the reservation and the demand sluice measured. Bucket values are usually API keys, so
//! they are shown only as their length unless the server was started to show them
//! (`RLQS_DEBUG_SHOW_VALUES`). Bounded by the quota service's bucket caps (one entry per
//! tracked bucket) and emptied as buckets are abandoned and streams end.

use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

/// One bucket's current assignment.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AssignmentView {
    /// `token_bucket`, `allow_all` or `deny_all`.
    pub action: &'static str,
    /// The token bucket's refill, requests per second (0 for a blanket rule).
    pub tokens_per_second: f64,
    pub ttl_seconds: u64,
    /// Tokens reserved on the counter for this stream until its next report.
    pub reserved: u64,
    /// The demand sluice measured for this stream, requests per second.
    pub demand: Option<f64>,
}

#[derive(Debug, Clone)]
struct StreamView {
    domain: String,
    buckets: HashMap<Arc<[(String, String)]>, AssignmentView>,
}

/// The live assignments of every stream of this process.
#[derive(Debug)]
pub struct Assignments {
    streams: Mutex<HashMap<u64, StreamView>>,
}

impl Assignments {
    pub fn new() -> Self {
        Self {
            streams: Mutex::new(HashMap::new()),
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut HashMap<u64, StreamView>) -> T) -> T {
        f(&mut self.streams.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Records `bucket`'s assignment on `stream` of `domain`.
    pub fn set(
        &self,
        stream: u64,
        domain: &str,
        bucket: &Arc<[(String, String)]>,
        a: AssignmentView,
    ) {
        self.with(|all| {
            let s = all.entry(stream).or_insert_with(|| StreamView {
                domain: domain.to_string(),
                buckets: HashMap::new(),
            });
            s.buckets.insert(Arc::clone(bucket), a);
        });
    }

    /// Forgets an abandoned bucket.
    pub fn remove_bucket(&self, stream: u64, bucket: &[(String, String)]) {
        self.with(|all| {
            if let Some(s) = all.get_mut(&stream) {
                s.buckets.remove(bucket);
            }
        });
    }

    /// Forgets a stream that ended.
    pub fn remove_stream(&self, stream: u64) {
        self.with(|all| all.remove(&stream));
    }

    /// The `/debug/rlqs` document: per stream, its domain and each bucket's assignment, the
    /// buckets named by their pairs (values redacted unless `show_values`), at most `limit`
    /// buckets in all.
    pub fn report(
        &self,
        domain: Option<&str>,
        limit: usize,
        show_values: bool,
    ) -> serde_json::Value {
        let streams = self.with(|all| {
            let mut ids: Vec<u64> = all.keys().copied().collect();
            ids.sort_unstable();
            let mut left = limit;
            let mut out = Vec::new();
            for id in ids {
                let s = &all[&id];
                if domain.is_some_and(|d| d != s.domain) {
                    continue;
                }
                let mut buckets = BTreeMap::new();
                for (pairs, a) in &s.buckets {
                    if left == 0 {
                        break;
                    }
                    left -= 1;
                    buckets.insert(name(pairs, show_values), a.clone());
                }
                out.push(serde_json::json!({
                    "stream": id,
                    "domain": s.domain,
                    "buckets_total": s.buckets.len(),
                    "buckets": buckets,
                }));
            }
            out
        });
        serde_json::json!({
            "values_shown": show_values,
            "streams": streams,
        })
    }
}

/// `k=v,k2=v2`, each value as `<n bytes>` unless values are shown.
fn name(pairs: &[(String, String)], show_values: bool) -> String {
    pairs
        .iter()
        .map(|(k, v)| {
            if show_values {
                format!("{k}={v}")
            } else {
                format!("{k}=<{} bytes>", v.len())
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

impl Default for Assignments {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(rate: f64) -> AssignmentView {
        AssignmentView {
            action: "token_bucket",
            tokens_per_second: rate,
            ttl_seconds: 15,
            reserved: 60,
            demand: Some(12.0),
        }
    }

    #[test]
    fn bucket_values_are_redacted_unless_shown_and_the_listing_is_bounded() {
        let bucket: Arc<[(String, String)]> =
            Arc::from(vec![("x-api-key".to_string(), "secret-key".to_string())]);
        let a = Assignments::new();
        a.set(1, "rlqs", &bucket, view(10.0));
        let other: Arc<[(String, String)]> =
            Arc::from(vec![("x-api-key".to_string(), "other".to_string())]);
        a.set(1, "rlqs", &other, view(2.0));
        let r = a.report(None, 100, false).to_string();
        assert!(!r.contains("secret-key"), "{r}");
        assert!(r.contains("x-api-key=<10 bytes>"), "{r}");
        let limited = a.report(None, 1, false);
        assert_eq!(limited["streams"][0]["buckets_total"], 2);
        assert_eq!(
            limited["streams"][0]["buckets"]
                .as_object()
                .map(|b| b.len()),
            Some(1)
        );
        assert_eq!(
            a.report(Some("other"), 100, false)["streams"],
            serde_json::json!([])
        );
        assert!(a
            .report(None, 10, true)
            .to_string()
            .contains("x-api-key=secret-key"));
        a.remove_bucket(1, &bucket);
        assert_eq!(a.report(None, 10, true)["streams"][0]["buckets_total"], 1);
        a.remove_stream(1);
        assert_eq!(a.report(None, 10, true)["streams"], serde_json::json!([]));
    }
}
