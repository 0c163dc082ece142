//! Compiles the vendored protos in `proto/` with `protox` (pure Rust, so no system `protoc` is
//! needed) and generates the tonic/prost code plus the encoded descriptor set that gRPC
//! reflection and the `/json` protojson endpoint use at run time.

use prost::Message;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let served = [
        "envoy/service/ratelimit/v3/rls.proto",
        "envoy/service/rate_limit_quota/v3/rlqs.proto",
    ];
    let rls = protox::compile(served, ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    // Reflection and `/json` describe only the services sluice serves (RLS and RLQS).
    std::fs::write(out.join("rls_descriptor.bin"), rls.encode_to_vec())?;
    // The admin API (sluice's own proto) has reflection of its own, on its own listener.
    let admin = protox::compile(["sluice/admin/v1/admin.proto"], ["proto"])?;
    std::fs::write(out.join("admin_descriptor.bin"), admin.encode_to_vec())?;
    // The code: the rate-limit service, plus the ADS stream and envoyproxy/ratelimit's
    // `RateLimitConfig` that config over xDS (`CONFIG_TYPE=GRPC_XDS_SOTW`) speaks.
    let all = protox::compile(
        [
            "envoy/service/ratelimit/v3/rls.proto",
            "envoy/service/rate_limit_quota/v3/rlqs.proto",
            "envoy/service/discovery/v3/ads.proto",
            "ratelimit/config/ratelimit/v3/rls_conf.proto",
            "sluice/admin/v1/admin.proto",
        ],
        ["proto"],
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(all)?;
    Ok(())
}
