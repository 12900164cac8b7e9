//! The services under measurement, however they run: in the bench's process
//! (`single`, as `ctxsync up` runs them) or each as its own process, two
//! replicas each (`deployed`, as Kubernetes runs them). What the sections
//! ask of them (chats waiting in the gates, the gates' memory, where
//! agent-ingest listens, the metric families) is answered either way.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use ctxsync_stack::{Service, Stack, StackBuilder};
use tokio::process::{Child, Command};

use crate::steps::{BenchError, Step};

/// Replicas of each service in deployed mode.
pub const REPLICAS: usize = 2;

/// Bound of a service process's start.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// The service's Kubernetes manifest (`deploy/k8s`), built in.
fn manifest(service: Service) -> &'static str {
    match service {
        Service::Store => include_str!("../../../deploy/k8s/snapshot-store.yaml"),
        Service::Ingest => include_str!("../../../deploy/k8s/agent-ingest.yaml"),
        Service::Gate => include_str!("../../../deploy/k8s/chat-gate.yaml"),
        Service::Catalog => include_str!("../../../deploy/k8s/catalog.yaml"),
    }
}

/// The CPU limit of container `name` in a Deployment of `manifest`, in
/// whole CPUs as a cgroup quota reads (quota over period, rounded down, at
/// least 1); `None` without one.
fn cpu_limit(manifest: &str, name: &str) -> Option<usize> {
    use serde::Deserialize as _;
    serde_norway::Deserializer::from_str(manifest)
        .filter_map(|document| serde_norway::Value::deserialize(document).ok())
        .filter(|document| document["kind"].as_str() == Some("Deployment"))
        .flat_map(|document| {
            document["spec"]["template"]["spec"]["containers"]
                .as_sequence()
                .cloned()
                .unwrap_or_default()
        })
        .find(|container| container["name"].as_str() == Some(name))
        .and_then(|container| {
            let cpu = &container["resources"]["limits"]["cpu"];
            let millis = match cpu.as_str() {
                Some(text) => match text.strip_suffix('m') {
                    Some(millis) => millis.parse::<f64>().ok()?,
                    None => text.parse::<f64>().ok()? * 1000.0,
                },
                None => cpu.as_f64()? * 1000.0,
            };
            Some(((millis / 1000.0).floor() as usize).max(1))
        })
}

/// The worker threads `service` runs with as deployed: tokio sizes its
/// runtime from the CPUs the process may use, and in Kubernetes that is
/// its manifest's CPU limit (the cgroup's quota), never more than the
/// machine's CPUs. Unlimited processes on a shared machine would each
/// start a thread per CPU instead, which no replica in the cluster has.
pub fn worker_threads(service: Service) -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    cpu_limit(manifest(service), service.name()).map_or(cpus, |limit| limit.min(cpus))
}

pub enum Services {
    InProcess(Stack),
    Deployed(Deployed),
}

/// The service processes of a deployed run.
pub struct Deployed {
    processes: Vec<Running>,
    http: reqwest::Client,
}

struct Running {
    service: Service,
    http_addr: SocketAddr,
    child: Child,
}

impl Services {
    /// Where agent-ingest listens (every replica).
    pub fn ingest_addrs(&self) -> Vec<SocketAddr> {
        match self {
            Self::InProcess(stack) => vec![stack.ingest().http_addr()],
            Self::Deployed(deployed) => deployed.addrs(Service::Ingest),
        }
    }

    /// Chats held waiting now, over every gate.
    pub async fn gate_waiters(&self) -> usize {
        match self {
            Self::InProcess(stack) => stack.gate().gate().waiters_held(),
            Self::Deployed(deployed) => deployed.gauge(Service::Gate, "ctxsync_gate_waiters").await,
        }
    }

    /// Agents the gates keep a view of, over every gate.
    pub async fn gate_views(&self) -> usize {
        match self {
            Self::InProcess(stack) => stack.gate().gate().watches().len(),
            Self::Deployed(deployed) => deployed.gauge(Service::Gate, "ctxsync_gate_views").await,
        }
    }

    /// Resident memory of what holds the waiting chats: the bench's process
    /// (services in it), or the gate processes together.
    pub fn gate_rss(&self) -> Option<u64> {
        match self {
            Self::InProcess(_) => rss_of("self"),
            Self::Deployed(deployed) => deployed
                .processes
                .iter()
                .filter(|p| p.service == Service::Gate)
                .map(|p| p.child.id().and_then(|pid| rss_of(&pid.to_string())))
                .sum(),
        }
    }

    /// The `/metrics` text the services render (deployed: every process's).
    pub async fn metrics_text(&self) -> String {
        match self {
            Self::InProcess(_) => ctxsync_runtime::metrics::handle().render(),
            Self::Deployed(deployed) => deployed.metrics_text().await,
        }
    }

    pub fn is_deployed(&self) -> bool {
        matches!(self, Self::Deployed(_))
    }

    pub fn describe(&self) -> String {
        match self {
            Self::InProcess(_) => "single: every service in the bench's process".into(),
            Self::Deployed(deployed) => format!(
                "deployed: {} processes ({REPLICAS} replicas each of snapshot-store, agent-ingest, chat-gate; the catalog section its own {REPLICAS}), worker threads as deploy/k8s limits their CPUs: {}",
                deployed.processes.len(),
                [
                    Service::Store,
                    Service::Ingest,
                    Service::Gate,
                    Service::Catalog
                ]
                .map(|service| format!("{} {}", service.name(), worker_threads(service)))
                .join(", ")
            ),
        }
    }

    /// Stops the services (in process: within `within`; processes: killed).
    pub async fn stop(self, within: Duration) {
        match self {
            Self::InProcess(stack) => {
                let _ = tokio::time::timeout(within, stack.join()).await;
            }
            Self::Deployed(deployed) => deployed.stop().await,
        }
    }
}

impl Deployed {
    /// Runs `builder`'s services as the binaries next to this one, each
    /// logging to `log_dir`, and waits until each answers `/readyz`.
    pub async fn spawn(builder: &StackBuilder, log_dir: &Path) -> Result<Self, BenchError> {
        let bin_dir = binaries_dir()?;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .step("http client")?;
        let mut deployed = Self {
            processes: Vec::new(),
            http,
        };
        std::fs::create_dir_all(log_dir).step("service log directory")?;
        for (i, binary) in builder.binaries().step("services")?.into_iter().enumerate() {
            let name = binary.service.name();
            let path = bin_dir.join(name);
            if !path.is_file() {
                return Err(BenchError::new(
                    "deployed services",
                    format!(
                        "{} is missing: deployed mode runs the service binaries built next to \
                         ctxsync-bench (cargo build --bins, same profile)",
                        path.display()
                    ),
                ));
            }
            let log = std::fs::File::create(log_dir.join(format!("{name}-{i}.log")))
                .step("service log")?;
            let child = Command::new(&path)
                .envs(binary.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .env(
                    "TOKIO_WORKER_THREADS",
                    worker_threads(binary.service).to_string(),
                )
                .stdin(Stdio::null())
                .stdout(log.try_clone().step("service log")?)
                .stderr(log)
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| BenchError::new(format!("start {name}"), e))?;
            deployed.processes.push(Running {
                service: binary.service,
                http_addr: binary.http_addr,
                child,
            });
            // In start order: the store's migrations before anything else.
            let index = deployed.processes.len() - 1;
            deployed.wait_ready(index).await?;
        }
        Ok(deployed)
    }

    async fn wait_ready(&mut self, index: usize) -> Result<(), BenchError> {
        let deadline = Instant::now() + READY_WITHIN;
        let url = format!("http://{}/readyz", self.processes[index].http_addr);
        let name = self.processes[index].service.name();
        loop {
            if let Ok(Some(status)) = self.processes[index].child.try_wait() {
                return Err(BenchError::new(
                    format!("start {name}"),
                    format!("exited with {status} (its log is in the bench's data directory)"),
                ));
            }
            if let Ok(response) = self.http.get(&url).send().await
                && response.status().is_success()
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(BenchError::new(
                    format!("start {name}"),
                    format!("not ready within {READY_WITHIN:?}"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Every process's `/metrics` text (one that does not answer adds nothing).
    pub async fn metrics_text(&self) -> String {
        let mut text = String::new();
        for process in &self.processes {
            text.push_str(&self.scrape(process.http_addr).await.unwrap_or_default());
        }
        text
    }

    /// The processes' ids.
    pub fn pids(&self) -> Vec<u32> {
        self.processes.iter().filter_map(|p| p.child.id()).collect()
    }

    /// Kills every process.
    pub async fn stop(mut self) {
        for process in &mut self.processes {
            let _ = process.child.kill().await;
        }
    }

    pub fn addrs(&self, service: Service) -> Vec<SocketAddr> {
        self.processes
            .iter()
            .filter(|p| p.service == service)
            .map(|p| p.http_addr)
            .collect()
    }

    async fn scrape(&self, addr: SocketAddr) -> Result<String, reqwest::Error> {
        self.http
            .get(format!("http://{addr}/metrics"))
            .send()
            .await?
            .text()
            .await
    }

    /// Gauge `name` summed over every replica of `service` (a replica that
    /// does not answer counts 0).
    async fn gauge(&self, service: Service, name: &str) -> usize {
        let mut total = 0.0;
        for addr in self.addrs(service) {
            if let Ok(text) = self.scrape(addr).await {
                total += gauge_value(&text, name);
            }
        }
        total.max(0.0) as usize
    }
}

/// The sum of a metric's samples in a Prometheus text rendering.
fn gauge_value(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            let value = match rest.chars().next()? {
                ' ' => rest,
                '{' => &rest[rest.find('}')? + 1..],
                _ => return None,
            };
            value.split_whitespace().next()?.parse::<f64>().ok()
        })
        .sum()
}

/// The directory of the bench's own binary, where cargo puts the services'.
fn binaries_dir() -> Result<PathBuf, BenchError> {
    let exe = std::env::current_exe().step("the bench's own path")?;
    let mut dir = exe
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| BenchError::new("the bench's own path", "it has no directory"))?;
    // A test binary lives in target/<profile>/deps.
    if dir.ends_with("deps") {
        dir.pop();
    }
    Ok(dir)
}

/// Resident set size of a process (`self` or a pid), from /proc.
pub fn rss_of(pid: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gauges_are_read_from_the_text_rendering() {
        // Other metrics are not counted.
        let text = "# TYPE ctxsync_gate_waiters gauge\nctxsync_gate_waiters 12\n\
                    ctxsync_gate_attempts_held 5\nctxsync_gate_views{a=\"b\"} 3\nctxsync_gate_views{a=\"c\"} 4\n";
        assert_eq!(gauge_value(text, "ctxsync_gate_waiters"), 12.0);
        assert_eq!(gauge_value(text, "ctxsync_gate_views"), 7.0);
        assert_eq!(gauge_value(text, "absent_metric"), 0.0);
    }

    #[test]
    fn each_service_runs_with_its_manifests_cpu_limit() {
        // As deploy/k8s limits them: a CPU each for the store, ingest and
        // gate replicas, two for the catalog.
        let limits: Vec<_> = [
            Service::Store,
            Service::Ingest,
            Service::Gate,
            Service::Catalog,
        ]
        .into_iter()
        .map(|service| cpu_limit(manifest(service), service.name()))
        .collect();
        assert_eq!(limits, [Some(1), Some(1), Some(1), Some(2)]);
        let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        assert_eq!(worker_threads(Service::Gate), 1);
        assert_eq!(worker_threads(Service::Catalog), cpus.min(2));
    }

    #[test]
    fn cpu_limits_read_as_a_cgroup_quota_does() {
        let deployment = |cpu: &str| {
            format!(
                "kind: Service\nmetadata: {{name: x}}\n---\nkind: Deployment\nspec:\n  template:\n    spec:\n      containers:\n        - name: other\n          resources: {{limits: {{cpu: \"8\"}}}}\n        - name: x\n          resources: {{limits: {{cpu: {cpu}}}}}\n"
            )
        };
        assert_eq!(cpu_limit(&deployment("\"3\""), "x"), Some(3));
        assert_eq!(cpu_limit(&deployment("2"), "x"), Some(2));
        assert_eq!(cpu_limit(&deployment("1500m"), "x"), Some(1));
        assert_eq!(cpu_limit(&deployment("250m"), "x"), Some(1));
        assert_eq!(cpu_limit(&deployment("\"1.5\""), "x"), Some(1));
        assert_eq!(cpu_limit(&deployment("2"), "absent"), None);
        assert_eq!(cpu_limit("kind: Deployment\nspec: {}\n", "x"), None);
    }
}
