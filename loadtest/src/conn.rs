//! The hot loop's HTTP: one keep-alive HTTP/1.1 connection per worker, on hyper's
//! connection API, each worker a task of its own.
//!
//! `reqwest` (kept for resets and audits) spends about 30 us of CPU per request on its pool,
//! timeouts and redirect policy; `wrk` spends about 11. On a 2-core machine that the
//! generator shares with nginx, two instances and Redis, that difference decided how many
//! requests per second the generator could measure at all. A worker owns its connection, so
//! nothing is pooled or shared: it sends, reads the answer, and sends again.

use std::time::Duration;

use anyhow::bail;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper::client::conn::http1::{self, SendRequest};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;

/// Where the connections go: `http://host:port`, with any path prefix kept. Every request
/// of the tool is addressed through it ([`Target::url`] for the other client), so sales,
/// resets, audits and `--health` all go under the same prefix.
#[derive(Debug, Clone)]
pub struct Target {
    host: String,
    port: u16,
    /// The `Host` header.
    authority: String,
    /// Prepended to every path (empty for a bare `http://host:port`).
    prefix: String,
}

impl Target {
    /// Errors never quote the URL: it may carry a password.
    pub fn parse(url: &str) -> anyhow::Result<Self> {
        let Ok(uri) = url.parse::<hyper::Uri>() else {
            bail!("the target is not a URL; valid: http://host:port, like http://127.0.0.1:8080");
        };
        if uri.scheme_str() != Some("http") {
            bail!("only http:// targets are supported (nginx or an instance)");
        }
        let Some(authority) = uri.authority() else {
            bail!("the target names no host; valid: http://host:port");
        };
        if authority.as_str().contains('@') {
            // It would go out in the Host header; the service takes no credentials there.
            bail!(
                "credentials in the target URL are not supported (the admin token is --admin-token)"
            );
        }
        if uri.query().is_some() {
            bail!("a target has no query; the generator adds each request's own");
        }
        // hyper drops a fragment and sends dot segments and quotes as written, where reqwest
        // (resets, audits) would take the fragment off the path, resolve the dots and
        // percent-encode the quotes: the two halves of a run would reach different paths.
        // A prefix of plain segments means the same to both.
        let prefix = uri.path().trim_end_matches('/');
        let plain = |segment: &str| {
            !segment.is_empty()
                && segment != "."
                && segment != ".."
                && segment
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-._~".contains(&b))
        };
        if url.contains('#') || !prefix.split('/').skip(1).all(plain) {
            bail!(
                "the target's path is not a plain prefix; valid: http://host:port, or \
                 http://host:port/prefix with segments of letters, digits and - . _ ~ \
                 (every request goes under the prefix)"
            );
        }
        Ok(Self {
            host: authority.host().trim_matches(['[', ']']).to_owned(),
            port: authority.port_u16().unwrap_or(80),
            authority: authority.as_str().to_owned(),
            prefix: prefix.to_owned(),
        })
    }

    /// The URL of `path` (which starts with `/`) under the target's prefix, for requests
    /// that do not go over a [`Conn`]: the same path that a `Conn` sends.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.authority, self.path(path))
    }

    fn path(&self, path: &str) -> String {
        format!("{}{path}", self.prefix)
    }
}

/// Why a request got no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    Connect,
    Timeout,
    /// The connection broke after the request may have been sent.
    Transport,
    /// The answer's body ran past [`MAX_BODY`]: not an answer of the service's.
    BodyTooLarge,
}

/// The largest body the generator reads: every answer of the service is a few hundred bytes,
/// and a server that streams without end must not exhaust the generator's memory.
pub const MAX_BODY: usize = 64 * 1024;

impl Failure {
    pub fn kind(self) -> &'static str {
        match self {
            Self::Connect => "connect",
            Self::Timeout => "timeout",
            Self::Transport => "transport",
            Self::BodyTooLarge => "body_too_large",
        }
    }
}

/// An answer: status, `X-Instance`, body.
pub struct Answer {
    pub status: u16,
    pub instance: Option<String>,
    pub body: Bytes,
}

/// One worker's connection, opened on first use and again whenever the server closed it
/// (nginx closes a keep-alive connection after `keepalive_requests`).
pub struct Conn {
    target: std::sync::Arc<Target>,
    timeout: Duration,
    /// No request waits past this, however long `timeout` is: the end of a timed run (with
    /// its grace), which a server that never answers must not stretch.
    deadline: Option<tokio::time::Instant>,
    sender: Option<SendRequest<Empty<Bytes>>>,
}

impl Conn {
    pub fn new(target: std::sync::Arc<Target>, timeout: Duration) -> Self {
        Self {
            target,
            timeout,
            deadline: None,
            sender: None,
        }
    }

    /// Bounds every request by `deadline` as well as by the timeout.
    pub fn until(mut self, deadline: tokio::time::Instant) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Sends `method path` (no body) and reads the whole answer, within the timeout.
    pub async fn send(&mut self, method: Method, path: &str) -> Result<Answer, Failure> {
        let mut bound = tokio::time::Instant::now() + self.timeout;
        if let Some(deadline) = self.deadline {
            bound = bound.min(deadline);
        }
        match tokio::time::timeout_at(bound, self.exchange(method, path)).await {
            Ok(answer) => answer,
            Err(_) => {
                // The answer may still come on this connection; the next request must not
                // read it as its own.
                self.sender = None;
                Err(Failure::Timeout)
            }
        }
    }

    async fn exchange(&mut self, method: Method, path: &str) -> Result<Answer, Failure> {
        // A request the server never saw (its connection was closed first, as keep-alive
        // connections are after a while) is sent again once on a new connection; one that may
        // have been seen is not, because a sale must not be made twice by the generator.
        let mut retried = false;
        loop {
            let request = Request::builder()
                .method(method.clone())
                .uri(self.target.path(path))
                .header(hyper::header::HOST, &self.target.authority)
                .body(Empty::new())
                .map_err(|_| Failure::Transport)?;
            let sender = self.ready().await?;
            match sender.send_request(request).await {
                Ok(response) => {
                    let status = response.status().as_u16();
                    let instance = response
                        .headers()
                        .get("x-instance")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned);
                    let body = http_body_util::Limited::new(response.into_body(), MAX_BODY)
                        .collect()
                        .await
                        .map_err(|e| {
                            // The rest of the body is still on the connection.
                            self.sender = None;
                            if e.is::<http_body_util::LengthLimitError>() {
                                Failure::BodyTooLarge
                            } else {
                                Failure::Transport
                            }
                        })?;
                    return Ok(Answer {
                        status,
                        instance,
                        body: body.to_bytes(),
                    });
                }
                Err(e) => {
                    self.sender = None;
                    if e.is_canceled() && !retried {
                        retried = true;
                        continue;
                    }
                    return Err(Failure::Transport);
                }
            }
        }
    }

    /// The open connection, ready for a request; a new one when the last was closed.
    async fn ready(&mut self) -> Result<&mut SendRequest<Empty<Bytes>>, Failure> {
        if let Some(sender) = &mut self.sender
            && sender.ready().await.is_err()
        {
            self.sender = None;
        }
        if self.sender.is_none() {
            self.sender = Some(self.connect().await?);
        }
        self.sender.as_mut().ok_or(Failure::Connect)
    }

    async fn connect(&self) -> Result<SendRequest<Empty<Bytes>>, Failure> {
        let stream = tokio::net::TcpStream::connect((self.target.host.as_str(), self.target.port))
            .await
            .map_err(|_| Failure::Connect)?;
        // Requests are small and answered one at a time: Nagle would hold each back.
        let _ = stream.set_nodelay(true);
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|_| Failure::Connect)?;
        // Ends when the connection does: the server closed it, or `sender` was dropped.
        tokio::spawn(connection);
        Ok(sender)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A peer that reads each request and answers it with `reply`, or closes without a word
    /// when `reply` is `None`, then closes the connection; it counts the requests it read.
    async fn peer(reply: Option<&'static str>) -> (Arc<Target>, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let port = listener.local_addr().expect("its address").port();
        let seen = Arc::new(AtomicUsize::new(0));
        let counter = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut buf = vec![0u8; 4096];
                let mut read = Vec::new();
                while !read.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => read.extend_from_slice(&buf[..n]),
                    }
                }
                if read.is_empty() {
                    continue;
                }
                counter.fetch_add(1, Ordering::SeqCst);
                if let Some(reply) = reply {
                    let _ = stream.write_all(reply.as_bytes()).await;
                }
            }
        });
        let target = Target::parse(&format!("http://127.0.0.1:{port}")).expect("its URL");
        (Arc::new(target), seen)
    }

    #[tokio::test]
    async fn a_connection_the_server_closes_after_its_answer_is_opened_again() {
        // nginx closes a keep-alive connection after `keepalive_requests`: the next request
        // goes out on a new one instead of counting as an error.
        let (target, seen) = peer(Some(
            "HTTP/1.1 200 OK\r\nConnection: close\r\nX-Instance: app1\r\nContent-Length: 2\r\n\r\nok",
        ))
        .await;
        let mut conn = Conn::new(target, Duration::from_secs(5));
        for n in 1..=5 {
            let answer = conn.send(Method::POST, "/sale").await.expect("an answer");
            assert_eq!(answer.status, 200);
            assert_eq!(answer.instance.as_deref(), Some("app1"));
            assert_eq!(&answer.body[..], b"ok");
            assert_eq!(seen.load(Ordering::SeqCst), n, "each request was sent once");
        }
    }

    #[tokio::test]
    async fn a_request_the_server_may_have_read_is_not_sent_twice() {
        // A sale sent again could be a sale made twice: a connection that breaks after the
        // request went out is a `transport` failure, reported once.
        let (target, seen) = peer(None).await;
        let mut conn = Conn::new(target, Duration::from_secs(5));
        for n in 1..=3 {
            let failure = conn.send(Method::POST, "/sale").await.err();
            assert_eq!(failure, Some(Failure::Transport));
            assert_eq!(seen.load(Ordering::SeqCst), n);
        }
    }

    /// A server that accepts (the kernel's backlog does) and never answers, while the
    /// listener lives.
    async fn silent() -> (Arc<Target>, tokio::net::TcpListener) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let port = listener.local_addr().expect("its address").port();
        let target = Target::parse(&format!("http://127.0.0.1:{port}")).expect("its URL");
        (Arc::new(target), listener)
    }

    #[tokio::test]
    async fn a_body_without_end_is_cut_at_the_cap_and_a_silent_server_at_the_deadline() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let port = listener.local_addr().expect("its address").port();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    let _ = stream.read(&mut buf).await;
                    let _ = stream
                        .write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                        .await;
                    let chunk = format!("{:x}\r\n{}\r\n", 4096, "x".repeat(4096));
                    while stream.write_all(chunk.as_bytes()).await.is_ok() {}
                });
            }
        });
        let target = Arc::new(Target::parse(&format!("http://127.0.0.1:{port}")).expect("URL"));
        let mut conn = Conn::new(target, Duration::from_secs(60));
        assert_eq!(
            conn.send(Method::GET, "/health").await.err(),
            Some(Failure::BodyTooLarge)
        );

        let (target, silent) = silent().await;
        let started = tokio::time::Instant::now();
        let mut conn =
            Conn::new(target, Duration::from_secs(60)).until(started + Duration::from_millis(300));
        assert_eq!(
            conn.send(Method::GET, "/health").await.err(),
            Some(Failure::Timeout)
        );
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the deadline was not kept"
        );
        drop(silent);
    }

    #[tokio::test]
    async fn nothing_listening_is_a_connect_failure_and_a_silent_server_a_timeout() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
        let port = listener.local_addr().expect("its address").port();
        drop(listener);
        let target = Arc::new(Target::parse(&format!("http://127.0.0.1:{port}")).expect("URL"));
        let mut conn = Conn::new(target, Duration::from_secs(5));
        assert_eq!(
            conn.send(Method::GET, "/health").await.err(),
            Some(Failure::Connect)
        );

        let (target, silent) = silent().await;
        let mut conn = Conn::new(target, Duration::from_millis(200));
        assert_eq!(
            conn.send(Method::GET, "/health").await.err(),
            Some(Failure::Timeout)
        );
        drop(silent);
    }

    #[test]
    fn targets_keep_host_port_and_prefix_and_refuse_what_cannot_be_reached() {
        let t = Target::parse("http://127.0.0.1:8080").expect("a plain target");
        assert_eq!(
            (t.host.as_str(), t.port, t.prefix.as_str()),
            ("127.0.0.1", 8080, "")
        );
        assert_eq!(t.authority, "127.0.0.1:8080");
        let t = Target::parse("http://nginx/shop/").expect("a host and a prefix");
        assert_eq!(
            (t.host.as_str(), t.port, t.prefix.as_str()),
            ("nginx", 80, "/shop")
        );
        assert_eq!(t.url("/inventory"), "http://nginx/shop/inventory");
        assert_eq!(t.path("/health"), "/shop/health");
        let t = Target::parse("http://127.0.0.1:8080/a/shop-1.v_2~").expect("plain segments");
        assert_eq!(
            t.url("/inventory/audit"),
            "http://127.0.0.1:8080/a/shop-1.v_2~/inventory/audit"
        );
        for unclear in [
            "http://127.0.0.1:8080/shop#top",
            "http://127.0.0.1:8080/#top",
            "http://127.0.0.1:8080/a/../shop",
            "http://127.0.0.1:8080/./shop",
            "http://127.0.0.1:8080/a//shop",
            "http://127.0.0.1:8080/sh%6Fp",
            "http://127.0.0.1:8080/%2e%2e/shop",
            "http://127.0.0.1:8080/a\"b",
            "http://127.0.0.1:8080/{shop}",
        ] {
            let e = Target::parse(unclear).err().map(|e| e.to_string());
            let e = e.unwrap_or_else(|| panic!("{unclear} was taken"));
            assert!(
                e.contains("valid: http://host:port, or http://host:port/prefix"),
                "{unclear}: {e}"
            );
        }
        let t = Target::parse("http://[::1]:9000").expect("an IPv6 target");
        assert_eq!((t.host.as_str(), t.port), ("::1", 9000));
        for bad in [
            "https://example.test",
            "not a url",
            "/inventory",
            "http://user:s3cret@127.0.0.1:8080",
            "https://user:s3cret@127.0.0.1:8080",
            "http://user:s3cret@",
            "http://127.0.0.1:8080/?strategy=none",
        ] {
            let e = Target::parse(bad).err().map(|e| e.to_string());
            assert!(e.is_some(), "{bad} was taken");
            assert!(
                !e.unwrap_or_default().contains("s3cret"),
                "{bad}: a password was echoed"
            );
        }
    }
}
