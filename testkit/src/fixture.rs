//! Test fixtures: the processes of this crate for tests, which panic when something fails
//! (a failure to start puts the process's log into the panic message), and an HTTP client
//! that reads what the tests look at, `X-Instance` among it. Each process runs in a process
//! group and a temporary working directory of its own, and is stopped with its whole group
//! when its handle drops, also when a test panics.

// A panic is how a test fixture reports a failure.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use serde_json::Value;

use crate::{InventoryProcess, RedisProcess, default_env, inventory_binary};

pub struct RedisServer(RedisProcess);

impl RedisServer {
    pub async fn start() -> Self {
        Self(RedisProcess::start(&[]).await.unwrap())
    }

    /// A server that keeps its data across [`restart`](Self::restart) (append-only file,
    /// fsync on every write).
    pub async fn start_with(extra: &[&str]) -> Self {
        Self(RedisProcess::start(extra).await.unwrap())
    }

    pub fn port(&self) -> u16 {
        self.0.port
    }

    pub async fn start_durable() -> Self {
        let durable = ["--appendonly", "yes", "--appendfsync", "always"];
        Self(RedisProcess::start(&durable).await.unwrap())
    }

    /// Kills the server (a crash: only what reached the append-only file survives).
    pub async fn stop(&mut self) {
        self.0.stop().await;
    }

    /// Stops the server gracefully (SIGTERM), then makes sure nothing of it is left.
    pub async fn shutdown(&mut self) {
        self.0.shutdown().await;
    }

    pub fn pid(&self) -> Option<u32> {
        self.0.pid()
    }

    /// Its data and working directory.
    pub fn dir(&self) -> &Path {
        self.0.dir()
    }

    pub async fn restart(&mut self) {
        self.0.restart().await.unwrap();
    }

    pub async fn signal(&self, name: &str) {
        self.0.signal(name).await.unwrap();
    }

    pub fn url(&self) -> String {
        self.0.url()
    }

    pub async fn conn(&self) -> MultiplexedConnection {
        self.0
            .connection()
            .await
            .expect("connect to the test redis")
    }

    /// Waits until `key` exists (`present`) or is gone (`!present`), for at most `within`;
    /// how long that took, if it happened.
    pub async fn wait_for_key(
        &self,
        key: &str,
        present: bool,
        within: Duration,
    ) -> Option<Duration> {
        let mut c = self.conn().await;
        let started = Instant::now();
        while started.elapsed() < within {
            let exists: bool = redis::cmd("EXISTS")
                .arg(key)
                .query_async(&mut c)
                .await
                .unwrap_or(!present);
            if exists == present {
                return Some(started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        None
    }

    /// Every key with its `DUMP`, to show that a request changed nothing.
    pub async fn snapshot(&self) -> BTreeMap<String, Vec<u8>> {
        let mut c = self.conn().await;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*")
            .query_async(&mut c)
            .await
            .unwrap();
        let mut out = BTreeMap::new();
        for key in keys {
            let dump: Vec<u8> = redis::cmd("DUMP")
                .arg(&key)
                .query_async(&mut c)
                .await
                .unwrap();
            out.insert(key, dump);
        }
        out
    }
}

/// `n` independent lock nodes: each its own `redis-server` process on a free loopback port,
/// for `LOCK_NODES`. What databases of one server cannot show (a node down, restarted
/// empty, slow) needs these.
pub struct LockNodes {
    pub nodes: Vec<RedisServer>,
}

impl LockNodes {
    pub async fn start(n: usize) -> Self {
        let mut nodes = Vec::with_capacity(n);
        for _ in 0..n {
            nodes.push(RedisServer::start().await);
        }
        Self { nodes }
    }

    /// The value of `LOCK_NODES`: every node's URL, comma-separated.
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(RedisServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Kills node `i` (SIGKILL: a crash).
    pub async fn kill(&mut self, i: usize) {
        self.nodes[i].stop().await;
    }

    /// Starts node `i` again on its port, empty (no persistence): what Redlock's page warns
    /// about.
    pub async fn restart(&mut self, i: usize) {
        self.nodes[i].restart().await;
    }
}

/// How to start an `inventory` process: every setting is passed explicitly
/// ([`default_env`]), so the environment of whoever runs the tests cannot change them.
pub struct InstanceBuilder {
    name: String,
    env: BTreeMap<String, String>,
}

impl InstanceBuilder {
    pub fn new(redis: &RedisServer, name: &str) -> Self {
        Self {
            name: name.to_owned(),
            env: default_env(&redis.url(), name),
        }
    }

    /// An instance whose stock is on `cluster` (`REDIS_CLUSTER`, its seeds), and whose lock
    /// nodes are `nodes` (a cluster has no database 1..3 to borrow).
    pub fn on_cluster(cluster: &crate::RedisCluster, nodes: &LockNodes, name: &str) -> Self {
        let mut env = default_env("redis://127.0.0.1:1", name);
        env.remove("REDIS_URL");
        env.insert("REDIS_CLUSTER".into(), cluster.seed_urls().join(","));
        Self {
            name: name.to_owned(),
            env,
        }
        .lock_nodes(nodes)
    }

    /// `LOCK_NODES` on these separate nodes instead of databases of the stock's Redis.
    pub fn lock_nodes(self, nodes: &LockNodes) -> Self {
        self.env("LOCK_NODES", nodes.urls())
    }

    pub fn env(mut self, key: &str, value: impl ToString) -> Self {
        self.env.insert(key.to_owned(), value.to_string());
        self
    }

    /// Leaves a setting out (the instance then uses its own default).
    pub fn unset(mut self, key: &str) -> Self {
        self.env.remove(key);
        self
    }

    /// Starts [`inventory_binary`] with these settings and waits for `/health`.
    pub async fn start(self) -> Instance {
        let bin = inventory_binary().unwrap();
        let process = InventoryProcess::start(&bin, &self.name, &self.env, None)
            .await
            .unwrap();
        Instance {
            name: self.name,
            port: process.port,
            process,
            http: client(),
        }
    }
}

pub struct Instance {
    process: InventoryProcess,
    pub port: u16,
    pub name: String,
    http: reqwest::Client,
}

/// An HTTP answer, reduced to what the tests look at.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub instance: Option<String>,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
    pub elapsed: Duration,
}

impl Reply {
    pub fn error_code(&self) -> &str {
        self.body["error"].as_str().unwrap_or_default()
    }
}

impl Instance {
    pub fn url(&self, path: &str) -> String {
        self.process.url(path)
    }

    pub fn log(&self) -> String {
        self.process.log()
    }

    pub fn pid(&self) -> u32 {
        self.process.pid().expect("instance still running")
    }

    pub async fn signal(&self, name: &str) {
        self.process.signal(name).await.unwrap();
    }

    pub async fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        self.process.wait_exit(within).await
    }

    /// SIGTERM (it drains and exits), bounded, then nothing of it is left.
    pub async fn stop(&mut self) {
        self.process.stop().await;
    }

    /// Its working directory, a temporary one of its own.
    pub fn dir(&self) -> &Path {
        self.process.dir()
    }

    /// `POST /inventory/sale?<query>` with `Idempotency-Key: <key>`.
    pub async fn sale_with_key(&self, query: &str, key: &str) -> Reply {
        let url = self.url(&format!("/inventory/sale?{query}"));
        self.send(self.http.post(url).header("idempotency-key", key))
            .await
    }

    pub async fn send(&self, request: reqwest::RequestBuilder) -> Reply {
        let started = Instant::now();
        let response = request.send().await.unwrap_or_else(|e| {
            panic!(
                "request to {} failed: {e}\nits log:\n{}",
                self.name,
                self.log()
            )
        });
        let status = response.status().as_u16();
        let instance = response
            .headers()
            .get("x-instance")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let headers = response.headers().clone();
        let text = response.text().await.unwrap_or_default();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Reply {
            status,
            instance,
            headers,
            body,
            elapsed: started.elapsed(),
        }
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.send(self.http.get(self.url(path))).await
    }

    /// `POST /inventory/sale?<query>`
    pub async fn sale(&self, query: &str) -> Reply {
        self.send(
            self.http
                .post(self.url(&format!("/inventory/sale?{query}"))),
        )
        .await
    }

    /// `PUT /inventory` with a raw JSON body and an optional bearer token.
    pub async fn put_inventory(&self, body: &str, token: Option<&str>) -> Reply {
        let mut request = self
            .http
            .put(self.url("/inventory"))
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        self.send(request).await
    }

    pub async fn reset(&self, stock: i64) {
        let reply = self
            .put_inventory(&format!(r#"{{"stock": {stock}}}"#), None)
            .await;
        assert_eq!(reply.status, 200, "reset failed: {reply:?}");
    }

    pub async fn audit(&self) -> Value {
        let reply = self.get("/inventory/audit").await;
        assert_eq!(reply.status, 200, "audit failed: {reply:?}");
        reply.body
    }
}

/// A Redis server and `n` instances on it, named `app1`, `app2`, ...
pub struct Cluster {
    pub redis: RedisServer,
    pub instances: Vec<Instance>,
}

impl Cluster {
    pub async fn start(n: usize, configure: impl Fn(InstanceBuilder) -> InstanceBuilder) -> Self {
        let redis = RedisServer::start().await;
        let mut instances = Vec::new();
        for i in 1..=n {
            instances.push(
                configure(InstanceBuilder::new(&redis, &format!("app{i}")))
                    .start()
                    .await,
            );
        }
        Self { redis, instances }
    }

    /// Fires `requests` sales at once, spread round-robin over the instances, and returns
    /// every reply.
    pub async fn concurrent_sales(&self, requests: usize, query: &str) -> Vec<Reply> {
        let sales = (0..requests).map(|i| self.instances[i % self.instances.len()].sale(query));
        futures_util::future::join_all(sales).await
    }
}

/// A real nginx in front of the instances, rendered from the native stack's template.
pub use crate::NginxProcess as Nginx;

/// The tests' HTTP client. It forgets an idle connection before the servers close it
/// (`HEADER_TIMEOUT_MS`, 10 s, for an instance; nginx's `keepalive_timeout`, 15 s):
/// reused at the very moment the server closed it, it failed the request ("error sending
/// request") after a 10 s wait for a lock, whose length is exactly that timeout.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_idle_timeout(Duration::from_secs(5))
        .build()
        .expect("a client without TLS settings builds")
}

/// The whole stack: Redis, two instances, nginx in front.
pub struct Stack {
    pub cluster: Cluster,
    pub nginx: Nginx,
    pub http: reqwest::Client,
}

impl Stack {
    pub async fn start(configure: impl Fn(InstanceBuilder) -> InstanceBuilder) -> Self {
        let cluster = Cluster::start(2, configure).await;
        let nginx = Nginx::start([cluster.instances[0].port, cluster.instances[1].port])
            .await
            .expect("nginx starts");
        Self {
            cluster,
            nginx,
            http: client(),
        }
    }

    /// Stops everything as an operator would, front to back: nginx, then the instances, then
    /// Redis, each gracefully and then with its whole process group.
    pub async fn stop(mut self) {
        self.nginx.stop().await;
        for instance in &mut self.cluster.instances {
            instance.stop().await;
        }
        self.cluster.redis.shutdown().await;
    }

    /// `Instance`'s helpers, aimed at nginx instead of one instance.
    pub async fn get(&self, path: &str) -> Reply {
        self.cluster.instances[0]
            .send(self.http.get(format!("{}{path}", self.nginx.url())))
            .await
    }
}

/// Every sale of a ledger (the stream at `key`, `Keys::ledger`), oldest first, as the JSON
/// object the sale script wrote; an entry that is not JSON fails the test.
pub async fn ledger<C: redis::aio::ConnectionLike + Send>(c: &mut C, key: &str) -> Vec<Value> {
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(key)
        .arg("-")
        .arg("+")
        .query_async(c)
        .await
        .unwrap();
    entries
        .into_iter()
        .flat_map(|(_, fields)| fields)
        .map(|(_, entry)| serde_json::from_str(&entry).expect("a ledger entry is JSON"))
        .collect()
}
