//! The pods a rendered `deploy/k8s` asks for, read from the objects as the
//! API server and the kubelet would: every Deployment's and StatefulSet's
//! replicas with their pod spec resolved (env with `valueFrom` and
//! `envFrom`, `$(VAR)` references, ConfigMap and Secret files with their
//! modes, `emptyDir`s, volume claims, the securityContext, probes,
//! `preStop`, the grace) and the Services that select each pod.
//!
//! Pure: no container engine here. The manifest-driven container test runs
//! these plans in Docker; a plan that cannot be made (a Secret key that is
//! not there, a probe on a port the container does not name, a mount of no
//! volume) is an error that names the object and the field.

use std::collections::BTreeMap;

use serde_norway::Value;

/// One pod to run.
#[derive(Debug, Clone)]
pub struct PodPlan {
    /// `Deployment/catalog`, `StatefulSet/nats`.
    pub workload: String,
    /// The pod's name: `<statefulset>-<ordinal>`, or `<deployment>-<n>`.
    pub name: String,
    /// The pod's labels (Services select on them).
    pub labels: BTreeMap<String, String>,
    /// DNS names other pods reach this one by: its own name, and for a
    /// StatefulSet `<pod>.<serviceName>`.
    pub hostnames: Vec<String>,
    pub container: String,
    pub image: String,
    /// `command` (replaces the image's entrypoint) and `args` (its CMD).
    pub command: Option<Vec<String>>,
    pub args: Option<Vec<String>>,
    /// The environment, in the order the kubelet sets it (envFrom first).
    pub env: Vec<(String, String)>,
    /// Named container ports.
    pub ports: BTreeMap<String, u16>,
    pub run_as_user: Option<u64>,
    pub run_as_group: Option<u64>,
    pub fs_group: Option<u64>,
    pub read_only_root: bool,
    pub no_new_privileges: bool,
    pub drop_capabilities: Vec<String>,
    pub add_capabilities: Vec<String>,
    pub memory_limit: Option<String>,
    pub cpu_limit: Option<String>,
    pub mounts: Vec<Mount>,
    pub readiness: Option<Probe>,
    pub liveness: Option<Probe>,
    pub pre_stop: Option<Hook>,
    pub termination_grace_seconds: u64,
}

#[derive(Debug, Clone)]
pub struct Mount {
    pub path: String,
    pub read_only: bool,
    pub source: MountSource,
}

#[derive(Debug, Clone)]
pub enum MountSource {
    /// ConfigMap or Secret files: name, content, mode.
    Files(Vec<(String, Vec<u8>, u32)>),
    EmptyDir,
    /// A volume claim of a StatefulSet: `<claim>-<pod>`, kept across restarts.
    Claim(String),
}

#[derive(Debug, Clone)]
pub struct Probe {
    pub action: ProbeAction,
    pub initial_delay_seconds: u64,
    pub period_seconds: u64,
    pub timeout_seconds: u64,
    pub failure_threshold: u32,
}

#[derive(Debug, Clone)]
pub enum ProbeAction {
    Http { path: String, port: u16 },
    Exec(Vec<String>),
}

#[derive(Debug, Clone)]
pub enum Hook {
    Sleep(u64),
    Exec(Vec<String>),
}

/// A Service: who it selects and its ports (port → target container port
/// name or number).
#[derive(Debug, Clone)]
pub struct ServicePlan {
    pub name: String,
    pub selector: BTreeMap<String, String>,
    pub headless: bool,
    pub publish_not_ready: bool,
    pub ports: Vec<(u16, Value)>,
}

impl ServicePlan {
    pub fn selects(&self, pod: &PodPlan) -> bool {
        !self.selector.is_empty()
            && self
                .selector
                .iter()
                .all(|(k, v)| pod.labels.get(k) == Some(v))
    }

    /// The container port `port` of this Service reaches on `pod`.
    pub fn target_port(&self, port: u16, pod: &PodPlan) -> Result<u16, String> {
        let (_, target) = self
            .ports
            .iter()
            .find(|(p, _)| *p == port)
            .ok_or_else(|| format!("Service {} has no port {port}", self.name))?;
        resolve_port(target, &pod.ports)
            .map_err(|e| format!("Service {} port {port}: {e} on pod {}", self.name, pod.name))
    }
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

fn strings(value: &Value) -> Option<Vec<String>> {
    value
        .as_sequence()
        .map(|items| items.iter().filter_map(text).collect())
}

fn labels(value: &Value) -> BTreeMap<String, String> {
    value
        .as_mapping()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.as_str()?.to_owned(), text(v)?)))
                .collect()
        })
        .unwrap_or_default()
}

fn resolve_port(port: &Value, named: &BTreeMap<String, u16>) -> Result<u16, String> {
    match port {
        Value::Number(n) => n
            .as_u64()
            .and_then(|n| u16::try_from(n).ok())
            .ok_or_else(|| format!("port {n} is out of range")),
        Value::String(name) => named
            .get(name)
            .copied()
            .ok_or_else(|| format!("no container port is named {name:?}")),
        other => Err(format!("port {other:?} is neither a number nor a name")),
    }
}

/// The ConfigMaps' and Secrets' data, decoded.
struct Data {
    config_maps: BTreeMap<String, BTreeMap<String, Vec<u8>>>,
    secrets: BTreeMap<String, BTreeMap<String, Vec<u8>>>,
}

impl Data {
    fn of(objects: &[Value]) -> Result<Self, String> {
        use base64::Engine as _;
        let mut data = Data {
            config_maps: BTreeMap::new(),
            secrets: BTreeMap::new(),
        };
        for object in objects {
            let name = object["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            match object["kind"].as_str() {
                Some("ConfigMap") => {
                    let mut entries = BTreeMap::new();
                    if let Some(map) = object["data"].as_mapping() {
                        for (k, v) in map {
                            entries.insert(
                                k.as_str().unwrap_or_default().to_owned(),
                                text(v).unwrap_or_default().into_bytes(),
                            );
                        }
                    }
                    data.config_maps.insert(name, entries);
                }
                Some("Secret") => {
                    let mut entries = BTreeMap::new();
                    if let Some(map) = object["data"].as_mapping() {
                        for (k, v) in map {
                            let key = k.as_str().unwrap_or_default().to_owned();
                            let decoded = base64::engine::general_purpose::STANDARD
                                .decode(v.as_str().unwrap_or_default())
                                .map_err(|e| format!("Secret {name} key {key}: {e}"))?;
                            entries.insert(key, decoded);
                        }
                    }
                    if let Some(map) = object["stringData"].as_mapping() {
                        for (k, v) in map {
                            entries.insert(
                                k.as_str().unwrap_or_default().to_owned(),
                                text(v).unwrap_or_default().into_bytes(),
                            );
                        }
                    }
                    data.secrets.insert(name, entries);
                }
                _ => {}
            }
        }
        Ok(data)
    }

    fn source(&self, secret: bool, name: &str) -> Result<&BTreeMap<String, Vec<u8>>, String> {
        let (kind, all) = if secret {
            ("Secret", &self.secrets)
        } else {
            ("ConfigMap", &self.config_maps)
        };
        all.get(name)
            .ok_or_else(|| format!("no {kind} named {name}"))
    }

    fn key(&self, secret: bool, name: &str, key: &str) -> Result<String, String> {
        let kind = if secret { "Secret" } else { "ConfigMap" };
        let bytes = self
            .source(secret, name)?
            .get(key)
            .ok_or_else(|| format!("{kind} {name} has no key {key}"))?;
        String::from_utf8(bytes.clone()).map_err(|_| format!("{kind} {name} key {key} is not text"))
    }
}

/// Expands `$(VAR)` with the variables defined so far (`$$` escapes), as
/// the kubelet does; an unknown reference stays as written.
fn expand(value: &str, env: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = value;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        if let Some(escaped) = tail.strip_prefix("$$") {
            out.push('$');
            rest = escaped;
        } else if let Some(open) = tail.strip_prefix("$(")
            && let Some(close) = open.find(')')
        {
            let name = &open[..close];
            match env.iter().rev().find(|(k, _)| k == name) {
                Some((_, v)) => out.push_str(v),
                None => out.push_str(&tail[..close + 3]),
            }
            rest = &open[close + 1..];
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

fn probe(value: &Value, ports: &BTreeMap<String, u16>) -> Result<Option<Probe>, String> {
    if value.is_null() {
        return Ok(None);
    }
    let action = if !value["httpGet"].is_null() {
        ProbeAction::Http {
            path: value["httpGet"]["path"].as_str().unwrap_or("/").to_owned(),
            port: resolve_port(&value["httpGet"]["port"], ports)?,
        }
    } else if let Some(command) = strings(&value["exec"]["command"]) {
        ProbeAction::Exec(command)
    } else {
        return Err(format!("a probe neither httpGet nor exec: {value:?}"));
    };
    let number = |field: &str, default: u64| value[field].as_u64().unwrap_or(default);
    Ok(Some(Probe {
        action,
        initial_delay_seconds: number("initialDelaySeconds", 0),
        period_seconds: number("periodSeconds", 10),
        timeout_seconds: number("timeoutSeconds", 1),
        failure_threshold: number("failureThreshold", 3) as u32,
    }))
}

/// The files a ConfigMap or Secret volume holds: every key, or its `items`.
fn volume_files(
    volume: &Value,
    secret: bool,
    data: &Data,
) -> Result<Vec<(String, Vec<u8>, u32)>, String> {
    let source = if secret {
        &volume["secret"]
    } else {
        &volume["configMap"]
    };
    let name = if secret {
        source["secretName"].as_str()
    } else {
        source["name"].as_str()
    }
    .ok_or("a volume source without a name")?;
    let mode = source["defaultMode"].as_u64().unwrap_or(0o644) as u32;
    let all = data.source(secret, name)?;
    match source["items"].as_sequence() {
        None => Ok(all
            .iter()
            .map(|(k, v)| (k.clone(), v.clone(), mode))
            .collect()),
        Some(items) => items
            .iter()
            .map(|item| {
                let key = item["key"].as_str().ok_or("an item without a key")?;
                let path = item["path"].as_str().ok_or("an item without a path")?;
                let kind = if secret { "Secret" } else { "ConfigMap" };
                let bytes = all
                    .get(key)
                    .ok_or_else(|| format!("{kind} {name} has no key {key}"))?;
                let mode = item["mode"].as_u64().map_or(mode, |m| m as u32);
                Ok((path.to_owned(), bytes.clone(), mode))
            })
            .collect(),
    }
}

/// The pods of every Deployment and StatefulSet in `objects`, replicas as
/// written. `namespace` is the rendered objects' (for `fieldRef`).
pub fn pods(objects: &[Value]) -> Result<Vec<PodPlan>, String> {
    let data = Data::of(objects)?;
    let mut pods = Vec::new();
    for workload in objects {
        let kind = workload["kind"].as_str().unwrap_or_default();
        if kind != "Deployment" && kind != "StatefulSet" {
            continue;
        }
        let name = workload["metadata"]["name"].as_str().unwrap_or_default();
        let replicas = workload["spec"]["replicas"].as_u64().unwrap_or(1);
        for ordinal in 0..replicas {
            let pod_name = format!("{name}-{ordinal}");
            let plan = pod(workload, &pod_name, &data)
                .map_err(|e| format!("{kind} {name} (pod {pod_name}): {e}"))?;
            pods.push(plan);
        }
    }
    Ok(pods)
}

/// The pod `pod_name` of `workload` (also a new pod of a rolling update).
pub fn pod_of(objects: &[Value], workload: &str, pod_name: &str) -> Result<PodPlan, String> {
    let data = Data::of(objects)?;
    let (kind, name) = workload.split_once('/').ok_or("workload is Kind/name")?;
    let object = objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .ok_or_else(|| format!("no {workload}"))?;
    pod(object, pod_name, &data).map_err(|e| format!("{workload} (pod {pod_name}): {e}"))
}

fn pod(workload: &Value, pod_name: &str, data: &Data) -> Result<PodPlan, String> {
    let kind = workload["kind"].as_str().unwrap_or_default();
    let name = workload["metadata"]["name"].as_str().unwrap_or_default();
    let namespace = workload["metadata"]["namespace"]
        .as_str()
        .unwrap_or("default");
    let template = &workload["spec"]["template"];
    let spec = &template["spec"];
    let containers = spec["containers"].as_sequence().ok_or("no containers")?;
    if containers.len() != 1 {
        return Err(format!(
            "{} containers: the harness runs pods of one",
            containers.len()
        ));
    }
    if !spec["initContainers"].is_null() {
        return Err("initContainers are not run by the harness".into());
    }
    let container = &containers[0];
    let mut ports = BTreeMap::new();
    for port in container["ports"].as_sequence().into_iter().flatten() {
        let number = port["containerPort"]
            .as_u64()
            .ok_or("a port without containerPort")?;
        if let Some(port_name) = port["name"].as_str() {
            ports.insert(port_name.to_owned(), number as u16);
        }
    }

    let mut env: Vec<(String, String)> = Vec::new();
    for from in container["envFrom"].as_sequence().into_iter().flatten() {
        let prefix = from["prefix"].as_str().unwrap_or_default();
        let (secret, source) = if !from["secretRef"].is_null() {
            (true, &from["secretRef"])
        } else {
            (false, &from["configMapRef"])
        };
        let source_name = source["name"].as_str().ok_or("envFrom without a name")?;
        for (k, v) in data.source(secret, source_name)? {
            let value = String::from_utf8(v.clone())
                .map_err(|_| format!("{source_name} {k} is not text"))?;
            env.push((format!("{prefix}{k}"), value));
        }
    }
    for var in container["env"].as_sequence().into_iter().flatten() {
        let var_name = var["name"]
            .as_str()
            .ok_or("an env var without a name")?
            .to_owned();
        let value = if let Some(value) = var.get("value") {
            expand(&text(value).unwrap_or_default(), &env)
        } else if let Some(from) = var.get("valueFrom") {
            if !from["secretKeyRef"].is_null() {
                let r = &from["secretKeyRef"];
                data.key(
                    true,
                    r["name"].as_str().unwrap_or_default(),
                    r["key"].as_str().unwrap_or_default(),
                )
                .map_err(|e| format!("env {var_name}: {e}"))?
            } else if !from["configMapKeyRef"].is_null() {
                let r = &from["configMapKeyRef"];
                data.key(
                    false,
                    r["name"].as_str().unwrap_or_default(),
                    r["key"].as_str().unwrap_or_default(),
                )
                .map_err(|e| format!("env {var_name}: {e}"))?
            } else if let Some(path) = from["fieldRef"]["fieldPath"].as_str() {
                match path {
                    "metadata.name" => pod_name.to_owned(),
                    "metadata.namespace" => namespace.to_owned(),
                    other => {
                        return Err(format!("env {var_name}: fieldRef {other} is not supported"));
                    }
                }
            } else {
                return Err(format!("env {var_name}: an unsupported valueFrom"));
            }
        } else {
            String::new()
        };
        env.retain(|(k, _)| *k != var_name);
        env.push((var_name, value));
    }

    let volumes: BTreeMap<String, &Value> = spec["volumes"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter_map(|v| Some((v["name"].as_str()?.to_owned(), v)))
        .collect();
    let claims: Vec<String> = workload["spec"]["volumeClaimTemplates"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter_map(|c| c["metadata"]["name"].as_str().map(str::to_owned))
        .collect();
    let mut mounts = Vec::new();
    for mount in container["volumeMounts"]
        .as_sequence()
        .into_iter()
        .flatten()
    {
        let volume = mount["name"].as_str().ok_or("a mount without a name")?;
        let path = mount["mountPath"]
            .as_str()
            .ok_or("a mount without a path")?
            .to_owned();
        let read_only = mount["readOnly"].as_bool().unwrap_or(false);
        let source = if let Some(v) = volumes.get(volume) {
            if !v["configMap"].is_null() {
                MountSource::Files(
                    volume_files(v, false, data).map_err(|e| format!("volume {volume}: {e}"))?,
                )
            } else if !v["secret"].is_null() {
                MountSource::Files(
                    volume_files(v, true, data).map_err(|e| format!("volume {volume}: {e}"))?,
                )
            } else if !v["emptyDir"].is_null() {
                MountSource::EmptyDir
            } else {
                return Err(format!("volume {volume}: a kind the harness does not run"));
            }
        } else if claims.iter().any(|c| c == volume) {
            MountSource::Claim(format!("{volume}-{pod_name}"))
        } else {
            return Err(format!("mount {path}: no volume or claim named {volume}"));
        };
        mounts.push(Mount {
            path,
            read_only,
            source,
        });
    }

    let pod_security = &spec["securityContext"];
    let security = &container["securityContext"];
    let id = |field: &str| {
        security[field]
            .as_u64()
            .or_else(|| pod_security[field].as_u64())
    };
    let capabilities = |field: &str| strings(&security["capabilities"][field]).unwrap_or_default();
    let pre_stop = &container["lifecycle"]["preStop"];
    let pre_stop = if let Some(seconds) = pre_stop["sleep"]["seconds"].as_u64() {
        Some(Hook::Sleep(seconds))
    } else {
        strings(&pre_stop["exec"]["command"]).map(Hook::Exec)
    };
    let service_name = workload["spec"]["serviceName"].as_str();
    let mut hostnames = vec![pod_name.to_owned()];
    if kind == "StatefulSet"
        && let Some(service) = service_name
    {
        hostnames.push(format!("{pod_name}.{service}"));
    }
    Ok(PodPlan {
        workload: format!("{kind}/{name}"),
        name: pod_name.to_owned(),
        labels: labels(&template["metadata"]["labels"]),
        hostnames,
        container: container["name"].as_str().unwrap_or_default().to_owned(),
        image: container["image"]
            .as_str()
            .ok_or("a container without an image")?
            .to_owned(),
        command: strings(&container["command"]),
        args: strings(&container["args"]),
        env,
        readiness: probe(&container["readinessProbe"], &ports)
            .map_err(|e| format!("readinessProbe: {e}"))?,
        liveness: probe(&container["livenessProbe"], &ports)
            .map_err(|e| format!("livenessProbe: {e}"))?,
        ports,
        run_as_user: id("runAsUser"),
        run_as_group: id("runAsGroup"),
        fs_group: pod_security["fsGroup"].as_u64(),
        read_only_root: security["readOnlyRootFilesystem"]
            .as_bool()
            .unwrap_or(false),
        no_new_privileges: security["allowPrivilegeEscalation"].as_bool() == Some(false),
        drop_capabilities: capabilities("drop"),
        add_capabilities: capabilities("add"),
        memory_limit: text(&container["resources"]["limits"]["memory"]),
        cpu_limit: text(&container["resources"]["limits"]["cpu"]),
        mounts,
        pre_stop,
        termination_grace_seconds: spec["terminationGracePeriodSeconds"].as_u64().unwrap_or(30),
    })
}

/// Every Service in `objects`.
pub fn services(objects: &[Value]) -> Vec<ServicePlan> {
    objects
        .iter()
        .filter(|o| o["kind"] == "Service")
        .map(|s| ServicePlan {
            name: s["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            selector: labels(&s["spec"]["selector"]),
            headless: s["spec"]["clusterIP"].as_str() == Some("None"),
            publish_not_ready: s["spec"]["publishNotReadyAddresses"].as_bool() == Some(true),
            ports: s["spec"]["ports"]
                .as_sequence()
                .into_iter()
                .flatten()
                .filter_map(|p| {
                    let port = p["port"].as_u64()? as u16;
                    let target = if p["targetPort"].is_null() {
                        Value::Number(port.into())
                    } else {
                        p["targetPort"].clone()
                    };
                    Some((port, target))
                })
                .collect(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_expand_to_earlier_variables_and_escapes_stay() {
        let env = vec![("PW".to_owned(), "secret".to_owned())];
        assert_eq!(
            expand("nats://u:$(PW)@nats:4222", &env),
            "nats://u:secret@nats:4222"
        );
        assert_eq!(expand("$$(PW) $(NOPE) $", &env), "$(PW) $(NOPE) $");
    }

    #[test]
    fn a_pod_plan_resolves_env_files_probes_and_claims() {
        let objects = crate::yaml_documents(
            r#"
kind: Secret
metadata: {name: s}
data: {K: c2VjcmV0}
---
kind: ConfigMap
metadata: {name: c}
data: {A: one, file.yaml: "x: 1"}
---
kind: StatefulSet
metadata: {name: db, namespace: ns}
spec:
  replicas: 2
  serviceName: db-headless
  template:
    metadata: {labels: {app: db}}
    spec:
      securityContext: {runAsUser: 7, fsGroup: 8}
      containers:
        - name: db
          image: img
          args: ["-c", "x"]
          ports: [{name: http, containerPort: 81}]
          envFrom: [{configMapRef: {name: c}}]
          env:
            - {name: PW, valueFrom: {secretKeyRef: {name: s, key: K}}}
            - {name: URL, value: "u:$(PW)@$(A)"}
            - {name: POD, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
          readinessProbe: {httpGet: {path: /r, port: http}, periodSeconds: 2}
          volumeMounts:
            - {name: conf, mountPath: /etc/c, readOnly: true}
            - {name: data, mountPath: /data}
      volumes:
        - {name: conf, configMap: {name: c, items: [{key: file.yaml, path: f.yaml}]}}
  volumeClaimTemplates:
    - metadata: {name: data}
"#,
        );
        let pods = pods(&objects).unwrap();
        assert_eq!(pods.len(), 2);
        let pod = &pods[1];
        assert_eq!(pod.name, "db-1");
        assert_eq!(pod.hostnames, ["db-1", "db-1.db-headless"]);
        let env: BTreeMap<_, _> = pod.env.iter().cloned().collect();
        assert_eq!(env["URL"], "u:secret@one");
        assert_eq!(env["POD"], "db-1");
        assert_eq!((pod.run_as_user, pod.fs_group), (Some(7), Some(8)));
        assert!(matches!(
            &pod.readiness.as_ref().unwrap().action,
            ProbeAction::Http { port: 81, .. }
        ));
        assert!(
            matches!(&pod.mounts[0].source, MountSource::Files(f) if f[0].0 == "f.yaml" && f[0].1 == b"x: 1")
        );
        assert!(matches!(&pod.mounts[1].source, MountSource::Claim(c) if c == "data-db-1"));
    }

    #[test]
    fn what_the_manifests_do_not_hold_is_an_error_naming_it() {
        let base = r#"
kind: Deployment
metadata: {name: web}
spec:
  template:
    spec:
      containers:
        - name: web
          image: img
          ports: [{name: http, containerPort: 80}]
"#;
        for (extra, expected) in [
            (
                "          env: [{name: X, valueFrom: {secretKeyRef: {name: gone, key: K}}}]\n",
                "env X: no Secret named gone",
            ),
            (
                "          readinessProbe: {httpGet: {path: /, port: metrics}}\n",
                "readinessProbe: no container port is named \"metrics\"",
            ),
            (
                "          volumeMounts: [{name: nothing, mountPath: /x}]\n",
                "mount /x: no volume or claim named nothing",
            ),
        ] {
            let error = pods(&crate::yaml_documents(&format!("{base}{extra}"))).unwrap_err();
            assert!(error.contains(expected), "{error}");
            assert!(error.starts_with("Deployment web (pod web-0)"), "{error}");
        }
    }
}
