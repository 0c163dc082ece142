mod grpcurl;
mod http;
mod process;
mod redis_support;
mod semantics;
mod store;
