mod extensions;
mod grpcurl;
mod http;
mod process;
mod redis;
mod redis_faults;
mod redis_support;
mod semantics;
pub mod store;
