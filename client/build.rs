//! Compiles the public API (`../proto/ringlimit.proto`) with the pure-Rust `protox`
//! compiler (no `protoc`), client side only.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "../proto/ringlimit.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["../proto"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(fds)?;
    Ok(())
}
