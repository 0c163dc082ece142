//! Generated Envoy (and envoyproxy/ratelimit config) types and services, compiled by `build.rs` from the vendored protos in
//! `proto/`. The module tree mirrors the protobuf packages so the generated cross-references
//! (`super::super::...`) resolve.
#![allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]

/// Full gRPC name of the RLS service, as health checks, reflection and spans name it.
pub const RLS_SERVICE_NAME: &str = "envoy.service.ratelimit.v3.RateLimitService";
/// Full gRPC name of the Rate Limit Quota Service.
pub const RLQS_SERVICE_NAME: &str = "envoy.service.rate_limit_quota.v3.RateLimitQuotaService";

/// Encoded `FileDescriptorSet` of `rls.proto` and its imports: feeds gRPC reflection and the
/// protojson transcoding of `POST /json`.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/rls_descriptor.bin"));

pub mod envoy {
    pub mod config {
        pub mod core {
            pub mod v3 {
                include!(concat!(env!("OUT_DIR"), "/envoy.config.core.v3.rs"));
            }
        }
    }
    pub mod extensions {
        pub mod common {
            pub mod ratelimit {
                pub mod v3 {
                    include!(concat!(
                        env!("OUT_DIR"),
                        "/envoy.extensions.common.ratelimit.v3.rs"
                    ));
                }
            }
        }
    }
    pub mod r#type {
        pub mod v3 {
            include!(concat!(env!("OUT_DIR"), "/envoy.r#type.v3.rs"));
        }
    }
    pub mod service {
        pub mod discovery {
            pub mod v3 {
                include!(concat!(env!("OUT_DIR"), "/envoy.service.discovery.v3.rs"));
            }
        }
        pub mod ratelimit {
            pub mod v3 {
                include!(concat!(env!("OUT_DIR"), "/envoy.service.ratelimit.v3.rs"));
            }
        }
        pub mod rate_limit_quota {
            pub mod v3 {
                include!(concat!(
                    env!("OUT_DIR"),
                    "/envoy.service.rate_limit_quota.v3.rs"
                ));
            }
        }
    }
}
pub mod google {
    pub mod rpc {
        include!(concat!(env!("OUT_DIR"), "/google.rpc.rs"));
    }
}
/// envoyproxy/ratelimit's own API: the `RateLimitConfig` resource pushed over xDS.
pub mod ratelimit {
    pub mod config {
        pub mod ratelimit {
            pub mod v3 {
                include!(concat!(
                    env!("OUT_DIR"),
                    "/ratelimit.config.ratelimit.v3.rs"
                ));
            }
        }
    }
}
/// sluice's own admin API (`proto/sluice/admin/v1/admin.proto`).
pub mod sluice {
    pub mod admin {
        pub mod v1 {
            include!(concat!(env!("OUT_DIR"), "/sluice.admin.v1.rs"));
        }
    }
}
/// Encoded `FileDescriptorSet` of the admin API: reflection on the admin listener.
pub const ADMIN_FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/admin_descriptor.bin"));
pub mod udpa {
    pub mod annotations {
        include!(concat!(env!("OUT_DIR"), "/udpa.annotations.rs"));
    }
}
pub mod validate {
    include!(concat!(env!("OUT_DIR"), "/validate.rs"));
}
pub mod xds {
    pub mod annotations {
        pub mod v3 {
            include!(concat!(env!("OUT_DIR"), "/xds.annotations.v3.rs"));
        }
    }
    pub mod core {
        pub mod v3 {
            include!(concat!(env!("OUT_DIR"), "/xds.core.v3.rs"));
        }
    }
}

/// Reflection v1 and v1alpha over the descriptor sets `sets` and both reflection protos, so
/// `grpcurl list` shows every service whichever reflection version the client speaks (the RLS
/// listener's and the admin listener's, each over its own protos).
pub fn reflection(
    sets: &[&'static [u8]],
) -> Result<
    (
        tonic_reflection::server::v1::ServerReflectionServer<
            impl tonic_reflection::server::v1::ServerReflection,
        >,
        tonic_reflection::server::v1alpha::ServerReflectionServer<
            impl tonic_reflection::server::v1alpha::ServerReflection,
        >,
    ),
    tonic_reflection::server::Error,
> {
    let builder = || {
        sets.iter()
            .fold(tonic_reflection::server::Builder::configure(), |b, set| {
                b.register_encoded_file_descriptor_set(set)
            })
            .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(
                tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
            )
    };
    Ok((builder().build_v1()?, builder().build_v1alpha()?))
}

pub use envoy::extensions::common::ratelimit::v3::{rate_limit_descriptor, RateLimitDescriptor};
pub use envoy::service::ratelimit::v3::{
    rate_limit_response, rate_limit_service_client, rate_limit_service_server, RateLimitRequest,
    RateLimitResponse,
};
