//! The manifest-driven container test: `deploy/k8s` rendered by kustomize
//! (with generated secrets), and every Deployment's and StatefulSet's pods
//! run in Docker as the rendered objects say (`deploy_checks::pods`): their
//! command and args, env (ConfigMaps and Secrets resolved, `valueFrom` and
//! `$(VAR)` included), ConfigMap and Secret files at their mount paths with
//! the fsGroup's group, `emptyDir`s, volume claims as named volumes that
//! outlive a pod, the securityContext (user, group, read-only root, dropped
//! capabilities, no privilege escalation), memory and CPU limits, Services
//! and StatefulSet pod names as network aliases, replicas as written; the
//! harness polls every readiness and liveness probe as the kubelet would
//! and restarts a container that exits (or fails liveness). Then a tenant
//! key, the demo workspace's agent (the real workspace-agent, in a
//! container beside the pods, reaching agent-ingest by its Service name)
//! and a first turn `ready` with its tools and catalog pins; then every
//! Deployment rolled and the NATS pods one at a time, under load.
//!
//! It is not Kubernetes: no scheduler, no kubelet, no API server, no
//! NetworkPolicy enforcement, no Service virtual IPs (a Service's in-cluster
//! name resolves to every pod it selects, ready or not, on the port the pod
//! listens on: a Service port that differs from its target is not
//! remapped), no resource requests. The images are the ones this run built,
//! standing in for the manifests' image names (printed). The harness's own
//! clients, like kube-proxy, use only ready pods.

mod common;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{
    BASE_IMAGE, NATS_IMAGE, POSTGRES_IMAGE, build_images, docker, require_engine_and_images,
    tool_names,
};
use deploy_checks::pods::{Hook, Mount, MountSource, PodPlan, Probe, ProbeAction, ServicePlan};
use deploy_checks::{copy_tree, deploy_dir, run, tool, yaml_documents};
use serde_json::{Value, json};
use testkit::agent::FakeAgent;
use testkit::report::{complete, server};

/// Exits before a pod was ever ready that fail a run (a pod started before
/// what it needs exits a few times, as in Kubernetes, and then comes up).
const CRASH_LOOP_EXITS: u32 = 6;

/// One container run of this test at a time: each brings a dozen up.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
/// The images this run built, once per test binary.
static IMAGES: tokio::sync::OnceCell<(String, String)> = tokio::sync::OnceCell::const_new();

async fn images() -> &'static (String, String) {
    IMAGES
        .get_or_init(|| async {
            require_engine_and_images();
            let context = tempfile::tempdir().unwrap();
            tokio::task::spawn_blocking(move || build_images(context.path()))
                .await
                .unwrap()
        })
        .await
}

/// `deploy/k8s` rendered with freshly generated secrets.
fn render() -> String {
    let dir = tempfile::tempdir().unwrap();
    copy_tree(&deploy_dir().join("k8s"), dir.path());
    for name in ["database.env", "nats-passwords.env", "catalog-memory.env"] {
        let _ = std::fs::remove_file(dir.path().join(name));
    }
    run(Command::new("bash")
        .arg(dir.path().join("generate-secrets.sh"))
        .arg(dir.path()));
    run(Command::new(tool("kubectl"))
        .arg("kustomize")
        .arg(dir.path()))
}

/// The local image standing in for a manifest's image name.
fn stand_in(image: &str, mcp: &str) -> String {
    let name = image.split(':').next().unwrap_or(image);
    match name.rsplit('/').next().unwrap_or(name) {
        "nats" => NATS_IMAGE.to_owned(),
        "postgres" => POSTGRES_IMAGE.to_owned(),
        // The base's one image: every binary, the test MCP server included.
        "ctxsync" => mcp.to_owned(),
        other => panic!("no local stand-in for the image {image} ({other})"),
    }
}

fn docker_units(quantity: &str) -> String {
    for (suffix, unit) in [
        ("Gi", "g"),
        ("Mi", "m"),
        ("Ki", "k"),
        ("G", "g"),
        ("M", "m"),
    ] {
        if let Some(number) = quantity.strip_suffix(suffix) {
            return format!("{number}{unit}");
        }
    }
    quantity.to_owned()
}

fn cpus(quantity: &str) -> String {
    match quantity.strip_suffix('m') {
        Some(milli) => format!("{}", milli.parse::<f64>().unwrap() / 1000.0),
        None => quantity.to_owned(),
    }
}

#[derive(Debug, Default, Clone)]
struct PodState {
    container: String,
    ip: Option<IpAddr>,
    ready: bool,
    /// Ready at least once since (re)start.
    ever_ready: bool,
    terminating: bool,
    restarts: u32,
    exits_before_ready: u32,
    readiness_failures_in_row: u32,
    liveness_failures_in_row: u32,
    last_problem: String,
    started_at: Option<Instant>,
    /// When the kubelet saw the container exited (it restarts after a back-off).
    exited_at: Option<Instant>,
    last_readiness: Option<Instant>,
    last_liveness: Option<Instant>,
}

struct Pod {
    plan: PodPlan,
    state: PodState,
}

/// The pods of one run, their network and volumes; removed when dropped.
struct Cluster {
    id: String,
    network: String,
    namespace: String,
    files: tempfile::TempDir,
    services: Vec<ServicePlan>,
    mcp_image: String,
    pods: Mutex<BTreeMap<String, Pod>>,
    volumes: Mutex<Vec<String>>,
    http: reqwest::Client,
    /// Pods started in all, replacements included.
    started: std::sync::atomic::AtomicUsize,
    /// Containers restarted in all (exits and failed liveness).
    restarts: std::sync::atomic::AtomicU32,
    probes_passed: std::sync::atomic::AtomicU64,
}

impl Cluster {
    fn new(objects: &[serde_norway::Value], mcp_image: &str) -> Arc<Self> {
        let id = format!("mdt-{}", testkit::unique_prefix());
        let network = format!("{id}-net");
        run(docker().args(["network", "create", &network]));
        let namespace = objects
            .iter()
            .find_map(|o| o["metadata"]["namespace"].as_str())
            .unwrap_or("default")
            .to_owned();
        Arc::new(Self {
            id,
            network,
            namespace,
            files: tempfile::tempdir().unwrap(),
            services: deploy_checks::pods::services(objects),
            mcp_image: mcp_image.to_owned(),
            pods: Mutex::new(BTreeMap::new()),
            volumes: Mutex::new(Vec::new()),
            started: std::sync::atomic::AtomicUsize::new(0),
            restarts: std::sync::atomic::AtomicU32::new(0),
            probes_passed: std::sync::atomic::AtomicU64::new(0),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap(),
        })
    }

    /// The DNS names `plan`'s pod answers to: its own, and every Service's
    /// that selects it (with the namespace's longer forms).
    fn aliases(&self, plan: &PodPlan) -> Vec<String> {
        let ns = &self.namespace;
        let mut names = Vec::new();
        for host in &plan.hostnames {
            names.push(host.clone());
            names.push(format!("{host}.{ns}.svc.cluster.local"));
        }
        for service in self.services.iter().filter(|s| s.selects(plan)) {
            let s = &service.name;
            names.extend([
                s.clone(),
                format!("{s}.{ns}"),
                format!("{s}.{ns}.svc"),
                format!("{s}.{ns}.svc.cluster.local"),
            ]);
        }
        names.sort();
        names.dedup();
        names
    }

    /// A named volume for a claim, made once, owned as the kubelet would
    /// leave it for the pod's fsGroup.
    fn claim_volume(&self, claim: &str, fs_group: Option<u64>) -> String {
        let volume = format!("{}-{claim}", self.id);
        let mut volumes = self.volumes.lock().unwrap();
        if !volumes.contains(&volume) {
            run(docker().args(["volume", "create", &volume]));
            if let Some(group) = fs_group {
                run(docker().args([
                    "run",
                    "--rm",
                    "--user",
                    "0",
                    "-v",
                    &format!("{volume}:/v"),
                    BASE_IMAGE,
                    "sh",
                    "-c",
                    &format!("chgrp {group} /v && chmod 2775 /v"),
                ]));
            }
            volumes.push(volume.clone());
        }
        volume
    }

    /// ConfigMap or Secret files on the host, as the kubelet projects them:
    /// the fsGroup's group may read them.
    fn project_files(
        &self,
        pod: &str,
        index: usize,
        files: &[(String, Vec<u8>, u32)],
        fs_group: Option<u64>,
    ) -> PathBuf {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = self.files.path().join(format!("{pod}-{index}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        for (name, bytes, mode) in files {
            let path = dir.join(name);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).unwrap();
            }
            std::fs::write(&path, bytes).unwrap();
            let mode = if fs_group.is_some() {
                mode | 0o040
            } else {
                *mode
            };
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            if let Some(group) = fs_group {
                std::os::unix::fs::chown(&path, Some(0), Some(group as u32)).unwrap();
            }
        }
        dir
    }

    /// Creates and starts `plan`'s container.
    fn start_pod(&self, plan: PodPlan) {
        let container = format!("{}-{}", self.id, plan.name);
        let mut args: Vec<String> = vec![
            "create".into(),
            "--name".into(),
            container.clone(),
            "--hostname".into(),
            plan.name.clone(),
            "--network".into(),
            self.network.clone(),
            "--label".into(),
            format!("ctxsync-mdt={}", self.id),
        ];
        for alias in self.aliases(&plan) {
            args.extend(["--network-alias".into(), alias]);
        }
        match (plan.run_as_user, plan.run_as_group) {
            (Some(user), Some(group)) => args.extend(["--user".into(), format!("{user}:{group}")]),
            (Some(user), None) => args.extend(["--user".into(), user.to_string()]),
            _ => {}
        }
        if let Some(group) = plan.fs_group {
            args.extend(["--group-add".into(), group.to_string()]);
        }
        if plan.read_only_root {
            args.push("--read-only".into());
        }
        if plan.no_new_privileges {
            args.extend(["--security-opt".into(), "no-new-privileges".into()]);
        }
        for cap in &plan.drop_capabilities {
            args.extend(["--cap-drop".into(), cap.clone()]);
        }
        for cap in &plan.add_capabilities {
            args.extend(["--cap-add".into(), cap.clone()]);
        }
        if let Some(memory) = &plan.memory_limit {
            args.extend(["--memory".into(), docker_units(memory)]);
        }
        if let Some(cpu) = &plan.cpu_limit {
            args.extend(["--cpus".into(), cpus(cpu)]);
        }
        for (
            index,
            Mount {
                path,
                read_only,
                source,
            },
        ) in plan.mounts.iter().enumerate()
        {
            let spec = match source {
                MountSource::Files(files) => {
                    let dir = self.project_files(&plan.name, index, files, plan.fs_group);
                    format!("type=bind,src={},dst={path},readonly", dir.display())
                }
                MountSource::EmptyDir => {
                    // As the kubelet makes one: a directory of the node,
                    // writable by the pod whatever its user.
                    use std::os::unix::fs::PermissionsExt as _;
                    let dir = self
                        .files
                        .path()
                        .join(format!("{}-{index}-empty", plan.name));
                    std::fs::create_dir_all(&dir).unwrap();
                    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
                    format!("type=bind,src={},dst={path}", dir.display())
                }
                MountSource::Claim(claim) => {
                    let volume = self.claim_volume(claim, plan.fs_group);
                    format!(
                        "type=volume,src={volume},dst={path}{}",
                        if *read_only { ",readonly" } else { "" }
                    )
                }
            };
            args.extend(["--mount".into(), spec]);
        }
        for (key, value) in &plan.env {
            args.extend(["--env".into(), format!("{key}={value}")]);
        }
        let image = stand_in(&plan.image, &self.mcp_image);
        let mut rest: Vec<String> = Vec::new();
        match &plan.command {
            Some(command) if !command.is_empty() => {
                args.extend(["--entrypoint".into(), command[0].clone()]);
                rest.extend(command[1..].iter().cloned());
            }
            _ => {}
        }
        rest.extend(plan.args.iter().flatten().cloned());
        args.push(image);
        args.extend(rest);
        run(docker().args(&args));
        run(docker().args(["start", &container]));
        self.started.fetch_add(1, Ordering::SeqCst);
        let state = PodState {
            container,
            started_at: Some(Instant::now()),
            ..Default::default()
        };
        self.pods
            .lock()
            .unwrap()
            .insert(plan.name.clone(), Pod { plan, state });
    }

    fn containers(&self) -> Vec<(String, String)> {
        self.pods
            .lock()
            .unwrap()
            .iter()
            .map(|(name, pod)| (name.clone(), pod.state.container.clone()))
            .collect()
    }

    /// One pass of the kubelet's work over every pod: container states and
    /// IPs, restarts of exited containers, due probes.
    async fn tick(&self) {
        let containers = self.containers();
        if containers.is_empty() {
            return;
        }
        let mut command = tokio::process::Command::new("docker");
        command.args([
            "inspect",
            "-f",
            "{{.Name}} {{.State.Status}} {{.State.ExitCode}} {{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}",
        ]);
        for (_, container) in &containers {
            command.arg(container);
        }
        let output = command.output().await.unwrap();
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        let mut statuses: BTreeMap<String, (String, i64, Option<IpAddr>)> = BTreeMap::new();
        for line in text.lines() {
            let mut words = line.split_whitespace();
            let (Some(name), Some(status), Some(code)) = (words.next(), words.next(), words.next())
            else {
                continue;
            };
            let ip = words.next().and_then(|ip| ip.parse().ok());
            statuses.insert(
                name.trim_start_matches('/').to_owned(),
                (status.to_owned(), code.parse().unwrap_or(-1), ip),
            );
        }
        for (pod_name, container) in containers {
            let Some((status, code, ip)) = statuses.get(&container).cloned() else {
                continue;
            };
            let (plan, state) = {
                let pods = self.pods.lock().unwrap();
                let Some(pod) = pods.get(&pod_name) else {
                    continue;
                };
                (pod.plan.clone(), pod.state.clone())
            };
            if state.terminating {
                continue;
            }
            if status != "running" {
                // restartPolicy Always: the kubelet starts it again, after a
                // back-off doubling from 1 s (the kubelet's starts at 10 s).
                let backoff = Duration::from_secs(1 << state.restarts.min(4));
                if state.exited_at.is_none_or(|at| at.elapsed() < backoff) {
                    if state.exited_at.is_none() {
                        self.pods
                            .lock()
                            .unwrap()
                            .get_mut(&pod_name)
                            .unwrap()
                            .state
                            .exited_at = Some(Instant::now());
                    }
                    continue;
                }
                let logs = tail_logs(&container, 15);
                let mut pods = self.pods.lock().unwrap();
                let pod = pods.get_mut(&pod_name).unwrap();
                pod.state.restarts += 1;
                self.restarts.fetch_add(1, Ordering::SeqCst);
                if !pod.state.ever_ready {
                    pod.state.exits_before_ready += 1;
                }
                pod.state.ready = false;
                pod.state.last_problem =
                    format!("container exited with code {code}; its last log lines:\n{logs}");
                pod.state.started_at = Some(Instant::now());
                pod.state.exited_at = None;
                pod.state.last_readiness = None;
                pod.state.last_liveness = None;
                drop(pods);
                let _ = Command::new("docker").args(["start", &container]).output();
                continue;
            }
            let now = Instant::now();
            let since_start = now - state.started_at.unwrap_or(now);
            let due = |probe: &Probe, last: Option<Instant>| {
                since_start >= Duration::from_secs(probe.initial_delay_seconds)
                    && last.is_none_or(|at| now - at >= Duration::from_secs(probe.period_seconds))
            };
            let mut readiness = None;
            if let Some(probe) = &plan.readiness
                && due(probe, state.last_readiness)
            {
                readiness = Some(self.probe(probe, ip, &container).await);
            }
            let mut liveness = None;
            if let Some(probe) = &plan.liveness
                && due(probe, state.last_liveness)
            {
                liveness = Some(self.probe(probe, ip, &container).await);
            }
            let mut restart = false;
            {
                let mut pods = self.pods.lock().unwrap();
                let Some(pod) = pods.get_mut(&pod_name) else {
                    continue;
                };
                pod.state.ip = ip;
                if plan.readiness.is_none() {
                    pod.state.ready = true;
                    pod.state.ever_ready = true;
                }
                if let Some(result) = readiness {
                    pod.state.last_readiness = Some(now);
                    match result {
                        Ok(()) => {
                            self.probes_passed.fetch_add(1, Ordering::SeqCst);
                            pod.state.readiness_failures_in_row = 0;
                            pod.state.ready = true;
                            pod.state.ever_ready = true;
                        }
                        Err(problem) => {
                            pod.state.readiness_failures_in_row += 1;
                            if pod.state.readiness_failures_in_row
                                >= plan.readiness.as_ref().unwrap().failure_threshold
                            {
                                pod.state.ready = false;
                            }
                            pod.state.last_problem = format!("readiness probe {problem}");
                        }
                    }
                }
                if let Some(result) = liveness {
                    pod.state.last_liveness = Some(now);
                    match result {
                        Ok(()) => {
                            self.probes_passed.fetch_add(1, Ordering::SeqCst);
                            pod.state.liveness_failures_in_row = 0;
                        }
                        Err(problem) => {
                            pod.state.liveness_failures_in_row += 1;
                            pod.state.last_problem = format!("liveness probe {problem}");
                            if pod.state.liveness_failures_in_row
                                >= plan.liveness.as_ref().unwrap().failure_threshold
                            {
                                restart = true;
                                pod.state.restarts += 1;
                                self.restarts.fetch_add(1, Ordering::SeqCst);
                                pod.state.liveness_failures_in_row = 0;
                                pod.state.ready = false;
                                pod.state.started_at = Some(Instant::now());
                                pod.state.last_readiness = None;
                                pod.state.last_liveness = None;
                            }
                        }
                    }
                }
            }
            if restart {
                let _ = Command::new("docker")
                    .args([
                        "restart",
                        "-t",
                        &plan.termination_grace_seconds.to_string(),
                        &container,
                    ])
                    .output();
            }
        }
    }

    /// One probe of a pod: from the node to the pod's address (HTTP), or
    /// inside its container (exec); the error says what failed.
    async fn probe(
        &self,
        probe: &Probe,
        ip: Option<IpAddr>,
        container: &str,
    ) -> Result<(), String> {
        let timeout = Duration::from_secs(probe.timeout_seconds.max(1));
        match &probe.action {
            ProbeAction::Http { path, port } => {
                let ip = ip.ok_or("the pod has no address yet")?;
                let url = format!("http://{ip}:{port}{path}");
                match self.http.get(&url).timeout(timeout).send().await {
                    Ok(response) if response.status().as_u16() < 400 => Ok(()),
                    Ok(response) => {
                        Err(format!("GET :{port}{path} answered {}", response.status()))
                    }
                    Err(error) => Err(format!("GET :{port}{path} failed: {error}")),
                }
            }
            ProbeAction::Exec(command) => {
                let output = tokio::time::timeout(
                    timeout + Duration::from_secs(5),
                    tokio::process::Command::new("docker")
                        .arg("exec")
                        .arg(container)
                        .args(command)
                        .output(),
                )
                .await;
                match output {
                    Ok(Ok(out)) if out.status.success() => Ok(()),
                    Ok(Ok(out)) => Err(format!(
                        "exec {command:?} exited {}: {}",
                        out.status,
                        String::from_utf8_lossy(&out.stderr).trim()
                    )),
                    Ok(Err(error)) => Err(format!("exec {command:?}: {error}")),
                    Err(_) => Err(format!("exec {command:?} timed out")),
                }
            }
        }
    }

    /// Runs the kubelet's passes until [`Running::down`].
    fn spawn_kubelet(self: &Arc<Self>) -> (Arc<AtomicBool>, tokio::task::JoinHandle<()>) {
        let stop = Arc::new(AtomicBool::new(false));
        let cluster = self.clone();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            while !stopped.load(Ordering::SeqCst) {
                cluster.tick().await;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
        (stop, task)
    }

    /// Waits until every pod is ready; fails naming each pod that is not
    /// (its last problem) when `within` passes or a pod crash-loops.
    async fn wait_ready(&self, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        loop {
            let (not_ready, looping): (Vec<String>, Vec<String>) = {
                let pods = self.pods.lock().unwrap();
                let describe = |(name, pod): (&String, &Pod)| {
                    format!(
                        "pod {name} ({}) not ready: {}",
                        pod.plan.workload, pod.state.last_problem
                    )
                };
                (
                    pods.iter()
                        .filter(|(_, p)| !p.state.ready && !p.state.terminating)
                        .map(describe)
                        .collect(),
                    pods.iter()
                        .filter(|(_, p)| p.state.exits_before_ready >= CRASH_LOOP_EXITS)
                        .map(describe)
                        .collect(),
                )
            };
            if not_ready.is_empty() {
                return Ok(());
            }
            if !looping.is_empty() {
                return Err(format!(
                    "crash loop ({CRASH_LOOP_EXITS} exits before ready):\n{}",
                    looping.join("\n")
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "not ready within {within:?}:\n{}",
                    not_ready.join("\n")
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The address of a ready, not terminating pod `service` selects, on
    /// `port` (the Service's): what kube-proxy would pick, round robin.
    fn endpoint(&self, service: &str, port: u16, turn: usize) -> Option<String> {
        let service = self.services.iter().find(|s| s.name == service)?;
        let pods = self.pods.lock().unwrap();
        let ready: Vec<String> = pods
            .values()
            .filter(|p| p.state.ready && !p.state.terminating && service.selects(&p.plan))
            .filter_map(|p| {
                let target = service.target_port(port, &p.plan).ok()?;
                Some(format!("{}:{target}", p.state.ip?))
            })
            .collect();
        (!ready.is_empty()).then(|| ready[turn % ready.len()].clone())
    }

    /// Pods running, probes passed in all, containers restarted in all.
    fn summary(&self) -> (usize, u64, u32) {
        (
            self.pods.lock().unwrap().len(),
            self.probes_passed.load(Ordering::SeqCst),
            self.restarts.load(Ordering::SeqCst),
        )
    }

    /// Stops `pod` as the kubelet does: out of the Service endpoints, its
    /// preStop hook, SIGTERM, SIGKILL once the grace is over.
    async fn terminate(&self, pod: &str) -> Terminated {
        let started = Instant::now();
        let (plan, container) = {
            let mut pods = self.pods.lock().unwrap();
            let pod = pods.get_mut(pod).expect("a running pod");
            pod.state.terminating = true;
            pod.state.ready = false;
            (pod.plan.clone(), pod.state.container.clone())
        };
        let grace = Duration::from_secs(plan.termination_grace_seconds);
        let mut hook_failure = None;
        let mut exited_in_hook = false;
        match &plan.pre_stop {
            Some(Hook::Sleep(seconds)) => tokio::time::sleep(Duration::from_secs(*seconds)).await,
            Some(Hook::Exec(command)) => {
                // The hook ends when it does, or when the container stops.
                let hook = tokio::process::Command::new("docker")
                    .arg("exec")
                    .arg(&container)
                    .args(command)
                    .output();
                let outcome = tokio::time::timeout(grace, hook).await;
                // A hook killed with its container (its main process
                // exited) returns a moment before the engine says so.
                let mut running = true;
                for _ in 0..20 {
                    running = tokio::process::Command::new("docker")
                        .args(["inspect", "-f", "{{.State.Running}}", &container])
                        .output()
                        .await
                        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "true")
                        .unwrap_or(false);
                    if !running {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                exited_in_hook = !running;
                match outcome {
                    // A hook cut short by its container's own exit did its work.
                    Ok(Ok(out)) if !out.status.success() && running => {
                        hook_failure = Some(format!(
                            "preStop {command:?} of {pod} failed ({}): {}",
                            out.status,
                            String::from_utf8_lossy(&out.stderr).trim()
                        ));
                    }
                    Ok(Err(error)) => hook_failure = Some(format!("preStop of {pod}: {error}")),
                    _ => {}
                }
            }
            None => {}
        }
        let left = grace.saturating_sub(started.elapsed()).as_secs().max(1);
        let _ = tokio::process::Command::new("docker")
            .args(["stop", "-t", &left.to_string(), &container])
            .output()
            .await;
        let _ = tokio::process::Command::new("docker")
            .args(["rm", "-f", &container])
            .output()
            .await;
        self.pods.lock().unwrap().remove(pod);
        Terminated {
            took: started.elapsed(),
            hook_failure,
            exited_in_hook,
        }
    }
}

/// How a pod's termination went.
struct Terminated {
    took: Duration,
    hook_failure: Option<String>,
    /// The container exited by itself during its preStop (NATS's lame duck ends so).
    exited_in_hook: bool,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for (name, container) in self.containers() {
                eprintln!("--- {name}:\n{}", tail_logs(&container, 30));
            }
        }
        let _ = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "docker ps -aq --filter label=ctxsync-mdt={} | xargs -r docker rm -f",
                self.id
            ))
            .output();
        let _ = docker().args(["network", "rm", &self.network]).output();
        for volume in self.volumes.lock().unwrap().iter() {
            let _ = docker().args(["volume", "rm", "-f", volume]).output();
        }
    }
}

fn tail_logs(container: &str, lines: usize) -> String {
    Command::new("docker")
        .args(["logs", "--tail", &lines.to_string(), container])
        .output()
        .map(|o| {
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        })
        .unwrap_or_default()
}

/// A cluster with its kubelet running.
struct Running {
    cluster: Arc<Cluster>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Stops the kubelet, then removes every container, the network and the volumes.
    async fn down(self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.task.await;
        drop(self.cluster);
    }
}

/// A rendered run: the objects, the pods started from them (only those of
/// `workloads` when given), all ready.
async fn bring_up(
    rendered: &str,
    workloads: Option<&[&str]>,
    within: Duration,
) -> Result<(Running, Vec<serde_norway::Value>), String> {
    let (_, mcp) = images().await;
    let objects = yaml_documents(rendered);
    let plans = deploy_checks::pods::pods(&objects)?;
    let cluster = Cluster::new(&objects, mcp);
    for plan in plans {
        if workloads.is_some_and(|only| !only.contains(&plan.workload.as_str())) {
            continue;
        }
        cluster.start_pod(plan);
    }
    let (stop, task) = cluster.spawn_kubelet();
    let running = Running {
        cluster: cluster.clone(),
        stop,
        task,
    };
    drop(cluster);
    match running.cluster.wait_ready(within).await {
        Ok(()) => Ok((running, objects)),
        Err(error) => {
            running.down().await;
            Err(error)
        }
    }
}

fn secret_value(objects: &[serde_norway::Value], base: &str, key: &str) -> String {
    use base64::Engine as _;
    let secret = objects
        .iter()
        .find(|o| {
            o["kind"] == "Secret"
                && o["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with(&format!("{base}-")))
        })
        .unwrap_or_else(|| panic!("no Secret {base}"));
    let encoded = secret["data"][key].as_str().unwrap();
    String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .unwrap(),
    )
    .unwrap()
}

/// The operator CLI on the host, as `ctxsync-cli`, against a NATS pod.
fn ctxsync(nats: &str, password: &str, args: &[&str]) -> String {
    run(
        Command::new(testkit::workspace_binary("ctxsync-cli", "ctxsync"))
            .args(args)
            .env("NATS_URL", format!("nats://ctxsync-cli:{password}@{nats}"))
            .env("CTXSYNC_SUBJECT_PREFIX", "ctxsync"),
    )
}

async fn first_turn(
    http: &reqwest::Client,
    gate: &str,
    key: &str,
    chat: &str,
    agent: &str,
) -> Result<Value, String> {
    let response = http
        .post(format!("http://{gate}/api/v1/gate"))
        // As an in-cluster chat backend calls it: by the Service's name.
        .header("host", "chat-gate")
        .bearer_auth(key)
        .json(&json!({"chat_id": chat, "agent_id": agent, "first_turn": true}))
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .map_err(|e| format!("POST {gate}: {e}"))?;
    let status = response.status();
    let body: Value = response.json().await.map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("{status}: {body}"));
    }
    Ok(body)
}

/// What the load saw while every pod was replaced.
#[derive(Default)]
struct Rolling {
    turns: u64,
    failures: Vec<String>,
    waits: u64,
    waits_ready: u64,
    /// Completing pushes acked; agents whose latest acked state a later
    /// turn shows, of those checked (every agent that completed).
    acked: u64,
    stored: u64,
    checked: u64,
    catalog_starts: f64,
    /// Where the replaced catalogs started servers: their handshake series
    /// and what they logged of their memory and discoveries.
    catalog_starts_seen: String,
    replaced: usize,
    /// Seconds each NATS pod took to leave (its lame duck).
    lame_duck: Vec<u64>,
    /// Of `failures`, the continuous first turns'.
    turns_failed: usize,
}

/// A registered agent the load drives: id and token.
struct AgentKey {
    id: String,
    token: String,
}

/// What an agent sends: its Startup, or a push.
enum Report<'a> {
    Startup,
    /// Each attempt after the first goes out at the next version, as the
    /// workspace agent numbers its retries: an attempt whose push was
    /// stored but whose answer was lost (a pod replaced mid-request) would
    /// otherwise make the retry a stale version. Left at the version that
    /// was accepted.
    Push(&'a mut ctxsync_proto::v1::PushContextStateRequest),
}

/// Sends `report` as `agent`'s run `run_id` through any ready agent-ingest
/// pod, retrying (as an agent does) until accepted or `within` passes.
async fn send_until_accepted(
    cluster: &Cluster,
    agent: &AgentKey,
    run_id: &str,
    mut report: Report<'_>,
    within: Duration,
) -> Result<(), String> {
    let deadline = Instant::now() + within;
    let mut attempt = 0;
    let mut sent_before = false;
    let mut earlier = Vec::new();
    loop {
        attempt += 1;
        let last = match cluster.endpoint("agent-ingest", 8080, attempt) {
            None => "no ready agent-ingest pod".to_owned(),
            Some(ingest) => {
                let mut client =
                    FakeAgent::with_token(&format!("http://{ingest}"), &agent.id, &agent.token);
                client.set_run_id(run_id);
                let answer = match &mut report {
                    Report::Startup => client.startup().await.answer.clone(),
                    Report::Push(push) => {
                        if sent_before {
                            push.version += 1;
                        }
                        client.push(push).await.answer.clone()
                    }
                };
                sent_before = true;
                if answer.is_accepted() {
                    if !earlier.is_empty() {
                        // Visible in the log, not a failure: an agent retries.
                        eprintln!("MANIFEST-RETRIED {run_id} accepted after {earlier:?}");
                    }
                    return Ok(());
                }
                format!("{answer:?}")
            }
        };
        if Instant::now() > deadline {
            return Err(format!(
                "not accepted within {within:?}: {last} (earlier attempts: {earlier:?})"
            ));
        }
        if earlier.last() != Some(&last) {
            earlier.push(last);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Every Deployment's pods replaced one at a time as a rolling update does
/// (a new pod ready before an old one is stopped), then the NATS pods one
/// at a time (stopped with their lame-duck preStop, then started again on
/// their claims), while first turns are asked continuously and chats wait
/// on agents whose discovery completes meanwhile.
async fn rolling_restarts(
    cluster: &Arc<Cluster>,
    objects: &[serde_norway::Value],
    key: &str,
    (complete_agent, its_tools): (&str, &[String]),
    cli_password: &str,
) -> Rolling {
    let stop = Arc::new(AtomicBool::new(false));
    // Agents for the waiting chats, registered before anything restarts.
    let nats = cluster.endpoint("nats", 4222, 0).unwrap();
    let agents: Vec<AgentKey> = (0..20)
        .map(|i| {
            let dir = tempfile::tempdir().unwrap();
            let file = dir.path().join("token");
            let registered: Value = serde_json::from_str(&ctxsync(
                &nats,
                cli_password,
                &[
                    "agent",
                    "register",
                    "--tenant=demo",
                    "--workspace=demo",
                    &format!("--name=waiting-{i}"),
                    &format!("--token-file={}", file.display()),
                    "--json",
                ],
            ))
            .unwrap();
            AgentKey {
                id: registered["agent_id"].as_str().unwrap().to_owned(),
                token: std::fs::read_to_string(&file).unwrap(),
            }
        })
        .collect();

    // First turns, one after another, for the agent whose discovery is complete.
    let turns = tokio::spawn({
        let (cluster, stop, key, agent, tools) = (
            cluster.clone(),
            stop.clone(),
            key.to_owned(),
            complete_agent.to_owned(),
            its_tools.to_vec(),
        );
        async move {
            let http = reqwest::Client::new();
            let (mut asked, mut failures) = (0u64, Vec::new());
            while !stop.load(Ordering::SeqCst) {
                asked += 1;
                let chat = format!("rolling-{asked}");
                let outcome = match cluster.endpoint("chat-gate", 8080, asked as usize) {
                    None => Err("no ready chat-gate pod".to_owned()),
                    Some(gate) => first_turn(&http, &gate, &key, &chat, &agent).await,
                };
                let problem = match outcome {
                    Err(error) => Some(error),
                    Ok(answer)
                        if answer["decision"] != "GATE_DECISION_READY"
                            || tool_names(&answer) != tools
                            || answer["projection"]["catalog"]["pins"][0]["server_id"]
                                != "fixture" =>
                    {
                        Some(answer.to_string())
                    }
                    Ok(_) => None,
                };
                if let Some(problem) = problem {
                    failures.push(format!("{chat}: {problem}"));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (asked, failures)
        }
    });

    // Chats that wait on an agent until its discovery completes.
    let waits = tokio::spawn({
        let (cluster, stop, key) = (cluster.clone(), stop.clone(), key.to_owned());
        async move {
            let http = reqwest::Client::new();
            let mut out = (0u64, 0u64, 0u64, Vec::new(), Vec::new());
            // Round the agents, each round a new process (run id) of each:
            // every Startup makes its discovery pending again.
            let mut latest: BTreeMap<String, String> = BTreeMap::new();
            for n in 0.. {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let agent = &agents[n % agents.len()];
                let run_id = format!("run-{n}-{}", testkit::unique_prefix());
                let sent = send_until_accepted(
                    &cluster,
                    agent,
                    &run_id,
                    Report::Startup,
                    Duration::from_secs(60),
                )
                .await;
                if let Err(e) = sent {
                    out.3.push(format!("startup of {}: {e}", agent.id));
                    continue;
                }
                let mut pending = testkit::report::pending(&run_id, 1, vec![]);
                let sent = send_until_accepted(
                    &cluster,
                    agent,
                    &run_id,
                    Report::Push(&mut pending),
                    Duration::from_secs(60),
                )
                .await;
                if let Err(e) = sent {
                    out.3.push(format!("pending push of {}: {e}", agent.id));
                    continue;
                }
                let tool = format!("t{n}");
                let chat = tokio::spawn({
                    let (cluster, http, key, id) =
                        (cluster.clone(), http.clone(), key.clone(), agent.id.clone());
                    async move {
                        let gate = cluster
                            .endpoint("chat-gate", 8080, n)
                            .ok_or("no ready chat-gate pod")?;
                        first_turn(&http, &gate, &key, &format!("waiting-{n}"), &id).await
                    }
                });
                // The chat asks while discovery is pending; it completes a moment later.
                tokio::time::sleep(Duration::from_millis(500)).await;
                let mut completing =
                    complete(&run_id, pending.version + 1, vec![server("w", &[&tool])]);
                let sent = send_until_accepted(
                    &cluster,
                    agent,
                    &run_id,
                    Report::Push(&mut completing),
                    Duration::from_secs(60),
                )
                .await;
                match sent {
                    Ok(()) => {
                        out.2 += 1;
                        latest.insert(agent.id.clone(), format!("w__{tool}"));
                    }
                    Err(e) => out.3.push(format!("complete push of {}: {e}", agent.id)),
                }
                out.0 += 1;
                match chat.await.unwrap() {
                    Ok(answer)
                        if answer["decision"] == "GATE_DECISION_READY"
                            && tool_names(&answer) == [format!("w__{tool}")] =>
                    {
                        out.1 += 1;
                    }
                    other => out.3.push(format!("waiting chat {n}: {other:?}")),
                }
            }
            out.4 = latest.into_iter().collect();
            out
        }
    });

    let mut replaced = 0;
    let mut hook_failures = Vec::new();
    let mut lame_duck = Vec::new();
    for workload in [
        "Deployment/snapshot-store",
        "Deployment/agent-ingest",
        "Deployment/chat-gate",
        "Deployment/catalog",
    ] {
        let name = workload.split_once('/').unwrap().1;
        let old: Vec<String> = {
            let pods = cluster.pods.lock().unwrap();
            pods.values()
                .filter(|p| p.plan.workload == workload)
                .map(|p| p.plan.name.clone())
                .collect()
        };
        for (i, old_pod) in old.iter().enumerate() {
            // maxSurge 1, maxUnavailable 0: the new pod ready first.
            let new_pod = format!("{name}-r{i}");
            cluster.start_pod(deploy_checks::pods::pod_of(objects, workload, &new_pod).unwrap());
            cluster
                .wait_ready(Duration::from_secs(120))
                .await
                .unwrap_or_else(|e| panic!("the replacement {new_pod}: {e}"));
            let terminated = cluster.terminate(old_pod).await;
            hook_failures.extend(terminated.hook_failure);
            replaced += 1;
        }
    }
    // The StatefulSet's update: highest ordinal first, each pod stopped
    // (lame duck) and started again under its name, on its claim.
    for ordinal in (0..3).rev() {
        let pod = format!("nats-{ordinal}");
        let terminated = cluster.terminate(&pod).await;
        hook_failures.extend(terminated.hook_failure);
        if !terminated.exited_in_hook {
            hook_failures.push(format!(
                "{pod} did not leave in lame-duck mode during its preStop"
            ));
        }
        lame_duck.push(terminated.took.as_secs());
        cluster.start_pod(deploy_checks::pods::pod_of(objects, "StatefulSet/nats", &pod).unwrap());
        cluster
            .wait_ready(Duration::from_secs(120))
            .await
            .unwrap_or_else(|e| panic!("{pod} again: {e}"));
        replaced += 1;
    }
    // A little load on the replaced cluster, then the counts.
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::SeqCst);
    let (turns, mut failures) = turns.await.unwrap();
    let turns_failed = failures.len();
    let (waits, waits_ready, acked, wait_failures, completed) = waits.await.unwrap();
    failures.extend(wait_failures);
    failures.extend(hook_failures);

    // Every agent whose discovery completed: its tools are stored.
    let http = reqwest::Client::new();
    let mut stored = 0;
    for (n, (agent, tool)) in completed.iter().enumerate() {
        let gate = cluster.endpoint("chat-gate", 8080, n).unwrap();
        match first_turn(&http, &gate, key, &format!("check-{n}"), agent).await {
            Ok(answer) if tool_names(&answer) == [tool.clone()] => stored += 1,
            other => failures.push(format!("stored state of {agent}: {other:?}")),
        }
    }
    let (catalog_starts, catalog_starts_seen) = {
        let catalogs: Vec<(String, String)> = {
            let pods = cluster.pods.lock().unwrap();
            pods.values()
                .filter(|p| p.plan.workload == "Deployment/catalog")
                .filter_map(|p| Some((format!("{}:8080", p.state.ip?), p.state.container.clone())))
                .collect()
        };
        let (mut starts, mut seen) = (0.0, String::new());
        for (catalog, container) in catalogs {
            let text = http
                .get(format!("http://{catalog}/metrics"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            let handshakes: Vec<&str> = text
                .lines()
                .filter(|l| l.starts_with("ctxsync_catalog_handshake_seconds_count"))
                .collect();
            let here = handshakes
                .iter()
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>();
            if here > 0.0 {
                let logged: Vec<String> = tail_logs(&container, 400)
                    .lines()
                    .filter(|l| l.contains("memory") || l.contains("discover"))
                    .map(str::to_owned)
                    .collect();
                seen.push_str(&format!(
                    "\n{container}: {}\n  {}",
                    handshakes.join("; "),
                    logged.join("\n  ")
                ));
            }
            starts += here;
        }
        (starts, seen)
    };
    Rolling {
        turns,
        failures,
        waits,
        waits_ready,
        acked,
        stored,
        checked: completed.len() as u64,
        catalog_starts,
        catalog_starts_seen,
        replaced,
        lame_duck,
        turns_failed,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a few minutes of containers: .ci/run runs it with its summary (README, Test)"]
async fn the_rendered_manifests_run_in_containers_and_no_chat_notices_a_rolling_restart() {
    let _serial = SERIAL.lock().await;
    testkit::init_logs();
    let started = Instant::now();
    let rendered = render();
    let (running, objects) = bring_up(&rendered, None, Duration::from_secs(240))
        .await
        .unwrap_or_else(|e| panic!("the manifests' pods: {e}"));
    let cluster = running.cluster.clone();
    let up = started.elapsed();
    let (pods, _, startup_restarts) = cluster.summary();
    assert_eq!(pods, 12, "3 NATS nodes, Postgres, two of each service");

    let nats = cluster.endpoint("nats", 4222, 0).expect("a ready NATS pod");
    let cli_password = secret_value(&objects, "nats-passwords", "NATS_PASSWORD_CTXSYNC_CLI");
    let key: Value = serde_json::from_str(&ctxsync(
        &nats,
        &cli_password,
        &["tenant", "key", "create", "--tenant", "demo", "--json"],
    ))
    .unwrap();
    let key = key["key"].as_str().unwrap().to_owned();
    let token_dir = tempfile::tempdir().unwrap();
    let token_file = token_dir.path().join("token");
    let registered: Value = serde_json::from_str(&ctxsync(
        &nats,
        &cli_password,
        &[
            "agent",
            "register",
            "--tenant=demo",
            "--workspace=demo",
            "--name=manifest-test",
            &format!("--token-file={}", token_file.display()),
            "--json",
        ],
    ))
    .unwrap();
    let agent_id = registered["agent_id"].as_str().unwrap().to_owned();

    // The demo workspace's agent in a container beside the pods, reaching
    // agent-ingest as an in-cluster agent does: by its Service's name.
    std::os::unix::fs::chown(&token_file, Some(10001), Some(10001)).unwrap();
    let workspace = deploy_dir().join("demo/workspace");
    let agent_container = format!("{}-workspace-agent", cluster.id);
    run(docker().args([
        "run",
        "-d",
        "--name",
        &agent_container,
        "--label",
        &format!("ctxsync-mdt={}", cluster.id),
        "--network",
        &cluster.network,
        "--user",
        "10001:10001",
        "--read-only",
        "--mount",
        "type=tmpfs,dst=/tmp",
        "--mount",
        &format!(
            "type=bind,src={},dst=/workspace,readonly",
            workspace.display()
        ),
        "--mount",
        &format!(
            "type=bind,src={},dst=/run/ctxsync/agent-token,readonly",
            token_file.display()
        ),
        "--env",
        "CTXSYNC_INGEST_URL=http://agent-ingest:8080",
        "--env",
        "CTXSYNC_AGENT_TOKEN_FILE=/run/ctxsync/agent-token",
        "--env",
        "CTXSYNC_WORKDIR=/workspace",
        "--env",
        "CTXSYNC_HTTP_ADDR=0.0.0.0:8080",
        "--env",
        "HOME=/tmp",
        &cluster.mcp_image,
        "workspace-agent",
    ]));

    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(90);
    let answer = loop {
        let gate = cluster
            .endpoint("chat-gate", 8080, 0)
            .expect("a ready chat-gate pod");
        let answer = first_turn(&http, &gate, &key, "manifest-chat", &agent_id).await;
        if let Ok(answer) = &answer
            && answer["decision"] == "GATE_DECISION_READY"
        {
            break answer.clone();
        }
        assert!(
            Instant::now() < deadline,
            "the workspace agent's report made no first turn ready: {answer:?}\n{}",
            tail_logs(&agent_container, 20)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let tools = tool_names(&answer);
    assert!(tools.contains(&"fixture__echo".to_owned()), "{answer}");
    let catalog = &answer["projection"]["catalog"];
    assert_eq!(catalog["status"], "STATUS_READY", "{catalog}");
    assert_eq!(catalog["pins"][0]["server_id"], "fixture", "{catalog}");

    let rolling =
        rolling_restarts(&cluster, &objects, &key, (&agent_id, &tools), &cli_password).await;
    let (_, probes, restarts) = cluster.summary();
    let started_pods = cluster.started.load(Ordering::SeqCst);
    println!(
        "MANIFEST-DRIVEN-SUMMARY pods_started={started_pods} probes_passed={probes} \
         restarts_while_starting={startup_restarts} restarts_after_ready={} \
         turns_during_rolling_restarts={} turns_failed={} waiting_chats={} waiting_chats_ready={} \
         completing_pushes_acked={} agents_checked={} agents_latest_ack_stored={} replaced_catalog_server_starts={} pods_replaced={} nats_lame_duck_s={:?} up_s={} total_s={}",
        restarts - startup_restarts,
        rolling.turns,
        rolling.turns_failed,
        rolling.waits,
        rolling.waits_ready,
        rolling.acked,
        rolling.checked,
        rolling.stored,
        rolling.catalog_starts,
        rolling.replaced,
        rolling.lame_duck,
        up.as_secs(),
        started.elapsed().as_secs()
    );
    assert!(
        rolling.failures.is_empty(),
        "failed first turns: {:#?}",
        rolling.failures
    );
    assert!(rolling.turns > 0 && rolling.waits > 0, "the load ran");
    assert_eq!(
        rolling.waits_ready, rolling.waits,
        "every waiting chat was answered ready"
    );
    assert_eq!(
        rolling.stored, rolling.checked,
        "every agent's latest acked push is stored"
    );
    assert_eq!(
        rolling.catalog_starts, 0.0,
        "replaced catalogs pin from the bucket; where they started servers:{}",
        rolling.catalog_starts_seen
    );
    assert_eq!(
        restarts, startup_restarts,
        "no container exited or failed liveness once ready"
    );
    drop(cluster);
    running.down().await;
}

/// One thing broken in a copy of the rendered manifests: the run fails,
/// and its error names what broke.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a few minutes of containers: .ci/run runs it (README, Test)"]
async fn a_manifest_broken_in_one_place_fails_the_run_naming_it() {
    let _serial = SERIAL.lock().await;
    testkit::init_logs();
    let rendered = render();
    let catalog_only: &[&str] = &[
        "StatefulSet/nats",
        "StatefulSet/postgres",
        "Deployment/catalog",
    ];
    // Each: the catalog Deployment's text, what replaces it, what the error names.
    let mutations = [
        (
            "- name: CTXSYNC_CATALOG_CONFIG\n",
            "- name: CTXSYNC_CATALOG_CONFIGURATION\n",
            "CTXSYNC_CATALOG_CONFIG",
        ),
        (
            "mountPath: /etc/ctxsync\n",
            "mountPath: /etc/ctxsync-elsewhere\n",
            "/etc/ctxsync/catalog.yaml",
        ),
        (
            "path: /readyz\n            port: http",
            "path: /readyz\n            port: 8081",
            ":8081/readyz",
        ),
    ];
    match bring_up(&rendered, Some(catalog_only), Duration::from_secs(120)).await {
        Ok((running, _)) => running.down().await,
        Err(error) => panic!("the intact manifests run: {error}"),
    }
    // The catalog Deployment's document, where each mutation is made.
    let documents: Vec<&str> = rendered.split("\n---\n").collect();
    let catalog = documents
        .iter()
        .position(|d| d.contains("kind: Deployment") && d.contains("\n  name: catalog\n"))
        .expect("the rendered catalog Deployment");
    for (from, to, named) in mutations {
        let mut broken = documents.clone();
        assert!(
            broken[catalog].contains(from),
            "the rendered catalog Deployment has {from:?}"
        );
        let document = broken[catalog].replacen(from, to, 1);
        broken[catalog] = &document;
        let broken = broken.join("\n---\n");
        let error = match bring_up(&broken, Some(catalog_only), Duration::from_secs(45)).await {
            Ok((running, _)) => {
                running.down().await;
                panic!("a run with {from:?} made {to:?} succeeded")
            }
            Err(error) => error,
        };
        eprintln!(
            "MANIFEST-MUTATION {to:?}: {}",
            error.lines().take(3).collect::<Vec<_>>().join(" | ")
        );
        assert!(
            error.contains("catalog"),
            "the error names the catalog's pod: {error}"
        );
        assert!(error.contains(named), "the error names {named}: {error}");
    }
}
