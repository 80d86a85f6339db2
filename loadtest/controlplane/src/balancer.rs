//! An L4 (TCP) balancer on 127.0.0.1, as a cloud load balancer in front of apiservers or
//! Bulwarks: each connection goes to one backend and stays there, bytes copied both ways.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::Context;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// How a connection's backend is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    /// Each connection to the next backend in turn (the next after it when that one
    /// refuses the connection).
    RoundRobin,
    /// Every connection to the first backend that accepts it, in order: clients pinned to
    /// the first, moved to the next only while it is down (a balancer's health check).
    Preferring,
}

/// A running balancer; dropping it stops accepting (open connections carry on).
pub struct Balancer {
    /// Where clients connect.
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for Balancer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Balancer {
    /// Listens on a free port of 127.0.0.1 and forwards to `backends`.
    pub async fn start(backends: Vec<SocketAddr>, pick: Pick) -> anyhow::Result<Balancer> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the TCP balancer")?;
        let addr = listener.local_addr()?;
        let next = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    // Out of descriptors, say: wait rather than spin on the error.
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                };
                let _ = client.set_nodelay(true);
                let backends = backends.clone();
                let first = match pick {
                    Pick::RoundRobin => next.fetch_add(1, Ordering::Relaxed),
                    Pick::Preferring => 0,
                };
                tokio::spawn(async move {
                    for k in 0..backends.len() {
                        let backend = backends[(first + k) % backends.len()];
                        if let Ok(upstream) = TcpStream::connect(backend).await {
                            let _ = upstream.set_nodelay(true);
                            let (mut c, mut u) = (client, upstream);
                            let _ = tokio::io::copy_bidirectional(&mut c, &mut u).await;
                            return;
                        }
                    }
                });
            }
        });
        Ok(Balancer { addr, task })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A backend on `ip` that answers each connection with its own name.
    async fn backend(name: &'static str, ip: &str) -> (SocketAddr, JoinHandle<()>) {
        let listener = TcpListener::bind((ip, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            while let Ok((mut c, _)) = listener.accept().await {
                let _ = c.write_all(name.as_bytes()).await;
            }
        });
        (addr, task)
    }

    async fn answer(addr: SocketAddr) -> String {
        let mut c = TcpStream::connect(addr).await.unwrap();
        let mut s = String::new();
        let _ = c.read_to_string(&mut s).await;
        s
    }

    #[tokio::test]
    async fn round_robin_spreads_connections_and_preferring_pins_them_until_the_first_is_down() {
        // The backend that goes down listens on an address of its own: once it is gone, no
        // listener of another test running beside this one can be given its port.
        let (a, a_task) = backend("a", "127.0.0.2").await;
        let (b, _b_task) = backend("b", "127.0.0.1").await;
        let rr = Balancer::start(vec![a, b], Pick::RoundRobin).await.unwrap();
        let mut seen = Vec::new();
        for _ in 0..4 {
            seen.push(answer(rr.addr).await);
        }
        assert_eq!(seen, ["a", "b", "a", "b"]);
        let pinned = Balancer::start(vec![a, b], Pick::Preferring).await.unwrap();
        assert_eq!(answer(pinned.addr).await, "a");
        assert_eq!(answer(pinned.addr).await, "a");
        a_task.abort();
        let _ = a_task.await;
        // Under a full parallel test run a connection has now and then come back empty
        // here (not from "a": its listener is gone); the pin must move to "b" all the same.
        let mut answers = Vec::new();
        for _ in 0..5 {
            let got = answer(pinned.addr).await;
            assert_ne!(got, "a", "still pinned to the first while it is down");
            answers.push(got);
            if answers.last().is_some_and(|a| a == "b") {
                break;
            }
        }
        assert_eq!(
            answers.last().map(String::as_str),
            Some("b"),
            "moved while the first is down: {answers:?}"
        );
    }
}
