//! What the container tests share: the local images `tests/setup.sh`
//! builds, and the ctxsync images made from this test run's binaries.

use std::path::Path;
use std::process::Command;

use deploy_checks::{deploy_dir, run};

pub const BASE_IMAGE: &str = "ctxsync-local/debian:bookworm";
pub const NATS_IMAGE: &str = "ctxsync-local/nats:2.9";
pub const POSTGRES_IMAGE: &str = "ctxsync-local/postgres:15";
/// The binaries the images hold, from this test run's build.
const BINARIES: [(&str, &str); 8] = [
    ("snapshot-store", "snapshot-store"),
    ("agent-ingest", "agent-ingest"),
    ("chat-gate", "chat-gate"),
    ("catalog", "catalog"),
    ("workspace-agent", "workspace-agent"),
    ("ctxsync-cli", "ctxsync"),
    ("ctxsync-bench", "ctxsync-bench"),
    ("mcp-fixture", "mcp-fixture"),
];

pub fn docker() -> Command {
    Command::new("docker")
}

pub fn require_engine_and_images() {
    let info = Command::new("docker").arg("info").output();
    assert!(
        matches!(&info, Ok(out) if out.status.success()),
        "no Docker engine answers: run `bash tests/setup.sh` (it installs and starts one): {info:?}"
    );
    for image in [BASE_IMAGE, NATS_IMAGE, POSTGRES_IMAGE] {
        let found = docker().args(["image", "inspect", image]).output().unwrap();
        assert!(
            found.status.success(),
            "local image {image} is missing: run `bash tests/setup.sh`"
        );
    }
}

/// `ctxsync-compose-test:slim` and `:mcp` from stripped copies of this run's binaries.
pub fn build_images(context: &Path) -> (String, String) {
    let prebuilt = context.join("prebuilt");
    std::fs::create_dir_all(&prebuilt).unwrap();
    for (package, bin) in BINARIES {
        let binary = testkit::workspace_binary(package, bin);
        run(Command::new("strip")
            .arg("--strip-debug")
            .arg("-o")
            .arg(prebuilt.join(bin))
            .arg(&binary));
    }
    let dockerfile = deploy_dir().join("docker/Dockerfile");
    let mut tags = Vec::new();
    for target in ["slim", "mcp"] {
        let tag = format!("ctxsync-compose-test:{target}");
        run(docker()
            // The legacy builder, as Debian's engine has it (no buildx needed).
            .env("DOCKER_BUILDKIT", "0")
            .args(["build", "-q", "-f"])
            .arg(&dockerfile)
            .args(["--target", target, "-t", &tag])
            .args(["--build-arg", &format!("BUILDER_IMAGE={BASE_IMAGE}")])
            .args(["--build-arg", &format!("BASE_IMAGE={BASE_IMAGE}")])
            .args(["--build-arg", "MCP_RUNTIMES="])
            .arg(context));
        tags.push(tag);
    }
    (tags[0].clone(), tags[1].clone())
}

/// The tool names of a first turn's answer, across its servers.
pub fn tool_names(answer: &serde_json::Value) -> Vec<String> {
    answer["projection"]["servers"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["tools"].as_array().into_iter().flatten())
        .filter_map(|t| t["name"].as_str().map(str::to_owned))
        .collect()
}
