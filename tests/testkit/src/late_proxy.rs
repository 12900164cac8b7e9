//! A TCP proxy to a nats-server that, once told, hands bytes on late and in
//! order: a message the server already routed to a connection is still on
//! its way when the test acts (a stop, a drain), or what the client sent
//! after a reconnect has not reached the server yet. It also cuts the
//! client off (a disconnect) until restored.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::task::JoinHandle;

/// See the module docs. Without a delay, bytes go through at once. It can
/// also cut every connection and refuse new ones until restored.
pub struct LateProxy {
    pub port: u16,
    to_client: Arc<Mutex<Duration>>,
    to_server: Arc<Mutex<Duration>>,
    open: Arc<AtomicBool>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl LateProxy {
    /// Proxies 127.0.0.1:`target_port`, with no delay until told.
    pub async fn start(target_port: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the late proxy");
        let port = listener.local_addr().expect("late proxy address").port();
        let to_client = Arc::new(Mutex::new(Duration::ZERO));
        let to_server = Arc::new(Mutex::new(Duration::ZERO));
        let open = Arc::new(AtomicBool::new(true));
        let connections: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (client_delay, server_delay, accepting, tasks) = (
            to_client.clone(),
            to_server.clone(),
            open.clone(),
            connections.clone(),
        );
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                if !accepting.load(Ordering::SeqCst) {
                    continue; // dropped: the client sees the connection fail
                }
                let Ok(outbound) = tokio::net::TcpStream::connect(("127.0.0.1", target_port)).await
                else {
                    continue;
                };
                let (client_read, client_write) = inbound.into_split();
                let (server_read, server_write) = outbound.into_split();
                let mut tasks = tasks.lock().expect("connections lock");
                tasks.retain(|task: &JoinHandle<()>| !task.is_finished());
                tasks.extend(forward(client_read, server_write, server_delay.clone()));
                tasks.extend(forward(server_read, client_write, client_delay.clone()));
            }
        });
        Self {
            port,
            to_client,
            to_server,
            open,
            connections,
            accept,
        }
    }

    /// The URL a client connects through.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// From now on the server's bytes reach the client `delay` after they
    /// left the server (never less than before: order is kept).
    pub fn delay_to_client(&self, delay: Duration) {
        *self.to_client.lock().expect("delay lock") = delay;
    }

    /// From now on the client's bytes reach the server `delay` after they
    /// left the client (never less than before: order is kept).
    pub fn delay_to_server(&self, delay: Duration) {
        *self.to_server.lock().expect("delay lock") = delay;
    }

    /// Closes every proxied connection and refuses new ones.
    pub fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        for task in self.connections.lock().expect("connections lock").drain(..) {
            task.abort();
        }
    }

    /// Accepts connections again after [`LateProxy::cut`].
    pub fn restore(&self) {
        self.open.store(true, Ordering::SeqCst);
    }
}

/// Copies `from` to `to`, each chunk due `delay` after it was read; the
/// delay only grows, so chunks stay in order.
fn forward(
    mut from: impl AsyncRead + Unpin + Send + 'static,
    mut to: impl AsyncWrite + Unpin + Send + 'static,
    delay: Arc<Mutex<Duration>>,
) -> [JoinHandle<()>; 2] {
    let (chunks, mut due) = tokio::sync::mpsc::unbounded_channel();
    let read = tokio::spawn(async move {
        let mut buffer = vec![0; 64 * 1024];
        while let Ok(read @ 1..) = from.read(&mut buffer).await {
            let at = tokio::time::Instant::now() + *delay.lock().expect("delay lock");
            if chunks.send((at, buffer[..read].to_vec())).is_err() {
                break;
            }
        }
    });
    let write = tokio::spawn(async move {
        while let Some((at, chunk)) = due.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&chunk).await.is_err() {
                break;
            }
        }
    });
    [read, write]
}

impl Drop for LateProxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}
