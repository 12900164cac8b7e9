use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

/// The path of a workspace binary, next to the running test's profile dir
/// (`target/<profile>/<bin>`). `cargo test --workspace --all-targets` builds
/// every binary before any test runs; when one is missing (a single crate's
/// tests) it is built once with cargo.
pub fn workspace_binary(package: &str, bin: &str) -> PathBuf {
    static BUILD: OnceLock<Mutex<()>> = OnceLock::new();
    let exe = std::env::current_exe().expect("current test executable");
    // target/<profile>/deps/<test> → target/<profile>
    let profile_dir = exe
        .parent()
        .map(|dir| {
            if dir.ends_with("deps") {
                dir.parent().unwrap_or(dir)
            } else {
                dir
            }
        })
        .expect("test executable has a directory")
        .to_path_buf();
    let binary = profile_dir.join(bin);
    let _serialized = BUILD.get_or_init(|| Mutex::new(())).lock();
    if binary.is_file() {
        return binary;
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = std::process::Command::new(cargo);
    build.args(["build", "-q", "-p", package, "--bin", bin]);
    if let Some(target_dir) = profile_dir.parent() {
        build.arg("--target-dir").arg(target_dir);
    }
    if profile_dir.file_name().is_some_and(|p| p == "release") {
        build.arg("--release");
    }
    let built = build.status().is_ok_and(|s| s.success());
    assert!(
        built && binary.is_file(),
        "binary {bin} is missing at {}: run `cargo build -p {package} --bin {bin}`",
        binary.display()
    );
    binary
}
