//! sluice: an Envoy/Istio-compatible gRPC rate-limit decision service. The library holds
//! everything (config, matching, algorithms, stores, service, servers); `main.rs` only parses the
//! command line and calls in.
#![forbid(unsafe_code)]

pub mod algorithm;
pub mod app;
pub mod bench;
pub mod clock;
pub mod config;
pub mod duration;
mod pem;
pub mod proto;
pub mod rules;
pub mod server;
pub mod service;
pub mod settings;
pub mod store;
pub mod telemetry;
