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
        let child = Command::new(binary())
            .arg("-c")
            .arg(&config)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js", "-sd"])
            .arg(self.store_dir.path())
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
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
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
