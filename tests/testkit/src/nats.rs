use std::collections::BTreeSet;
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `nats-server` process owned by one test.
pub struct NatsServer {
    port: u16,
    store_dir: tempfile::TempDir,
    child: Option<Child>,
    /// Config lines after `max_payload` (users and permissions, say).
    extra_config: String,
}

fn binary() -> PathBuf {
    std::env::var_os("CTXSYNC_TEST_NATS_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("nats-server"))
}

/// With `CTXSYNC_TEST_NATS_LOG` set to a file, appends the name of the test
/// that starts a server (the harness names each test's thread after it): the
/// census of tests that need NATS, kept with `sort -u`.
fn record_start() {
    use std::io::Write;
    let Some(path) = std::env::var_os("CTXSYNC_TEST_NATS_LOG") else {
        return;
    };
    let binary = std::env::current_exe()
        .ok()
        .and_then(|exe| {
            exe.file_name()
                .map(|name| name.to_string_lossy().into_owned())
        })
        .unwrap_or_default();
    let binary = binary
        .rsplit_once('-')
        .map_or(binary.as_str(), |(name, _hash)| name);
    let test = std::thread::current().name().unwrap_or("?").to_owned();
    // One write per line: appends of concurrent tests then never interleave.
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = file.write_all(format!("{binary} {test}\n").as_bytes());
    }
}

/// Whether the server at the other end of `connection` greets (its first
/// line, INFO) with the server name `name`.
fn greets_as(connection: TcpStream, name: &str) -> bool {
    use std::io::BufRead as _;
    if connection
        .set_read_timeout(Some(Duration::from_secs(2)))
        .is_err()
    {
        return false;
    }
    let mut info = String::new();
    match std::io::BufReader::new(connection).read_line(&mut info) {
        Ok(_) => info.starts_with("INFO ") && info.contains(&format!("\"server_name\":\"{name}\"")),
        Err(_) => false,
    }
}

impl NatsServer {
    /// Starts a server with JetStream on a free port and waits until it accepts connections.
    pub fn start() -> Self {
        Self::start_with_config("")
    }

    /// [`Self::start`] with `extra_config` added to the server's config file
    /// (e.g. an `authorization` block of users with permissions).
    pub fn start_with_config(extra_config: &str) -> Self {
        // Tests build reqwest clients, which need rustls' process default.
        ctxsync_tls::install_default_provider();
        record_start();
        let mut store_dir = tempfile::tempdir().expect("cannot create a temp dir for nats-server");
        let mut last_error = String::new();
        // A reserved port can be taken by another test between reservation and bind: retry.
        for _ in 0..5 {
            let port = crate::isolation::free_port();
            let mut server = Self {
                port,
                store_dir,
                child: None,
                extra_config: extra_config.to_owned(),
            };
            match server.spawn() {
                Ok(()) => return server,
                Err(error) => {
                    last_error = error;
                    store_dir = server.take_dir();
                }
            }
        }
        panic!("nats-server did not start: {last_error}");
    }

    fn take_dir(mut self) -> tempfile::TempDir {
        self.kill();
        std::mem::replace(&mut self.store_dir, tempfile::tempdir().expect("temp dir"))
    }

    fn spawn(&mut self) -> Result<(), String> {
        // As deployed: agent requests up to 4 MiB travel in one message.
        let config = self.store_dir.path().join("nats.conf");
        std::fs::write(
            &config,
            format!("max_payload: 8MB\n{}\n", self.extra_config),
        )
        .map_err(|e| format!("cannot write {}: {e}", config.display()))?;
        // Named uniquely: the readiness check below knows its own server
        // from another listener that took the port meanwhile.
        static SPAWNED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let name = format!(
            "testkit-{}-{}",
            std::process::id(),
            SPAWNED.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let child = Command::new(binary())
            .arg("-c")
            .arg(&config)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js", "-sd"])
            .arg(self.store_dir.path())
            .args(["--server_name", &name])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "cannot run nats-server ({error}): install it (Debian: apt-get install nats-server) \
                     or point CTXSYNC_TEST_NATS_SERVER at the binary"
                )
            });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(format!(
                    "nats-server exited with {status} on port {}",
                    self.port
                ));
            }
            if let Ok(connection) = TcpStream::connect(("127.0.0.1", self.port)) {
                // Something listens; it must be this server, not a listener
                // of another test that took the port (or a socket connected
                // to itself), which would leave the test a dead address.
                if greets_as(connection, &name) {
                    return Ok(());
                }
                self.kill();
                return Err(format!(
                    "port {} is answered by another listener than nats-server {name}",
                    self.port
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err(format!(
            "nats-server did not listen on port {} within 10 s",
            self.port
        ))
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Kills the process (clients see a disconnect).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// [`Self::restart`] with `extra_config` in place of the config given at start
    /// (clients reconnect to a server with, say, other permissions).
    pub fn restart_with_config(&mut self, extra_config: &str) {
        self.extra_config = extra_config.to_owned();
        self.restart();
    }

    /// Kills the process and starts a new one on the same port and store.
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.spawn() {
                Ok(()) => return,
                Err(error) if Instant::now() > deadline => {
                    panic!("nats-server did not restart: {error}")
                }
                Err(_) => {
                    self.kill();
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One node of a [`NatsCluster`]: its ports and store, and its process while it runs.
struct Node {
    name: String,
    client_port: u16,
    route_port: u16,
    monitor_port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

/// Three `nats-server` processes clustered over routes on loopback ports,
/// each with JetStream (its own server name and store): the deployment's
/// normal case, owned by one test. Nodes can be killed and restarted (same
/// ports and store); clients given [`Self::url_list`] fail over between them.
pub struct NatsCluster {
    cluster_name: String,
    nodes: Vec<Node>,
}

/// How long a node may take to listen, and the cluster to form.
const CLUSTER_DEADLINE: Duration = Duration::from_secs(20);

impl NatsCluster {
    pub const SIZE: usize = 3;

    /// Starts the three nodes together and returns once every node routes to
    /// both others and reports itself healthy (JetStream in contact with its
    /// meta leader).
    pub fn start() -> Self {
        ctxsync_tls::install_default_provider();
        record_start();
        let mut last_error = String::new();
        // Reserved ports can be taken by another test before the bind: retry.
        for _ in 0..3 {
            let suffix = uuid::Uuid::new_v4().simple().to_string();
            let nodes = (0..Self::SIZE)
                .map(|i| Node {
                    name: format!("n{i}-{}", &suffix[..8]),
                    client_port: crate::isolation::free_port(),
                    route_port: crate::isolation::free_port(),
                    monitor_port: crate::isolation::free_port(),
                    dir: tempfile::tempdir().expect("cannot create a temp dir for nats-server"),
                    child: None,
                })
                .collect();
            let mut cluster = Self {
                cluster_name: format!("ctxsync-{}", &suffix[..8]),
                nodes,
            };
            match (0..Self::SIZE)
                .try_for_each(|i| cluster.spawn(i))
                .and_then(|()| cluster.wait_formed())
            {
                Ok(()) => return cluster,
                Err(error) => last_error = error,
            }
        }
        panic!("the nats cluster did not start: {last_error}");
    }

    fn config(&self, i: usize) -> String {
        let node = &self.nodes[i];
        let routes: Vec<String> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, other)| format!("\"nats-route://127.0.0.1:{}\"", other.route_port))
            .collect();
        format!(
            "server_name: \"{name}\"\n\
             listen: \"127.0.0.1:{client}\"\n\
             http: \"127.0.0.1:{monitor}\"\n\
             max_payload: 8MB\n\
             jetstream {{ store_dir: \"{store}\" }}\n\
             cluster {{\n  name: \"{cluster}\"\n  listen: \"127.0.0.1:{route}\"\n  routes: [{routes}]\n}}\n",
            name = node.name,
            client = node.client_port,
            monitor = node.monitor_port,
            store = node.dir.path().join("js").display(),
            cluster = self.cluster_name,
            route = node.route_port,
            routes = routes.join(", "),
        )
    }

    fn spawn(&mut self, i: usize) -> Result<(), String> {
        let config = self.config(i);
        let node = &mut self.nodes[i];
        let path = node.dir.path().join("nats.conf");
        std::fs::write(&path, config)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        let child = Command::new(binary())
            .arg("-c")
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "cannot run nats-server ({error}): install it (Debian: apt-get install nats-server) \
                     or point CTXSYNC_TEST_NATS_SERVER at the binary"
                )
            });
        node.child = Some(child);
        Ok(())
    }

    /// Waits until every running node routes to every other running node and
    /// answers its health check, or fails with what is missing.
    fn wait_formed(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + CLUSTER_DEADLINE;
        loop {
            let missing = self.not_formed();
            match missing {
                None => return Ok(()),
                Some(reason) if Instant::now() > deadline => {
                    return Err(format!("not formed within {CLUSTER_DEADLINE:?}: {reason}"));
                }
                Some(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// What keeps the running nodes from being a formed cluster, if anything.
    fn not_formed(&mut self) -> Option<String> {
        let running: Vec<usize> = (0..Self::SIZE).filter(|&i| self.is_running(i)).collect();
        for &i in &running {
            if let Some(child) = self.nodes[i].child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.nodes[i].child = None;
                return Some(format!("node {i} exited with {status}"));
            }
            let routez = match self.monitor(i, "/routez") {
                Ok(routez) => routez,
                Err(error) => return Some(format!("node {i}: {error}")),
            };
            let peers: BTreeSet<String> = routez["routes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|route| route["remote_id"].as_str().map(str::to_owned))
                .collect();
            // Every other running node, by server id.
            for &j in running.iter().filter(|&&j| j != i) {
                let id = match self.server_id(j) {
                    Ok(id) => id,
                    Err(error) => return Some(format!("node {j}: {error}")),
                };
                if !peers.contains(&id) {
                    return Some(format!("node {i} has no route to node {j} yet"));
                }
            }
            match self.monitor(i, "/healthz") {
                Ok(health) if health["status"] == "ok" => {}
                Ok(health) => return Some(format!("node {i} is not healthy: {health}")),
                Err(error) => return Some(format!("node {i}: {error}")),
            }
        }
        None
    }

    fn server_id(&self, i: usize) -> Result<String, String> {
        let varz = self.monitor(i, "/varz")?;
        varz["server_id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("no server_id in varz: {varz}"))
    }

    /// A GET of node `i`'s monitoring endpoint, as JSON.
    fn monitor(&self, i: usize, path: &str) -> Result<serde_json::Value, String> {
        use std::io::{Read, Write};
        let port = self.nodes[i].monitor_port;
        let mut stream = TcpStream::connect_timeout(
            &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
            Duration::from_secs(1),
        )
        .map_err(|e| format!("monitoring port {port}: {e}"))?;
        stream
            .set_read_timeout(Some(Duration::from_secs(2)))
            .map_err(|e| e.to_string())?;
        write!(
            stream,
            "GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n"
        )
        .map_err(|e| format!("monitoring port {port}: {e}"))?;
        let mut response = String::new();
        stream
            .read_to_string(&mut response)
            .map_err(|e| format!("monitoring port {port}: {e}"))?;
        let body = response
            .split_once("\r\n\r\n")
            .map(|(_, body)| body)
            .ok_or_else(|| format!("no HTTP body from {path}"))?;
        serde_json::from_str(body).map_err(|e| format!("{path} is not JSON ({e}): {body}"))
    }

    fn is_running(&self, i: usize) -> bool {
        self.nodes[i].child.is_some()
    }

    /// Every node's client URL, in node order.
    pub fn urls(&self) -> Vec<String> {
        (0..Self::SIZE).map(|i| self.node_url(i)).collect()
    }

    /// The URLs comma-joined: a `NATS_URL` naming the whole cluster.
    pub fn url_list(&self) -> String {
        self.urls().join(",")
    }

    /// Node `i`'s client URL.
    pub fn node_url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[i].client_port)
    }

    /// Node `i`'s client port.
    pub fn node_port(&self, i: usize) -> u16 {
        self.nodes[i].client_port
    }

    /// Node `i`'s route port, where the other nodes connect to it.
    pub fn route_port(&self, i: usize) -> u16 {
        self.nodes[i].route_port
    }

    /// The node a client is connected to (by the port of the server's INFO).
    pub fn node_of(&self, client: &async_nats::Client) -> Option<usize> {
        let port = client.server_info().port;
        self.nodes.iter().position(|node| node.client_port == port)
    }

    /// The nodes that have a client connection named `name` (a service's
    /// NATS client name, e.g. `chat-gate`), in node order: works for
    /// services in this process and for binaries alike.
    pub fn nodes_with_client(&self, name: &str) -> Vec<usize> {
        (0..Self::SIZE)
            .filter(|&i| self.is_running(i))
            .filter(|&i| {
                self.monitor(i, "/connz?limit=1024").is_ok_and(|connz| {
                    connz["connections"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|c| c["name"] == name)
                })
            })
            .collect()
    }

    /// Kills node `i` (SIGKILL: its clients see their connection drop and
    /// fail over to the other nodes).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills node `i` if it runs, starts it again on the same ports and store,
    /// and waits until the cluster is formed again.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        let deadline = Instant::now() + CLUSTER_DEADLINE;
        loop {
            let started = self.spawn(i).and_then(|()| self.wait_formed());
            match started {
                Ok(()) => return,
                Err(error) if Instant::now() > deadline => {
                    panic!("nats node {i} did not restart: {error}")
                }
                Err(_) => {
                    self.kill(i);
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for i in 0..Self::SIZE {
            self.kill(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;
    use std::net::TcpListener;

    use super::*;

    /// A listener on a free port that greets each connection with `greeting`.
    fn impostor(greeting: &'static str) -> u16 {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for mut connection in listener.incoming().flatten() {
                let _ = connection.write_all(greeting.as_bytes());
            }
        });
        port
    }

    #[test]
    fn a_server_is_known_by_the_name_in_its_greeting() {
        let ours = impostor("INFO {\"server_id\":\"x\",\"server_name\":\"testkit-1-7\"} \r\n");
        let other = impostor("INFO {\"server_id\":\"x\",\"server_name\":\"testkit-1-8\"} \r\n");
        let silent = impostor("");
        let greets = |port: u16| {
            greets_as(
                TcpStream::connect(("127.0.0.1", port)).unwrap(),
                "testkit-1-7",
            )
        };
        assert!(greets(ours));
        assert!(
            !greets(other),
            "another server's greeting was taken for ours"
        );
        assert!(
            !greets(silent),
            "a listener that never greets was taken for ours"
        );
    }

    #[test]
    fn a_port_answered_by_another_listener_is_not_taken_for_the_server() {
        let port = impostor("INFO {\"server_id\":\"x\",\"server_name\":\"someone-else\"} \r\n");
        let mut server = NatsServer {
            port,
            store_dir: tempfile::tempdir().unwrap(),
            child: None,
            extra_config: String::new(),
        };
        let started = server.spawn();
        assert!(
            started.is_err(),
            "a server that could not bind its port was reported listening"
        );
        assert!(server.child.is_none(), "the failed server was left running");
    }
}
