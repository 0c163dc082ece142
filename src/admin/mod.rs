//! The admin API: operators see what a limit holds, reset it, and override it for a while,
//! while the service runs. Why a gRPC service of its own on a listener of its own (set up by
//! `server::admin`): the RLS port faces every proxy of the mesh and the HTTP port serves
//! envoyproxy's unauthenticated endpoints; a door that can zero or raise anyone's limits must
//! be neither, must refuse to open on a reachable address without authentication, and must
//! leave a trace of every write.
//!
//! - `auth.rs`: bearer tokens with scopes, or client certificates;
//! - `service.rs`: the calls; `convert.rs`: their messages;
//! - `audit.rs`: the log line and metric of every write;
//! - `poll.rs`: how every replica learns of a write within a second;
//! - `client.rs`: `sluice admin`, the command line that calls it.

pub mod audit;
pub mod auth;
pub mod client;
mod convert;
pub mod poll;
mod service;

pub use auth::{AuthSettings, Scopes};
pub use service::AdminService;
