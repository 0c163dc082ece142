//! sluice: an Envoy/Istio-compatible gRPC rate-limit decision service. The library holds the
//! service (config, matching, algorithms, stores, the decision, the servers); `main.rs` parses
//! the command line and calls in, and carries the one part that is no part of the service, the
//! `sluice bench` load generator.
//!
//! # Layout
//!
//! One way down, no cycles:
//!
//! ```text
//! app        composition root: settings -> store stack, telemetry, RateLimiter -> ServerConfig
//! admin      the admin API (inspect, reset, overrides): auth, audit, the replicas' poll
//! server     gRPC (RLS, RLQS, health, reflection) and HTTP admin around one RateLimiter
//! quota      the Rate Limit Quota Service: buckets -> descriptors, shares, assignments
//! service    one request: validate -> plan (rules) -> store.decide -> respond
//! rules      descriptors -> the limits that apply (hierarchy, wildcards)
//! store      CounterStore (decide, probe): memory, Redis (standalone | Cluster), and the
//!            breaker and deny cache as wrappers; StoreSignals carry health and totals
//! algorithm  the pure decision math of the four algorithms (mirrored in decide.lua)
//! config     YAML and xDS -> an immutable RuleSet
//! settings   flags and env vars (envoyproxy's names), parsed without I/O
//! telemetry  metrics, traces, envoyproxy stats, offenders
//! ```
//!
//! The items below are the supported surface. The modules behind them are public only where
//! the binary or the integration tests reach in (hidden from these docs); the rest are private.
#![forbid(unsafe_code)]

#[doc(hidden)]
pub mod admin;
mod algorithm;
#[doc(hidden)]
pub mod app;
#[doc(hidden)]
pub mod candidates;
#[doc(hidden)]
pub mod clock;
#[doc(hidden)]
pub mod config;
#[doc(hidden)]
pub mod decision_log;
mod duration;
mod pem;
#[doc(hidden)]
pub mod proto;
#[doc(hidden)]
pub mod quota;
#[doc(hidden)]
pub mod replay;
mod rules;
#[doc(hidden)]
pub mod server;
#[doc(hidden)]
pub mod service;
#[doc(hidden)]
pub mod settings;
#[doc(hidden)]
pub mod store;
#[doc(hidden)]
pub mod telemetry;

/// Starting the service: settings to a running server.
pub use app::{assemble, server_config, Ingredients};
pub use server::{run, shutdown_signal, start, Parts, Running, ServerConfig, ServerError};
pub use settings::{Cli, Command, Parsed};

/// The decision.
pub use config::{load_path, LoadOptions, RuleSet};
pub use service::{RateLimiter, RequestError, ServiceOptions};

/// Counter stores.
pub use store::{
    CounterStore, Decision, DenialFinality, LimitCheck, StoreChain, StoreError, StoreSignals,
    StoreStack,
};

/// Envoy's RLS v3 messages and client, as generated from the vendored protos.
pub use proto::{
    rate_limit_service_client::RateLimitServiceClient, RateLimitRequest, RateLimitResponse,
};

/// Go-style durations (`10s`, `1m30s`), as envoyproxy's settings spell them.
pub use duration::parse_go as parse_duration;
