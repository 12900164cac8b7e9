//! A TCP proxy to a nats-server that, once told, hands the server's bytes to
//! the client late and in order: a message the server already routed to a
//! connection is still on its way when the test acts (a stop, a drain).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// See the module docs. What the client sends goes through at once.
pub struct LateProxy {
    pub port: u16,
    delay: Arc<Mutex<Duration>>,
    accept: tokio::task::JoinHandle<()>,
}

impl LateProxy {
    /// Proxies 127.0.0.1:`target_port`, with no delay until told.
    pub async fn start(target_port: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the late proxy");
        let port = listener.local_addr().expect("late proxy address").port();
        let delay = Arc::new(Mutex::new(Duration::ZERO));
        let shared = delay.clone();
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = tokio::net::TcpStream::connect(("127.0.0.1", target_port)).await
                else {
                    continue;
                };
                let (mut client_read, mut client_write) = inbound.into_split();
                let (mut server_read, mut server_write) = outbound.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                });
                // Each chunk is due its delay after it was read; the delay
                // only grows, so chunks stay in order.
                let (chunks, mut due) = tokio::sync::mpsc::unbounded_channel();
                let delay = shared.clone();
                tokio::spawn(async move {
                    let mut buffer = vec![0; 64 * 1024];
                    while let Ok(read @ 1..) = server_read.read(&mut buffer).await {
                        let at = tokio::time::Instant::now() + *delay.lock().expect("delay lock");
                        if chunks.send((at, buffer[..read].to_vec())).is_err() {
                            break;
                        }
                    }
                });
                tokio::spawn(async move {
                    while let Some((at, chunk)) = due.recv().await {
                        tokio::time::sleep_until(at).await;
                        if client_write.write_all(&chunk).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        Self {
            port,
            delay,
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
        *self.delay.lock().expect("delay lock") = delay;
    }
}

impl Drop for LateProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}
