//! deploy/compose.yaml: valid against the Compose Specification's JSON schema,
//! every long-running service health-checked, every dependency waits on a
//! condition, configuration through env names the code reads.

use std::collections::BTreeSet;
use std::process::Command;

use deploy_checks::{deploy_dir, env_names_in_code, read_yaml, repo_root, run, tool};
use serde_norway::Value;

fn compose() -> Value {
    read_yaml(&deploy_dir().join("compose.yaml"))
}

fn services(compose: &Value) -> Vec<(String, Value)> {
    compose["services"]
        .as_mapping()
        .expect("services")
        .iter()
        .map(|(k, v)| (k.as_str().unwrap().to_owned(), v.clone()))
        .collect()
}

fn is_one_shot(service: &Value) -> bool {
    service["restart"].as_str() == Some("no")
}

#[test]
fn compose_file_is_valid_against_the_compose_schema() {
    let schema = repo_root().join("tests/deploy/schemas/compose-spec.json");
    run(Command::new(tool("check-jsonschema"))
        .arg("--schemafile")
        .arg(&schema)
        .arg(deploy_dir().join("compose.yaml")));
}

#[test]
fn every_service_is_health_checked_and_started_in_order() {
    let compose = compose();
    let services = services(&compose);
    let names: BTreeSet<&str> = services.iter().map(|(n, _)| n.as_str()).collect();
    for required in [
        "nats",
        "postgres",
        "migrate",
        "snapshot-store",
        "agent-ingest",
        "chat-gate",
        "catalog",
        "workspace-agent",
    ] {
        assert!(names.contains(required), "compose has no {required}");
    }
    for (name, service) in &services {
        if is_one_shot(service) {
            assert!(service["healthcheck"].is_null(), "{name} is a one-shot job");
        } else {
            let test = &service["healthcheck"]["test"];
            assert!(test.is_sequence(), "{name} has a healthcheck");
        }
        let Some(depends) = service["depends_on"].as_mapping() else {
            assert!(
                ["nats", "postgres", "catalog-memory-key"].contains(&name.as_str()),
                "{name} depends on nothing"
            );
            continue;
        };
        for (dependency, how) in depends {
            let dependency = dependency.as_str().unwrap();
            let target = &compose["services"][dependency];
            assert!(!target.is_null(), "{name} depends on unknown {dependency}");
            let expected = if is_one_shot(target) {
                "service_completed_successfully"
            } else {
                "service_healthy"
            };
            assert_eq!(
                how["condition"].as_str(),
                Some(expected),
                "{name} -> {dependency}"
            );
        }
    }
    let depends_on = |name: &str, dependency: &str| {
        !compose["services"][name]["depends_on"][dependency].is_null()
    };
    for owner in ["snapshot-store", "catalog"] {
        assert!(
            depends_on(owner, "migrate"),
            "{owner} starts after the migrations"
        );
    }
    for service in ["snapshot-store", "agent-ingest", "chat-gate", "catalog"] {
        assert!(
            depends_on(service, "nats") || depends_on(service, "snapshot-store"),
            "{service} waits for NATS"
        );
    }
    assert_eq!(
        compose["services"]["migrate"]["command"],
        serde_norway::from_str::<Value>("[ctxsync, migrate]").unwrap()
    );
}

/// The services that start MCP servers run the `mcp` image (with Node.js and
/// Python); the others the slim one.
const STARTS_MCP_SERVERS: [&str; 3] = ["catalog", "catalog-2", "workspace-agent"];

#[test]
fn services_run_from_our_two_images_as_non_root_with_env_the_code_reads() {
    let compose = compose();
    let known = env_names_in_code();
    for (name, service) in services(&compose) {
        let Some(this_image) = service["image"].as_str() else {
            continue;
        };
        if !this_image.contains("CTXSYNC_IMAGE") && !this_image.contains("CTXSYNC_MCP_IMAGE") {
            continue;
        }
        let expected = if STARTS_MCP_SERVERS.contains(&name.as_str()) {
            "${CTXSYNC_MCP_IMAGE:-ctxsync-mcp:0.1.0}"
        } else {
            "${CTXSYNC_IMAGE:-ctxsync:0.1.0}"
        };
        assert_eq!(this_image, expected, "{name}'s image");
        if let Some(user) = service["user"].as_str() {
            assert!(
                !user.starts_with("0") && !user.starts_with("root"),
                "{name} runs as {user}"
            );
        }
        // A one-shot job may need no environment at all.
        let environment = match service["environment"].as_mapping() {
            Some(environment) => environment,
            None if is_one_shot(&service) => continue,
            None => panic!("{name} has no environment map"),
        };
        for (key, _) in environment {
            let key = key.as_str().unwrap();
            assert!(
                known.contains(key) || key == "HOME",
                "{name} sets {key}, which no service reads"
            );
        }
    }
}

#[test]
fn nats_users_match_services_and_files_are_the_shared_ones() {
    let compose = compose();
    for service in ["snapshot-store", "agent-ingest", "chat-gate", "catalog"] {
        let url = compose["services"][service]["environment"]["NATS_URL"]
            .as_str()
            .unwrap();
        let variable = format!("NATS_PASSWORD_{}", service.to_uppercase().replace('-', "_"));
        assert!(
            url.starts_with(&format!("nats://{service}:${{{variable}:-"))
                && url.ends_with("@nats:4222"),
            "{service} connects as its own NATS user: {url}"
        );
        assert!(
            !compose["services"]["nats"]["environment"][variable.as_str()].is_null(),
            "the nats service gets {variable}"
        );
    }
    let volumes: Vec<&str> = compose["services"]["nats"]["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        volumes.contains(&"./k8s/nats/nats.conf:/etc/nats/nats.conf:ro"),
        "{volumes:?}"
    );
    let catalog = &compose["services"]["catalog"];
    assert_eq!(
        catalog["environment"]["CTXSYNC_CATALOG_CONFIG"].as_str(),
        Some("/etc/ctxsync/catalog.yaml")
    );
    for (service, file) in [
        ("nats", "k8s/nats/nats.conf"),
        ("catalog", "k8s/catalog/catalog.yaml"),
        ("workspace-agent", "demo/workspace"),
    ] {
        assert!(
            deploy_dir().join(file).exists(),
            "{service} mounts deploy/{file}, which is missing"
        );
    }
    let workspace = deploy_dir().join("demo/workspace");
    for file in ["AGENTS.md", ".mcp.json"] {
        assert!(
            workspace.join(file).is_file(),
            "the demo workspace has {file}"
        );
    }
}

#[test]
fn catalog_config_is_one_the_catalog_loads() {
    let path = deploy_dir().join("k8s/catalog/catalog.yaml");
    let config =
        catalog::CatalogConfig::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(!config.tenants.is_empty());
}

#[test]
fn two_catalog_replicas_share_one_memory_through_jetstream() {
    let compose = compose();
    let catalog = &compose["services"]["catalog"];
    let second = &compose["services"]["catalog-2"];
    for field in ["image", "command", "environment", "volumes", "depends_on"] {
        assert_eq!(
            catalog[field], second[field],
            "both replicas alike: {field}"
        );
    }
    assert_ne!(catalog["ports"], second["ports"], "each its own host port");
    // One key, drawn once into a volume both mount.
    let key_file = catalog["environment"]["CTXSYNC_CATALOG_MEMORY_KEY_FILE"]
        .as_str()
        .expect("the memory key is a file");
    let key_dir = std::path::Path::new(key_file).parent().unwrap();
    let key_volume = catalog["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str()?.split_once(':'))
        .find(|(_, target)| target.trim_end_matches(":ro") == key_dir.to_str().unwrap())
        .map(|(volume, _)| volume.to_owned())
        .expect("the key's directory is a volume");
    let writer = &compose["services"]["catalog-memory-key"];
    assert!(is_one_shot(writer));
    let written = writer["volumes"][0].as_str().unwrap();
    assert!(
        written.starts_with(&format!("{key_volume}:")),
        "the key writer fills {key_volume}: {written}"
    );
    assert!(
        compose["volumes"]
            .as_mapping()
            .is_some_and(|v| v.contains_key(key_volume.as_str())),
        "{key_volume} is a named volume"
    );
    // JetStream's store on a volume, where nats.conf puts it.
    let conf = deploy_checks::nats_conf::parse(
        &std::fs::read_to_string(deploy_dir().join("k8s/nats/nats.conf")).unwrap(),
    )
    .unwrap();
    let store = conf["jetstream"]["store_dir"]
        .as_str()
        .expect("JetStream is on");
    let mounts: Vec<&str> = compose["services"]["nats"]["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert!(
        mounts.iter().any(|m| m
            .split(':')
            .nth(1)
            .is_some_and(|target| std::path::Path::new(store).starts_with(target))
            && !m.starts_with('.')),
        "the JetStream store {store} is on a named volume: {mounts:?}"
    );
}
