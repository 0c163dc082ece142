//! Criterion micro-benchmarks of the in-process decision path: Redis key encoding, the memory
//! store's decide, and a whole `ShouldRateLimit` (validate, plan, decide, respond) on the
//! embedded store. The load tool for whole servers is `sluice bench` (see README
//! "Performance"); these isolate the parts so a change to one shows up here first.
//!
//!     cargo bench --bench decision

use criterion::{criterion_group, criterion_main, Criterion};
use sluice::clock::SystemClock;
use sluice::config::{load_sources, Limit, Unit};
use sluice::proto::rate_limit_descriptor::Entry;
use sluice::proto::{RateLimitDescriptor, RateLimitRequest};
use sluice::service::{RateLimiter, ServiceOptions};
use sluice::store::memory::MemoryStore;
use sluice::store::redis::keys;
use sluice::store::StoreStack;
use sluice::store::{CounterKey, CounterStore, LimitCheck};
use sluice::telemetry::Telemetry;
use std::hint::black_box;
use std::sync::Arc;

const CONFIG: &str = "domain: bench
descriptors:
  - key: resource
    value: api
    rate_limit: {requests_per_unit: 1000000000, unit: minute, applies_to_descendants: true}
    descriptors:
      - key: consumer
        rate_limit: {requests_per_unit: 1000000000, unit: minute}
";

fn counter(consumer: u64) -> CounterKey {
    CounterKey {
        domain: Arc::from("bench"),
        entries: Arc::from(vec![
            ("resource".into(), "api".into()),
            ("consumer".into(), consumer.to_string()),
        ]),
        limit: Limit::fixed(1_000_000_000, Unit::Minute),
        overridden: false,
        domain_tag: false,
        own_tag: false,
        candidate: false,
    }
}

fn request(consumer: u64) -> RateLimitRequest {
    let entry = |k: &str, v: String| Entry {
        key: k.into(),
        value: v,
    };
    RateLimitRequest {
        domain: "bench".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![
                entry("resource", "api".into()),
                entry("consumer", consumer.to_string()),
            ],
            ..Default::default()
        }],
        hits_addend: 0,
    }
}

fn benches(c: &mut Criterion) {
    let key = counter(4242);
    c.bench_function("key encoding (resource + consumer)", |b| {
        b.iter(|| keys::counter_key(black_box("sluice:"), black_box(&key)))
    });

    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let clock = Arc::new(SystemClock);
    let store = MemoryStore::new(clock.clone());
    let mut n = 0u64;
    c.bench_function("memory decide (2 limits, 10 000 consumers)", |b| {
        b.iter(|| {
            n = (n + 7919) % 10_000;
            let checks = [
                LimitCheck {
                    key: CounterKey {
                        entries: Arc::from(vec![("resource".to_string(), "api".to_string())]),
                        ..counter(0)
                    },
                    hits: 1,
                    refund: false,
                    shadow: false,
                    quota: false,
                    record: false,
                    stop_over: false,
                    admin_limit: None,
                    window: None,
                    lease: None,
                    leased: false,
                    slice: None,
                    candidate: false,
                },
                LimitCheck {
                    key: counter(n),
                    hits: 1,
                    refund: false,
                    shadow: false,
                    quota: false,
                    record: false,
                    stop_over: false,
                    admin_limit: None,
                    window: None,
                    lease: None,
                    leased: false,
                    slice: None,
                    candidate: false,
                },
            ];
            rt.block_on(store.decide(black_box(&checks)))
        })
    });

    let rules = load_sources(&[("bench.yaml".into(), CONFIG.into())]).expect("config");
    let limiter = RateLimiter::new(
        rules,
        StoreStack::memory(clock.clone(), 500_000),
        ServiceOptions::default(),
        Telemetry::new(clock).expect("telemetry"),
    );
    let mut m = 0u64;
    c.bench_function(
        "ShouldRateLimit on memory (validate, plan, decide, respond)",
        |b| {
            b.iter(|| {
                m = (m + 7919) % 10_000;
                rt.block_on(limiter.should_rate_limit(black_box(request(m))))
            })
        },
    );
}

criterion_group!(decision, benches);
criterion_main!(decision);
