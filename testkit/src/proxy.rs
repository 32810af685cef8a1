//! A TCP proxy on loopback that delays what passes through it: the stand-in for `tc netem
//! delay` on kernels without `sch_netem`. Each direction has its own delay, which a test may
//! change while connections are open: what the client sends (every round trip then takes
//! that much longer, as with netem on the link's egress), and the answers (Redis has run a
//! command long before its client hears of it, as behind a slow or congested return path).
//! Order is kept; nothing is dropped.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Stops accepting and drops every connection when dropped.
pub struct DelayProxy {
    pub port: u16,
    delays: Delays,
    task: JoinHandle<()>,
}

/// Microseconds, shared with every connection's forwarding tasks.
#[derive(Clone, Default)]
struct Delays {
    requests: Arc<AtomicU64>,
    answers: Arc<AtomicU64>,
}

fn micros(delay: Duration) -> u64 {
    u64::try_from(delay.as_micros()).unwrap_or(u64::MAX)
}

impl DelayProxy {
    /// Listens on a free loopback port and forwards to `upstream` (`host:port`), holding
    /// what the client sends for `delay`.
    pub async fn start(upstream: String, delay: Duration) -> anyhow::Result<Self> {
        let proxy = Self::transparent(upstream).await?;
        proxy.delay_requests(delay);
        Ok(proxy)
    }

    /// Forwards to `upstream` without delay until told otherwise.
    pub async fn transparent(upstream: String) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let delays = Delays::default();
        let shared = delays.clone();
        let task = tokio::spawn(async move {
            let mut connections = Vec::new();
            while let Ok((client, _)) = listener.accept().await {
                let (upstream, delays) = (upstream.clone(), shared.clone());
                connections.push(AbortOnDrop(tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&upstream).await {
                        let _ = pipe(client, server, delays).await;
                    }
                })));
            }
        });
        Ok(Self { port, delays, task })
    }

    /// From now on, what a client sends reaches the server `delay` after it arrived.
    pub fn delay_requests(&self, delay: Duration) {
        self.delays.requests.store(micros(delay), Ordering::Release);
    }

    /// From now on, what the server answers reaches the client `delay` after it arrived
    /// (never before what came ahead of it).
    pub fn delay_answers(&self, delay: Duration) {
        self.delays.answers.store(micros(delay), Ordering::Release);
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

async fn pipe(client: TcpStream, server: TcpStream, delays: Delays) -> std::io::Result<()> {
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let _ = tokio::try_join!(
        forward(client_read, server_write, delays.requests),
        forward(server_read, client_write, delays.answers),
    );
    Ok(())
}

/// Copies `from` to `to`, each chunk held until `delay` (read when it arrived) after it
/// arrived, in order.
async fn forward(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    delay: Arc<AtomicU64>,
) -> std::io::Result<()> {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = from.read(&mut buf).await?;
            let due = Instant::now() + Duration::from_micros(delay.load(Ordering::Acquire));
            if n == 0 || tx.send((due, buf[..n].to_vec())).is_err() {
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
                to.write_all(&bytes).await?;
                while let Ok(next) = rx.try_recv() {
                    pending.push_back(next);
                }
            }
        }
        to.shutdown().await
    };
    tokio::try_join!(reader, writer).map(|_| ())
}
