//! The scenarios, grouped by topic. The store macros come first so every module can use them.

/// One test per store, each on a real backend from [`store::make_store`] on a manual clock:
/// `test_with_all_stores!(name, |store, clock| async move { .. })` makes `name::memory`,
/// `name::redis`, `name::cluster`, `name::valkey` and `name::valkey_cluster` (Valkey: see
/// `support::redis::Server`). With `kind => f`, `f(kind)` is called with the store's
/// name instead, for a scenario that builds its own server around `make_store(kind)`.
macro_rules! test_with_all_stores {
    ($name:ident, $($body:tt)+) => {
        test_with_stores!($name, [memory, redis, cluster, valkey, valkey_cluster], $($body)+);
    };
}

/// [`test_with_all_stores!`] on the two Redis stores only: what only a shared store does.
macro_rules! test_with_redis_stores {
    ($name:ident, $($body:tt)+) => {
        test_with_stores!($name, [redis, cluster, valkey, valkey_cluster], $($body)+);
    };
}

macro_rules! test_with_stores {
    ($name:ident, [$($kind:ident),+], kind => $scenario:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test]
                async fn $kind() {
                    ($scenario)(stringify!($kind)).await;
                }
            )+
        }
    };
    ($name:ident, [$($kind:ident),+], $body:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test]
                async fn $kind() {
                    let (store, clock, _backend) =
                        crate::cases::store::make_store(stringify!($kind)).await;
                    ($body)(store, clock).await;
                }
            )+
        }
    };
}

mod admin;
mod admin_audit;
mod admin_cli;
mod bench;
mod calendar;
mod candidates;
mod cluster_local;
mod compat;
mod counting;
mod dashboards;
mod decision_log;
mod demand;
mod differential;
mod envoy;
mod envoy_in_flight;
mod envoy_reservations;
mod envoy_stats;
mod extensions;
mod fuzz;
mod global;
mod global_admin;
mod global_boundary;
mod global_fair;
mod global_fair_home;
mod global_fence;
mod global_model;
mod global_moved;
mod global_moved_model;
mod global_pool;
mod grpcurl;
mod hostile;
mod hostile_rates;
mod hostile_reservations;
mod hostile_rlqs;
mod http;
mod http2_bounds;
mod identity;
mod in_flight;
mod lease_metrics;
mod leased;
mod leased_processes;
mod local_mode;
mod observability;
mod overrides;
mod process;
pub mod quota;
mod redis;
mod redis_faults;
mod redis_path;
mod redis_support;
mod reload;
mod reservations;
mod rlqs;
mod rlqs_bounds;
mod semantics;
mod sentinel;
mod shutdown;
pub mod store;
mod tls;
mod tracing;
mod uds_relay;
mod wire_bounds;
mod xds;
