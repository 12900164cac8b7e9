//! deploy/k8s: the kustomization renders, every object is valid against the
//! Kubernetes schemas, and the workloads have probes, resources, replicas,
//! disruption budgets, non-root read-only containers, migrations before the
//! services, and the NATS users of the shared nats.conf.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use deploy_checks::{deploy_dir, env_names_in_code, run, tool, yaml_documents};
use serde_yaml::Value;

/// Oldest Kubernetes minor the base must validate against.
const KUBERNETES_VERSION: &str = "1.30.0";
const SERVICES: [&str; 4] = ["snapshot-store", "agent-ingest", "chat-gate", "catalog"];

fn render() -> String {
    run(Command::new(tool("kubectl"))
        .arg("kustomize")
        .arg(deploy_dir().join("k8s")))
}

fn objects() -> Vec<Value> {
    yaml_documents(&render())
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn pod_spec(workload: &Value) -> &Value {
    &workload["spec"]["template"]["spec"]
}

fn containers(workload: &Value) -> Vec<&Value> {
    let spec = pod_spec(workload);
    spec["containers"]
        .as_sequence()
        .into_iter()
        .chain(spec["initContainers"].as_sequence())
        .flatten()
        .collect()
}

fn labels_match(selector: &Value, labels: &Value) -> bool {
    selector["matchLabels"]
        .as_mapping()
        .is_some_and(|m| !m.is_empty() && m.iter().all(|(k, v)| &labels[k] == v))
}

#[test]
fn rendered_manifests_are_valid_against_the_kubernetes_schemas() {
    let dir = tempfile::tempdir().unwrap();
    let rendered = dir.path().join("rendered.yaml");
    std::fs::write(&rendered, render()).unwrap();
    let output = run(Command::new(tool("kubernetes-validate"))
        .args(["--strict", "--kubernetes-version", KUBERNETES_VERSION])
        .arg(&rendered));
    let passed = output
        .lines()
        .filter(|l| l.contains(" passed for resource "))
        .count();
    assert_eq!(passed, objects().len(), "every object validated:\n{output}");
}

#[test]
fn services_have_probes_resources_replicas_budgets_and_services() {
    let objects = objects();
    let deployments: BTreeSet<&str> = objects
        .iter()
        .filter(|o| o["kind"] == "Deployment")
        .map(|o| o["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(deployments, SERVICES.into_iter().collect());
    let config = find(&objects, "ConfigMap", "ctxsync-config");
    let port: u64 = config["data"]["CTXSYNC_HTTP_ADDR"]
        .as_str()
        .unwrap()
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();

    for name in SERVICES {
        let deployment = find(&objects, "Deployment", name);
        let replicas = deployment["spec"]["replicas"].as_u64().unwrap();
        assert!(replicas >= 2, "{name}: {replicas} replicas");
        let pod_labels = &deployment["spec"]["template"]["metadata"]["labels"];
        assert!(
            labels_match(&deployment["spec"]["selector"], pod_labels),
            "{name}: selector matches its pods"
        );

        let container = &pod_spec(deployment)["containers"][0];
        assert_eq!(
            container["command"][0].as_str(),
            Some(name),
            "{name} runs its own binary"
        );
        let http = container["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "http")
            .unwrap_or_else(|| panic!("{name}: a port named http"));
        assert_eq!(
            http["containerPort"].as_u64(),
            Some(port),
            "{name}: the port CTXSYNC_HTTP_ADDR binds"
        );
        for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")] {
            let get = &container[probe]["httpGet"];
            assert_eq!(get["path"].as_str(), Some(path), "{name}: {probe}");
            assert_eq!(get["port"].as_str(), Some("http"), "{name}: {probe} port");
        }

        let budget = objects
            .iter()
            .find(|o| {
                o["kind"] == "PodDisruptionBudget"
                    && labels_match(&o["spec"]["selector"], pod_labels)
            })
            .unwrap_or_else(|| panic!("{name}: no PodDisruptionBudget"));
        let min_available = budget["spec"]["minAvailable"]
            .as_u64()
            .expect("minAvailable");
        assert!(
            min_available >= 1 && min_available < replicas,
            "{name}: the budget lets a drain proceed"
        );

        let service = find(&objects, "Service", name);
        let selector = service["spec"]["selector"]
            .as_mapping()
            .expect("Service selector");
        assert!(
            !selector.is_empty() && selector.iter().all(|(k, v)| &pod_labels[k] == v),
            "{name}: Service selects its pods"
        );
    }
}

#[test]
fn every_container_has_resources_and_runs_non_root_on_a_read_only_root() {
    let objects = objects();
    let workloads: Vec<&Value> = objects
        .iter()
        .filter(|o| ["Deployment", "StatefulSet", "Job"].contains(&o["kind"].as_str().unwrap()))
        .collect();
    assert!(workloads.len() >= 7, "services, NATS, Postgres, migrations");
    for workload in workloads {
        let name = workload["metadata"]["name"].as_str().unwrap();
        let pod = &pod_spec(workload)["securityContext"];
        assert_eq!(
            pod["runAsNonRoot"].as_bool(),
            Some(true),
            "{name}: runAsNonRoot"
        );
        assert!(
            pod["runAsUser"].as_u64().is_some_and(|u| u != 0),
            "{name}: a non-root runAsUser"
        );
        assert_eq!(
            pod["seccompProfile"]["type"].as_str(),
            Some("RuntimeDefault"),
            "{name}: seccomp"
        );
        for container in containers(workload) {
            let c = container["name"].as_str().unwrap();
            for kind in ["requests", "limits"] {
                for resource in ["cpu", "memory"] {
                    assert!(
                        !container["resources"][kind][resource].is_null(),
                        "{name}/{c}: resources.{kind}.{resource}"
                    );
                }
            }
            let security = &container["securityContext"];
            assert_eq!(
                security["readOnlyRootFilesystem"].as_bool(),
                Some(true),
                "{name}/{c}: read-only root"
            );
            assert_eq!(
                security["allowPrivilegeEscalation"].as_bool(),
                Some(false),
                "{name}/{c}: no privilege escalation"
            );
            assert_eq!(
                security["capabilities"]["drop"][0].as_str(),
                Some("ALL"),
                "{name}/{c}: drops capabilities"
            );
            assert_ne!(
                security["runAsUser"].as_u64(),
                Some(0),
                "{name}/{c}: not root"
            );
        }
    }
}

#[test]
fn migrations_run_once_before_the_schema_owners_start() {
    let objects = objects();
    let job = find(&objects, "Job", "ctxsync-migrate");
    let migrate = &pod_spec(job)["containers"][0];
    assert_eq!(
        migrate["command"],
        serde_yaml::from_str::<Value>("[ctxsync, migrate]").unwrap()
    );
    let job_env: Vec<&str> = migrate["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert!(job_env.contains(&"DATABASE_URL"));

    for name in SERVICES {
        let deployment = find(&objects, "Deployment", name);
        let spec = pod_spec(deployment);
        let env = spec["containers"][0]["env"].as_sequence().unwrap();
        let owns_schema = env.iter().any(|e| e["name"] == "DATABASE_URL");
        assert_eq!(
            owns_schema,
            ["snapshot-store", "catalog"].contains(&name),
            "{name}: DATABASE_URL"
        );
        if !owns_schema {
            continue;
        }
        let wait = spec["initContainers"]
            .as_sequence()
            .and_then(|i| i.iter().find(|c| c["name"] == "wait-for-migrations"))
            .unwrap_or_else(|| panic!("{name} does not wait for the migrations"));
        let args: Vec<&str> = wait["args"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert!(
            args.contains(&"wait")
                && args.contains(&"--for=condition=complete")
                && args.contains(&"job/ctxsync-migrate"),
            "{args:?}"
        );
        // Its service account may read that Job.
        let account = spec["serviceAccountName"]
            .as_str()
            .expect("serviceAccountName");
        let binding = objects
            .iter()
            .find(|o| {
                o["kind"] == "RoleBinding"
                    && o["subjects"]
                        .as_sequence()
                        .unwrap()
                        .iter()
                        .any(|s| s["name"] == account)
            })
            .unwrap_or_else(|| panic!("no RoleBinding for {account}"));
        let role = find(
            &objects,
            "Role",
            binding["roleRef"]["name"].as_str().unwrap(),
        );
        let rule = &role["rules"][0];
        assert_eq!(rule["resources"][0].as_str(), Some("jobs"));
        assert_eq!(rule["resourceNames"][0].as_str(), Some("ctxsync-migrate"));
        let verbs: Vec<&str> = rule["verbs"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert!(
            verbs.contains(&"get") && verbs.contains(&"watch"),
            "{verbs:?}"
        );
    }
}

#[test]
fn nats_runs_the_shared_config_and_each_service_its_own_user() {
    let objects = objects();
    let nats = find(&objects, "StatefulSet", "nats");
    let config_map_name = pod_spec(nats)["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find_map(|v| v["configMap"]["name"].as_str())
        .expect("nats mounts a ConfigMap");
    let config_map = find(&objects, "ConfigMap", config_map_name);
    let on_disk = std::fs::read_to_string(deploy_dir().join("k8s/nats/nats.conf")).unwrap();
    assert_eq!(
        config_map["data"]["nats.conf"].as_str(),
        Some(on_disk.as_str()),
        "the ConfigMap holds deploy/k8s/nats/nats.conf"
    );
    let parsed = deploy_checks::nats_conf::parse(&on_disk).unwrap();
    assert!(parsed["jetstream"].is_object(), "JetStream is on");

    let secret = find(&objects, "Secret", "ctxsync-secrets");
    let secret_keys: BTreeMap<String, String> = secret["stringData"]
        .as_mapping()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().unwrap().to_owned(),
                v.as_str().unwrap().to_owned(),
            )
        })
        .collect();
    for (key, value) in &secret_keys {
        assert!(
            value.contains("CHANGE-ME"),
            "Secret {key} is a clearly marked placeholder"
        );
    }
    let nats_env: BTreeMap<&str, &str> = pod_spec(nats)["containers"][0]["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap(),
                e["valueFrom"]["secretKeyRef"]["key"].as_str().unwrap(),
            )
        })
        .collect();
    for user in parsed["authorization"]["users"].as_array().unwrap() {
        let variable = user["password"].as_str().unwrap().trim_start_matches('$');
        assert_eq!(
            nats_env.get(variable),
            Some(&variable),
            "nats gets {variable} from the Secret"
        );
        assert!(
            secret_keys.contains_key(variable),
            "the Secret has {variable}"
        );
    }

    for name in SERVICES {
        let container = &pod_spec(find(&objects, "Deployment", name))["containers"][0];
        let env = container["env"].as_sequence().unwrap();
        let value = |key: &str| {
            env.iter()
                .find(|e| e["name"] == key)
                .unwrap_or_else(|| panic!("{name}: {key}"))
        };
        assert_eq!(
            value("NATS_URL")["value"].as_str(),
            Some(format!("nats://{name}:$(NATS_PASSWORD)@nats:4222").as_str())
        );
        let key = format!("NATS_PASSWORD_{}", name.to_uppercase().replace('-', "_"));
        assert_eq!(
            value("NATS_PASSWORD")["valueFrom"]["secretKeyRef"]["key"].as_str(),
            Some(key.as_str())
        );
    }
}

#[test]
fn configuration_uses_env_names_the_code_reads() {
    let objects = objects();
    let known = env_names_in_code();
    let config = find(&objects, "ConfigMap", "ctxsync-config");
    for (key, _) in config["data"].as_mapping().unwrap() {
        let key = key.as_str().unwrap();
        assert!(
            known.contains(key),
            "ConfigMap sets {key}, which no service reads"
        );
    }
    // NATS_PASSWORD only builds NATS_URL; HOME gives npx a writable home.
    let helpers = ["NATS_PASSWORD", "HOME"];
    for name in SERVICES.iter().chain(&["ctxsync-migrate"]) {
        let kind = if *name == "ctxsync-migrate" {
            "Job"
        } else {
            "Deployment"
        };
        let container = &pod_spec(find(&objects, kind, name))["containers"][0];
        for entry in container["env"].as_sequence().unwrap() {
            let key = entry["name"].as_str().unwrap();
            assert!(
                known.contains(key) || helpers.contains(&key),
                "{name} sets {key}, which no service reads"
            );
        }
    }
    let catalog = &pod_spec(find(&objects, "Deployment", "catalog"));
    let path = catalog["containers"][0]["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "CTXSYNC_CATALOG_CONFIG")
        .and_then(|e| e["value"].as_str())
        .expect("CTXSYNC_CATALOG_CONFIG");
    let mount = catalog["containers"][0]["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "catalog-config")
        .expect("the catalog config is mounted");
    assert_eq!(
        format!("{}/catalog.yaml", mount["mountPath"].as_str().unwrap()),
        path
    );
}
