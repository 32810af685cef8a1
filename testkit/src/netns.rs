//! Real network faults: a Linux network namespace that the harness creates and removes
//! itself, reached from the host through veth pairs with addresses in `10.200.0.0/16` (one
//! `/30` per link). A Redis node run inside it ([`crate::RedisProcess::start_in`]) can then be
//! cut off ([`Link::cut`]: the namespace's end of the link goes down, so packets are dropped
//! and connections hang, as in a real partition rather than a refused connection), slowed
//! or made lossy (`tc netem`, when the kernel has it).
//!
//! Only addresses inside the namespace and on the host's end of its links are used: nothing
//! is routed anywhere else. Needs root (CI runs as root).
//!
//! Nothing is left behind: dropping a [`Namespace`] (also while a test panics) kills every
//! process still inside it, deletes its links and the namespace, and frees its addresses.
//! A process stopped by SIGINT, SIGTERM or SIGHUP runs no `Drop`: its signal handler
//! (`group.rs`) removes the namespaces still alive ([`sweep_live`]). A namespace left by a
//! process that was killed outright is swept by the next one created: names carry the
//! creator's pid.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};

/// Prefix of every namespace and interface this module creates, so that leftovers can be
/// recognised (and the leak test can look for them).
pub const PREFIX: &str = "tk";

/// Where the claims on `/30` subnets live: one file per subnet, holding the claimer's pid.
/// Tests run in parallel processes (nextest), so the claim must be visible across them.
fn claims_dir() -> PathBuf {
    std::env::temp_dir().join("testkit-netns")
}

static NEXT: AtomicU32 = AtomicU32::new(0);

/// The namespaces of this process not dropped yet, with their host-side interfaces and
/// subnet claims: what [`sweep_live`] removes when a signal ends the process.
static LIVE: Mutex<BTreeMap<String, Owned>> = Mutex::new(BTreeMap::new());

/// A live namespace's host-side interfaces and subnet claims.
type Owned = (Vec<String>, Vec<PathBuf>);

fn live<T>(f: impl FnOnce(&mut BTreeMap<String, Owned>) -> T) -> T {
    f(&mut LIVE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner))
}

/// Removes every namespace of this process that is still alive, as their drops would: for
/// the process's end by a signal, which runs no `Drop`. Links first (deleting one end of a
/// veth deletes the pair at once; a namespace's own cleanup may lag by a minute).
pub(crate) fn sweep_live() {
    let namespaces = live(std::mem::take);
    for (name, (host_ifs, claims)) in namespaces {
        kill_inside(&name);
        for host_if in host_ifs {
            let _ = run("ip", &["link", "del", &host_if]);
        }
        let _ = run("ip", &["netns", "del", &name]);
        for claim in claims {
            let _ = std::fs::remove_file(claim);
        }
    }
}

/// Runs `ip`/`tc` with `args`; the error carries its stderr.
fn run(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {program} (install iproute2)"))?;
    if !out.status.success() {
        bail!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// The effective uid, from `/proc/self/status` (nix's `user` feature is not enabled).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

/// Whether this process may create namespaces (root, with `ip` installed).
pub fn supported() -> bool {
    is_root() && run("ip", &["netns", "list"]).is_ok()
}

/// Namespaces and host-side interfaces this module created that still exist, by name.
pub fn leftovers() -> Vec<String> {
    let mut names = Vec::new();
    if let Ok(list) = run("ip", &["netns", "list"]) {
        names.extend(
            list.lines()
                .filter_map(|l| l.split_whitespace().next())
                .filter(|n| n.starts_with(&format!("{PREFIX}-")))
                .map(str::to_owned),
        );
    }
    if let Ok(links) = run("ip", &["-o", "link", "show"]) {
        names.extend(
            links
                .lines()
                .filter_map(|l| l.split(": ").nth(1))
                .map(|n| n.split('@').next().unwrap_or(n))
                .filter(|n| n.starts_with(PREFIX) && n.ends_with('h'))
                .map(str::to_owned),
        );
    }
    names
}

/// Removes what a process that died without dropping its namespaces left behind.
fn sweep_dead_owners() {
    if let Ok(list) = run("ip", &["netns", "list"]) {
        for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
            let Some(pid) = name
                .strip_prefix(&format!("{PREFIX}-"))
                .and_then(|rest| rest.split('-').next())
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            if !alive(pid) {
                kill_inside(name);
                // The host's ends of its links, named as the namespace's with `h` for `n`:
                // deleted now, rather than whenever the kernel gets round to the namespace.
                if let Ok(links) = run("ip", &["netns", "exec", name, "ip", "-o", "link", "show"]) {
                    for ns_if in links
                        .lines()
                        .filter_map(|l| l.split(": ").nth(1))
                        .map(|n| n.split('@').next().unwrap_or(n))
                        .filter(|n| n.starts_with(PREFIX) && n.ends_with('n'))
                    {
                        let host_if = format!("{}h", &ns_if[..ns_if.len() - 1]);
                        let _ = run("ip", &["link", "del", &host_if]);
                    }
                }
                let _ = run("ip", &["netns", "del", name]);
            }
        }
    }
    // Host-side ends whose namespace is already gone but which the kernel has not removed
    // yet (it may take over a minute): `<PREFIX><pid, 5 hex><n, 3 hex><letter>h`.
    if let Ok(links) = run("ip", &["-o", "link", "show"]) {
        for host_if in links
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|n| n.split('@').next().unwrap_or(n))
            .filter(|n| n.len() == PREFIX.len() + 10 && n.starts_with(PREFIX) && n.ends_with('h'))
        {
            let owner = u32::from_str_radix(&host_if[PREFIX.len()..PREFIX.len() + 5], 16);
            if owner.is_ok_and(|pid| !alive(pid)) {
                let _ = run("ip", &["link", "del", host_if]);
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir(claims_dir()) {
        for entry in entries.flatten() {
            let owner = std::fs::read_to_string(entry.path())
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok());
            if owner.is_some_and(|pid| !alive(pid)) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// SIGKILLs every process still in namespace `name`: a process inside keeps a deleted
/// namespace (and its links) alive.
fn kill_inside(name: &str) {
    if let Ok(pids) = run("ip", &["netns", "pids", name]) {
        for pid in pids.lines().filter_map(|p| p.trim().parse::<i32>().ok()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// A `/30` of `10.200.0.0/16`, claimed across processes by creating its file.
struct Subnet {
    index: u32,
    claim: PathBuf,
}

impl Subnet {
    fn claim() -> anyhow::Result<Self> {
        let dir = claims_dir();
        std::fs::create_dir_all(&dir)?;
        // Start somewhere that depends on the pid, so parallel processes rarely collide.
        let start = std::process::id().wrapping_mul(7919) % 16_384;
        for step in 0..16_384 {
            let index = (start + step) % 16_384;
            let claim = dir.join(index.to_string());
            if let Ok(mut f) = std::fs::File::create_new(&claim) {
                use std::io::Write;
                let _ = write!(f, "{}", std::process::id());
                return Ok(Self { index, claim });
            }
        }
        bail!("no free /30 left in 10.200.0.0/16")
    }

    fn addr(&self, host: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 200, 0, 0)) + self.index * 4 + host)
    }
}

impl Drop for Subnet {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.claim);
    }
}

/// One veth pair between the host and a namespace.
pub struct Link {
    /// The host's end, `<PREFIX><id>h`.
    pub host_if: String,
    /// The namespace's end, `<PREFIX><id>n`.
    pub ns_if: String,
    pub host_addr: Ipv4Addr,
    /// The address a server in the namespace binds and the host connects to.
    pub ns_addr: Ipv4Addr,
    ns: String,
    subnet: Subnet,
}

impl Link {
    /// A partition: the namespace's end goes down. The host's route stays (the link has no
    /// carrier), so packets for `ns_addr` are dropped, never sent anywhere else: a
    /// connection hangs until its timeout, as across a real network.
    pub fn cut(&self) -> anyhow::Result<()> {
        run(
            "ip",
            &[
                "netns",
                "exec",
                &self.ns,
                "ip",
                "link",
                "set",
                &self.ns_if,
                "down",
            ],
        )
        .map(drop)
    }

    /// Ends the partition.
    pub fn heal(&self) -> anyhow::Result<()> {
        run(
            "ip",
            &[
                "netns",
                "exec",
                &self.ns,
                "ip",
                "link",
                "set",
                &self.ns_if,
                "up",
            ],
        )
        .map(drop)
    }

    /// Delays every packet from the host into the namespace by `delay` (`tc netem`), and
    /// drops `loss_percent` of them. An error when the kernel has no `sch_netem`.
    pub fn impair(&self, delay: Duration, loss_percent: f64) -> anyhow::Result<()> {
        let delay = format!("{}ms", delay.as_millis());
        let loss = format!("{loss_percent}%");
        run(
            "tc",
            &[
                "qdisc",
                "replace",
                "dev",
                &self.host_if,
                "root",
                "netem",
                "delay",
                &delay,
                "loss",
                &loss,
            ],
        )
        .map(drop)
        .context("tc netem (this kernel may lack sch_netem; see testkit::DelayProxy)")
    }

    /// Removes any delay or loss.
    pub fn clear(&self) -> anyhow::Result<()> {
        run("tc", &["qdisc", "del", "dev", &self.host_if, "root"]).map(drop)
    }

    /// The /30 this link uses, for people.
    pub fn subnet(&self) -> String {
        format!("{}/30 (#{})", self.host_addr, self.subnet.index)
    }
}

/// A network namespace of this harness, with its links; removed on drop.
pub struct Namespace {
    pub name: String,
    id: String,
    links: Vec<Link>,
}

impl Namespace {
    /// A fresh namespace with loopback up and no link yet.
    pub fn create() -> anyhow::Result<Self> {
        if !is_root() {
            bail!("network namespaces need root (CI runs as root)");
        }
        sweep_dead_owners();
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        // Interface names are at most 15 bytes: tk + 5 hex of the pid + 3 hex of a counter
        // + one letter per link and end.
        let id = format!("{PREFIX}{:05x}{:03x}", pid & 0xf_ffff, n & 0xfff);
        let name = format!("{PREFIX}-{pid}-{n}");
        // Before it exists: a signal from now on removes it.
        crate::group::sweep_on_fatal_signals();
        live(|l| l.insert(name.clone(), Default::default()));
        crate::lifeline::hold_namespace(&name);
        if let Err(e) = run("ip", &["netns", "add", &name]) {
            live(|l| l.remove(&name));
            crate::lifeline::release_namespace(&name);
            return Err(e);
        }
        let ns = Self {
            name,
            id,
            links: Vec::new(),
        };
        run(
            "ip",
            &["netns", "exec", &ns.name, "ip", "link", "set", "lo", "up"],
        )?;
        Ok(ns)
    }

    /// A new veth pair from the host into the namespace, both ends up; its index.
    pub fn add_link(&mut self) -> anyhow::Result<usize> {
        let i = self.links.len();
        let letter = (b'a' + i as u8) as char;
        let host_if = format!("{}{letter}h", self.id);
        let ns_if = format!("{}{letter}n", self.id);
        let subnet = Subnet::claim()?;
        live(|l| {
            if let Some((host_ifs, claims)) = l.get_mut(&self.name) {
                host_ifs.push(host_if.clone());
                claims.push(subnet.claim.clone());
            }
        });
        crate::lifeline::hold_link(&host_if);
        let (host_addr, ns_addr) = (subnet.addr(1), subnet.addr(2));
        run(
            "ip",
            &[
                "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if, "netns",
                &self.name,
            ],
        )?;
        let link = Link {
            host_if,
            ns_if,
            host_addr,
            ns_addr,
            ns: self.name.clone(),
            subnet,
        };
        // Pushed before it is configured, so that a failure below still removes it.
        self.links.push(link);
        let link = &self.links[i];
        run(
            "ip",
            &[
                "addr",
                "add",
                &format!("{host_addr}/30"),
                "dev",
                &link.host_if,
            ],
        )?;
        run("ip", &["link", "set", &link.host_if, "up"])?;
        let ns_cidr = format!("{ns_addr}/30");
        for args in [
            vec!["addr", "add", ns_cidr.as_str(), "dev", link.ns_if.as_str()],
            vec!["link", "set", link.ns_if.as_str(), "up"],
        ] {
            let mut full = vec!["netns", "exec", self.name.as_str(), "ip"];
            full.extend(args);
            run("ip", &full)?;
        }
        Ok(i)
    }

    pub fn link(&self, i: usize) -> &Link {
        &self.links[i]
    }

    pub fn links(&self) -> &[Link] {
        &self.links
    }

    /// `ip netns exec <name>` followed by `program`: what a process inside is started with.
    pub fn exec_prefix(&self) -> [&str; 3] {
        ["netns", "exec", &self.name]
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        kill_inside(&self.name);
        for link in &self.links {
            // Deleting one end deletes the pair.
            let _ = run("ip", &["link", "del", &link.host_if]);
            crate::lifeline::release_link(&link.host_if);
        }
        let _ = run("ip", &["netns", "del", &self.name]);
        // The subnets' claims go with the links.
        live(|l| l.remove(&self.name));
        crate::lifeline::release_namespace(&self.name);
    }
}
