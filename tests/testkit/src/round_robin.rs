//! A plain round-robin TCP load balancer for tests of replicas.

use std::sync::Arc;

/// One loopback address in front of replicas: each connection goes
/// to the next replica in turn (the next one after it when one refuses), as
/// a plain round-robin load balancer does. Counts the connections each took.
pub struct RoundRobin {
    /// Where clients connect.
    pub addr: std::net::SocketAddr,
    taken: Arc<[std::sync::atomic::AtomicUsize]>,
    task: tokio::task::JoinHandle<()>,
}

impl RoundRobin {
    /// Listens on a free loopback port in front of `replicas`.
    pub async fn start(replicas: Vec<std::net::SocketAddr>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let taken: Arc<[std::sync::atomic::AtomicUsize]> =
            replicas.iter().map(|_| Default::default()).collect();
        let counts = taken.clone();
        let task = tokio::spawn(async move {
            let mut next = 0;
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                let first = next;
                next = (next + 1) % replicas.len();
                let replicas = replicas.clone();
                let counts = counts.clone();
                tokio::spawn(async move {
                    for turn in 0..replicas.len() {
                        let index = (first + turn) % replicas.len();
                        if let Ok(mut outbound) =
                            tokio::net::TcpStream::connect(replicas[index]).await
                        {
                            counts[index].fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            let _ =
                                tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                            return;
                        }
                    }
                });
            }
        });
        Self { addr, taken, task }
    }

    /// The connections `replica` (its index) took.
    pub fn taken(&self, replica: usize) -> usize {
        self.taken[replica].load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for RoundRobin {
    fn drop(&mut self) {
        self.task.abort();
    }
}
