//! Compiles the vendored Envoy protos in `proto/` with `protox` (pure Rust, so no system `protoc`
//! is needed) and generates the tonic/prost code plus the encoded descriptor set that gRPC
//! reflection and the `/json` protojson endpoint use at run time.

use prost::Message;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(["envoy/service/ratelimit/v3/rls.proto"], ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("rls_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
