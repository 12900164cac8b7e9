//! Compiles `ctxsync/**/*.proto` with protox (pure Rust, no `protoc`), then
//! generates prost types and pbjson serde impls from the same descriptors.

use std::path::{Path, PathBuf};

fn proto_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            proto_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "proto") {
            out.push(path);
        }
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let mut files = Vec::new();
    proto_files(&root.join("ctxsync"), &mut files)?;
    files.sort();
    println!("cargo:rerun-if-changed=ctxsync");
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }

    let descriptors = protox::compile(&files, [&root])?;
    let descriptor_bytes = prost::Message::encode_to_vec(&descriptors);
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out_dir.join("ctxsync_descriptor.bin"), &descriptor_bytes)?;

    prost_build::Config::new()
        .compile_well_known_types()
        // `prost::Name` gives each message its full name (the unknown-field count).
        .enable_type_names()
        .extern_path(".google.protobuf", "::pbjson_types")
        .compile_fds(descriptors)?;

    // One JSON convention for every HTTP answer and `--json` output: the
    // proto's own field names (snake_case) and every field present, defaults
    // included. Parsing accepts both these names and the camelCase JSON names.
    pbjson_build::Builder::new()
        .register_descriptors(&descriptor_bytes)?
        .preserve_proto_field_names()
        .emit_fields()
        .build(&[".ctxsync"])?;
    Ok(())
}
