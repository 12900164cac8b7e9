//! What keeps tests apart: their own ports and subject prefixes, and logs
//! routed through the test harness.

/// A subject prefix unique to one test, for tests that share a NATS server.
pub fn unique_prefix() -> String {
    format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

/// Routes `tracing` output through the test harness (shown for failing tests).
pub fn init_logs() {
    ctxsync_tls::install_default_provider();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CTXSYNC_TEST_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_test_writer()
        .try_init();
}

/// A loopback address on a free port (see [`free_port`]).
pub fn free_addr() -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// Reserves a free TCP port on loopback (released before returning), never
/// one this process was given before: the kernel may hand a just-released
/// port out again, and a test that asks for several at once (a compose
/// stack's published ports) must not get one twice.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("cannot reserve a loopback port");
        let mut given = GIVEN
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if given.insert(port) {
            return port;
        }
    }
}

#[cfg(test)]
mod tests {
    /// Thousands of ports from one process: with bind-and-release alone the
    /// kernel repeats some (135 of 2000 in a trial on this machine).
    #[test]
    fn free_port_never_repeats_within_a_process() {
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..2000 {
            let port = super::free_port();
            assert!(seen.insert(port), "port {port} given twice");
        }
    }
}
