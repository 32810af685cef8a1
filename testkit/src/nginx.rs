//! nginx in front of two instances, from the native stack's template.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use nix::sys::signal::Signal;
use tempfile::TempDir;
use tokio::process::Command;
use tokio::time::Instant;

use crate::group::{DEFAULT_GRACE, ProcessGroup};
use crate::{START_ATTEMPTS, free_port, read_log};

/// nginx in front of two instances, from the native stack's template, on a free port, for
/// the benchmarks and the integration tests. The master leads the group its workers
/// inherit; it is stopped with SIGQUIT (finish the requests in flight), then SIGKILL to the
/// group: a master killed alone leaves its workers running, adopted by init, still
/// listening.
pub struct NginxProcess {
    process: ProcessGroup,
    pub port: u16,
    /// Configuration, logs and working directory; removed after the process is gone (fields
    /// drop in order).
    dir: TempDir,
}

impl NginxProcess {
    pub async fn start(upstreams: [u16; 2]) -> anyhow::Result<Self> {
        let nginx = ["/usr/sbin/nginx", "/usr/bin/nginx"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .context("nginx is not installed (apt-get install nginx)")?;
        let conf_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../nginx");
        let template = std::fs::read_to_string(conf_dir.join("nginx.native.conf.template"))
            .context("nginx template")?;
        let mut last_log = String::new();
        for _ in 0..START_ATTEMPTS {
            let dir = tempfile::tempdir()?;
            std::fs::create_dir_all(dir.path().join("nginx-tmp"))?;
            let port = free_port()?;
            let conf = template
                .replace("@RUN_DIR@", &dir.path().display().to_string())
                .replace("@CONF_DIR@", &conf_dir.display().to_string())
                .replace("@NGINX_PORT@", &port.to_string())
                .replace("@APP1_PORT@", &upstreams[0].to_string())
                .replace("@APP2_PORT@", &upstreams[1].to_string())
                // The instances' default budget, as `make up` computes it (scripts/stack.sh).
                .replace("@PROXY_READ_TIMEOUT@", "20s");
            let conf_path = dir.path().join("nginx.conf");
            std::fs::write(&conf_path, conf)?;
            let error_log = dir.path().join("nginx-error.log");
            let mut command = Command::new(nginx);
            command
                .arg("-e")
                .arg(&error_log)
                .arg("-p")
                .arg(dir.path())
                .arg("-c")
                .arg(&conf_path)
                // In the foreground, so it stays our child and keeps the group we give it.
                .args(["-g", "daemon off;"])
                .current_dir(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            // Its own group, stopped with nginx's graceful SIGQUIT: the workers go too.
            let process = ProcessGroup::spawn(&mut command, Signal::SIGQUIT, DEFAULT_GRACE)
                .context("cannot run nginx")?;
            let mut server = NginxProcess { process, port, dir };
            if server.wait_listening(Duration::from_secs(5)).await {
                return Ok(server);
            }
            last_log = read_log(&error_log);
        }
        bail!("nginx did not start; its error log:\n{last_log}")
    }

    async fn wait_listening(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if self.process.has_exited() {
                return false;
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .is_ok()
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn error_log(&self) -> String {
        read_log(&self.dir.path().join("nginx-error.log"))
    }

    pub fn access_log(&self) -> String {
        read_log(&self.dir.path().join("nginx-access.log"))
    }

    /// Graceful stop (SIGQUIT), bounded, then SIGKILL to whatever is left of the group.
    pub async fn stop(&mut self) {
        self.process.stop().await;
    }

    /// The master's pid, which is also its group's id.
    pub fn pid(&self) -> Option<u32> {
        self.process.id()
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}
