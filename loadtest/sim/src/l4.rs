//! A TCP (layer 4) balancer in front of the fleet: each new client connection goes to the
//! next live replica and stays there for its lifetime, like a cloud load balancer — the
//! setup that concentrates long-lived HTTP/2 connections on one replica after restarts.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::server::Replica;

/// Starts the balancer on 127.0.0.1:0 and returns its address.
/// It stops accepting when `stop` is cancelled; connections already relayed continue.
pub async fn start(replicas: Vec<Replica>, stop: CancellationToken) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let next = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = stop.cancelled() => return,
                a = listener.accept() => a,
            };
            let Ok((client, _)) = accepted else { continue };
            let _ = client.set_nodelay(true);
            let replicas = replicas.clone();
            let next = next.clone();
            tokio::spawn(async move {
                // Try each replica once, starting with the next in turn; a stopped one
                // refuses the connection.
                let n = replicas.len();
                let first = next.fetch_add(1, Ordering::Relaxed);
                for k in 0..n {
                    let r = &replicas[(first + k) % n];
                    if let Ok(up) = TcpStream::connect(r.addr()).await {
                        let _ = up.set_nodelay(true);
                        let (mut c, mut u) = (client, up);
                        let _ = tokio::io::copy_bidirectional(&mut c, &mut u).await;
                        return;
                    }
                }
            });
        }
    });
    Ok(addr)
}
