//! A TCP proxy on loopback that delays what the client sends by a fixed time: the stand-in
//! for `tc netem delay` on kernels without `sch_netem` (every round trip through it takes
//! `delay` longer, as with netem on the link's egress). Order is kept; nothing is dropped.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Stops accepting and drops every connection when dropped.
pub struct DelayProxy {
    pub port: u16,
    task: JoinHandle<()>,
}

impl DelayProxy {
    /// Listens on a free loopback port and forwards to `upstream` (`host:port`).
    pub async fn start(upstream: String, delay: Duration) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let task = tokio::spawn(async move {
            let mut connections = Vec::new();
            while let Ok((client, _)) = listener.accept().await {
                let upstream = upstream.clone();
                connections.push(AbortOnDrop(tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&upstream).await {
                        let _ = pipe(client, server, delay).await;
                    }
                })));
            }
        });
        Ok(Self { port, task })
    }

    /// `redis://127.0.0.1:<port>`
    pub fn redis_url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn pipe(client: TcpStream, server: TcpStream, delay: Duration) -> std::io::Result<()> {
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    // Client to server: each chunk is held until `delay` after it arrived.
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = client_read.read(&mut buf).await?;
            if n == 0
                || tx
                    .send((Instant::now() + delay, buf[..n].to_vec()))
                    .is_err()
            {
                return Ok::<_, std::io::Error>(());
            }
        }
    };
    let writer = async move {
        let mut pending = VecDeque::new();
        while let Some(chunk) = rx.recv().await {
            pending.push_back(chunk);
            while let Some((due, bytes)) = pending.pop_front() {
                tokio::time::sleep_until(due).await;
                server_write.write_all(&bytes).await?;
                while let Ok(next) = rx.try_recv() {
                    pending.push_back(next);
                }
            }
        }
        Ok::<_, std::io::Error>(())
    };
    let back = tokio::io::copy(&mut server_read, &mut client_write);
    let _ = tokio::try_join!(reader, writer, back);
    Ok(())
}
