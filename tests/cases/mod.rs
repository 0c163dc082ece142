mod grpcurl;
mod http;
mod process;
mod semantics;
mod store;
