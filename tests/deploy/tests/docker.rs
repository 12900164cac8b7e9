//! deploy/docker/Dockerfile builds and ships exactly the workspace's binaries,
//! as a non-root user, without protoc.

use std::collections::BTreeSet;
use std::process::Command;

use deploy_checks::{deploy_dir, repo_root, run};

/// Binaries of the workspace that are tools of its tests, not services:
/// they run from the build tree and ship in no image.
const TEST_TOOLS: [&str; 1] = ["chaos"];

/// The workspace's binaries that the images ship.
fn workspace_binaries() -> BTreeSet<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let metadata = run(Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(repo_root()));
    let metadata: serde_json::Value = serde_json::from_str(&metadata).expect("cargo metadata JSON");
    let mut bins = BTreeSet::new();
    for package in metadata["packages"].as_array().expect("packages") {
        for target in package["targets"].as_array().expect("targets") {
            let kinds = target["kind"].as_array().expect("kind");
            let name = target["name"].as_str().expect("name");
            if kinds.iter().any(|k| k == "bin") && !TEST_TOOLS.contains(&name) {
                bins.insert(name.to_owned());
            }
        }
    }
    bins
}

/// The Dockerfile's instructions with line continuations joined and comments dropped.
fn instructions() -> Vec<String> {
    let text = std::fs::read_to_string(deploy_dir().join("docker/Dockerfile")).expect("Dockerfile");
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_empty()) {
            continue;
        }
        if let Some(continued) = trimmed.strip_suffix('\\') {
            current.push_str(continued);
            current.push(' ');
        } else {
            current.push_str(trimmed);
            out.push(std::mem::take(&mut current));
        }
    }
    out
}

#[test]
fn dockerfile_builds_and_copies_exactly_the_workspace_binaries() {
    let expected = workspace_binaries();
    assert!(
        expected.contains("ctxsync") && expected.contains("snapshot-store"),
        "{expected:?}"
    );
    let instructions = instructions();

    let build = instructions
        .iter()
        .find(|i| i.starts_with("RUN") && i.contains("cargo build"))
        .expect("a RUN cargo build instruction");
    assert!(
        build.contains("--release") && build.contains("--locked"),
        "{build}"
    );
    let words: Vec<&str> = build.split_whitespace().collect();
    let built: BTreeSet<String> = words
        .windows(2)
        .filter(|w| w[0] == "--bin")
        .map(|w| w[1].trim_end_matches(';').to_owned())
        .collect();
    assert_eq!(
        built, expected,
        "`cargo build --bin ...` in the Dockerfile vs the workspace's bin targets"
    );

    // Each image stage copies its binaries out of the build stage; together
    // they ship every binary, and `mcp` (the one that starts MCP servers)
    // ships all of them.
    let mut stage = String::new();
    let mut copied_by_stage: std::collections::BTreeMap<String, BTreeSet<String>> =
        Default::default();
    for i in &instructions {
        if let Some(from) = i.strip_prefix("FROM ") {
            stage = from
                .split_whitespace()
                .last()
                .unwrap_or_default()
                .to_owned();
        }
        if !i.starts_with("COPY --from=build ") {
            continue;
        }
        let dest = i.split_whitespace().last().expect("COPY destination");
        let name = dest
            .strip_prefix("/usr/local/bin/")
            .unwrap_or_else(|| panic!("{i}: binaries go to /usr/local/bin/"));
        let source = i.split_whitespace().nth(2).expect("COPY source");
        assert!(
            source.ends_with(&format!("/{name}")),
            "{i}: copies a binary under its own name"
        );
        copied_by_stage
            .entry(stage.clone())
            .or_default()
            .insert(name.to_owned());
    }
    assert_eq!(
        copied_by_stage.get("mcp"),
        Some(&expected),
        "binaries in the `mcp` image vs the workspace's bin targets"
    );
    let slim = copied_by_stage.get("slim").expect("a `slim` stage");
    for starts_mcp_servers in ["catalog", "workspace-agent", "mcp-fixture"] {
        assert!(
            !slim.contains(starts_mcp_servers),
            "`slim` has no MCP runtime, so no {starts_mcp_servers}"
        );
    }
    for bin in &expected {
        assert!(
            build.contains(&format!("target/release/{bin}")),
            "the build stage copies target/release/{bin} to /out"
        );
    }
}

#[test]
fn image_is_multi_stage_non_root_and_needs_no_protoc() {
    let instructions = instructions();
    let stages: Vec<&String> = instructions
        .iter()
        .filter(|i| i.starts_with("FROM "))
        .collect();
    assert!(stages.len() >= 2, "multi-stage: {stages:?}");
    assert!(
        stages.iter().any(|s| s.ends_with(" AS build")),
        "{stages:?}"
    );
    let user = instructions
        .iter()
        .rfind(|i| i.starts_with("USER "))
        .expect("a USER instruction in the runtime stage");
    let uid = user["USER ".len()..].split(':').next().unwrap().trim();
    assert!(
        uid.parse::<u32>().is_ok_and(|u| u != 0),
        "numeric non-root USER (Kubernetes runAsNonRoot checks it): {user}"
    );
    let last_from = instructions
        .iter()
        .rposition(|i| i.starts_with("FROM "))
        .unwrap();
    let user_at = instructions
        .iter()
        .rposition(|i| i.starts_with("USER "))
        .unwrap();
    assert!(user_at > last_from, "USER is set in the final stage");
    for i in &instructions {
        assert!(
            !i.contains("protobuf-compiler") && !i.contains("protoc"),
            "protox compiles the protos; no protoc: {i}"
        );
    }
}

#[test]
fn the_build_context_leaves_out_build_output_and_local_state() {
    // The legacy builder reads only the context root's .dockerignore.
    let ignore = std::fs::read_to_string(repo_root().join(".dockerignore")).expect(".dockerignore");
    let patterns: Vec<&str> = ignore
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .collect();
    for needed in ["target/", ".git/", ".ctxsync/"] {
        assert!(patterns.contains(&needed), "{needed} in {patterns:?}");
    }
}

#[test]
fn the_dockerfile_needs_no_buildkit() {
    let text = std::fs::read_to_string(deploy_dir().join("docker/Dockerfile")).expect("Dockerfile");
    for line in text.lines() {
        assert!(
            !line.trim_start().starts_with("# syntax="),
            "Debian's Docker refuses `# syntax=`: {line}"
        );
    }
    for i in instructions() {
        assert!(!i.contains("--mount="), "RUN --mount needs BuildKit: {i}");
    }
}

/// Every command the deployment runs from the ctxsync image is one of its binaries.
#[test]
fn deployment_commands_run_binaries_of_the_image() {
    let bins = workspace_binaries();
    let compose = deploy_checks::read_yaml(&deploy_dir().join("compose.yaml"));
    let mut commands = Vec::new();
    for (name, service) in compose["services"].as_mapping().expect("services") {
        let image = service["image"].as_str().unwrap_or_default();
        if !image.contains("CTXSYNC_IMAGE") && !image.contains("CTXSYNC_MCP_IMAGE") {
            continue;
        }
        let command = &service["command"];
        let first = command[0].as_str().expect("command is a list").to_owned();
        let place = format!("compose {}", name.as_str().unwrap());
        if first == "sh" {
            // `sh -c "<script>"`: every program it runs (the first word of
            // each command of the script) is a workspace binary, a shell
            // builtin or a coreutils program of the Debian base.
            const BASE: [&str; 4] = ["test", "umask", "od", "tr"];
            let script = command[2].as_str().expect("sh -c script");
            for part in script.split(['|', '&', ';', '(', ')']) {
                let Some(program) = part.split_whitespace().next() else {
                    continue;
                };
                if !BASE.contains(&program) {
                    commands.push((place.clone(), program.to_owned()));
                }
            }
        } else {
            commands.push((place, first));
        }
    }
    let k8s = std::fs::read_dir(deploy_dir().join("k8s")).expect("deploy/k8s");
    for entry in k8s.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "yaml")
            || path.file_name().unwrap() == "kustomization.yaml"
        {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for doc in deploy_checks::yaml_documents(&text) {
            let spec = match doc["kind"].as_str() {
                Some("Deployment" | "StatefulSet") => &doc["spec"]["template"]["spec"],
                Some("Job") => &doc["spec"]["template"]["spec"],
                _ => continue,
            };
            for container in spec["containers"].as_sequence().unwrap() {
                if container["image"].as_str() == Some("ctxsync") {
                    let program = container["command"][0]
                        .as_str()
                        .expect("command")
                        .to_owned();
                    commands.push((
                        format!(
                            "{} {}",
                            path.display(),
                            doc["metadata"]["name"].as_str().unwrap()
                        ),
                        program,
                    ));
                }
            }
        }
    }
    assert!(commands.len() >= 10, "{commands:?}");
    for (place, program) in commands {
        assert!(
            bins.contains(&program),
            "{place} runs {program:?}, which is not a workspace binary ({bins:?})"
        );
    }
}
