//! Process groups: every child leads a group of its own ([`ProcessGroup`]) and is stopped by
//! signalling that group, so whatever it forked (nginx's workers, Redis's rewrite child) goes
//! with it, even once the leader is gone and they have been adopted by init. Also what tells
//! where a process belongs ([`ProcStat`]), for the tests that look for leftovers.

use std::collections::BTreeSet;
use std::process::ExitStatus;
use std::str::FromStr;
use std::sync::{Mutex, Once};
use std::time::Duration;

use anyhow::Context;
use nix::sys::signal::{Signal, kill, killpg};
use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
use nix::unistd::Pid;
use tokio::process::{Child, ChildStderr, ChildStdout, Command};
use tokio::time::Instant;

/// A child started as the leader of a new process group, stopped with its whole group: the
/// graceful signal, a bounded wait for the leader, then SIGKILL to every member left, then
/// the leader reaped. Killing only the leader is what left nginx's workers running, adopted
/// by init and still listening.
///
/// The group is signalled only while its leader is unreaped: a zombie still holds its pid,
/// so the group's id cannot have been handed to another process (with a `pid_max` of 32768
/// that happens within minutes on a busy machine). Nothing here reaps the leader except
/// [`kill`](Self::kill), which sweeps the group first.
///
/// Dropping it stops it the same way, synchronously (a `Drop` cannot await): a test that
/// panics still takes its processes with it.
pub struct ProcessGroup {
    child: Child,
    /// The leader's pid, which is also the group's id; `None` once the leader is reaped.
    pid: Option<Pid>,
    status: Option<ExitStatus>,
    graceful: Signal,
    grace: Duration,
}

/// How long a stop waits for the leader after the graceful signal before killing the group.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);

/// Bounds the wait for a leader that has been sent SIGKILL; only a process stuck in the
/// kernel could take longer.
const REAP_WITHIN: Duration = Duration::from_secs(5);

impl ProcessGroup {
    /// Spawns `command` in a new process group; `graceful` is what [`stop`](Self::stop)
    /// sends first (nginx's graceful stop is `SIGQUIT`, most others' `SIGTERM`).
    pub fn spawn(
        command: &mut Command,
        graceful: Signal,
        grace: Duration,
    ) -> std::io::Result<Self> {
        let child = command.process_group(0).kill_on_drop(false).spawn()?;
        let pid = child.id().map(|id| Pid::from_raw(id as i32));
        if let Some(pid) = pid {
            live_groups(|groups| groups.insert(pid.as_raw()));
            crate::lifeline::hold_group(pid.as_raw());
        }
        Ok(Self {
            child,
            pid,
            status: None,
            graceful,
            grace,
        })
    }

    pub fn id(&self) -> Option<u32> {
        self.pid.map(|pid| pid.as_raw() as u32)
    }

    pub fn take_stdout(&mut self) -> Option<ChildStdout> {
        self.child.stdout.take()
    }

    pub fn take_stderr(&mut self) -> Option<ChildStderr> {
        self.child.stderr.take()
    }

    /// Sends `signal` to the leader alone, as `kill PID` would.
    pub fn signal(&self, signal: Signal) -> anyhow::Result<()> {
        let pid = self.pid.context("the process has already been collected")?;
        kill(pid, signal).with_context(|| format!("kill -{signal} {pid}"))
    }

    fn signal_group(&self, signal: Signal) {
        if let Some(pid) = self.pid {
            // ESRCH only means that nothing is left in the group.
            let _ = killpg(pid, signal);
        }
    }

    /// Whether the leader has exited, without reaping it (so the group id stays ours).
    pub fn has_exited(&self) -> bool {
        let Some(pid) = self.pid else { return true };
        let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
        !matches!(waitid(Id::Pid(pid), flags), Ok(WaitStatus::StillAlive))
    }

    /// The graceful signal to the group (and `SIGCONT`, so a stopped process can act on
    /// it), up to the grace period for the leader to exit, then [`kill`](Self::kill).
    pub async fn stop(&mut self) -> Option<ExitStatus> {
        self.ask_to_exit();
        let deadline = Instant::now() + self.grace;
        while !self.has_exited() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.kill()
    }

    fn ask_to_exit(&self) {
        self.signal_group(self.graceful);
        self.signal_group(Signal::SIGCONT);
    }

    /// SIGKILL to everything left in the group, then reaps the leader; its exit status
    /// (the one it had already exited with, if it had).
    pub fn kill(&mut self) -> Option<ExitStatus> {
        if self.pid.is_none() {
            return self.status;
        }
        self.signal_group(Signal::SIGKILL);
        let deadline = std::time::Instant::now() + REAP_WITHIN;
        while std::time::Instant::now() < deadline {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    if let Some(pid) = self.pid.take() {
                        live_groups(|groups| groups.remove(&pid.as_raw()));
                        crate::lifeline::release_group(pid.as_raw());
                    }
                    self.status = Some(status);
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                Err(_) => break,
            }
        }
        self.status
    }

    /// Waits at most `within` for the leader to exit by itself (a crash, a signal the
    /// caller sent), then sweeps its group and reaps it; its exit status, if it did exit.
    pub async fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        while !self.has_exited() {
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.kill()
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        if self.pid.is_none() {
            return;
        }
        self.ask_to_exit();
        let deadline = std::time::Instant::now() + self.grace;
        while !self.has_exited() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill();
    }
}

/// Process groups started and not yet reaped, killed if this process is interrupted or
/// terminated: a group of its own no longer receives the terminal's Ctrl-C nor a test
/// runner's signal to the test's group, and a process killed by a signal runs no `Drop`.
static LIVE_GROUPS: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());

fn live_groups<T>(f: impl FnOnce(&mut BTreeSet<i32>) -> T) -> T {
    let mut groups = LIVE_GROUPS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let out = f(&mut groups);
    drop(groups);
    sweep_on_fatal_signals();
    out
}

/// Once per process: on SIGINT, SIGTERM or SIGHUP, kill every live group, remove every live
/// network namespace ([`crate::netns`]), and exit as the signal would have (128 + its
/// number). Its own runtime on its own thread, because the caller's may be a test's, gone
/// when that test ends.
pub(crate) fn sweep_on_fatal_signals() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        use tokio::signal::unix::{SignalKind, signal};
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        let kinds = [
            (SignalKind::interrupt(), Signal::SIGINT),
            (SignalKind::terminate(), Signal::SIGTERM),
            (SignalKind::hangup(), Signal::SIGHUP),
        ];
        // Registered before returning, so no group can outlive a signal sent from now on.
        let streams: Vec<_> = {
            let _entered = runtime.enter();
            kinds
                .into_iter()
                .filter_map(|(kind, number)| signal(kind).ok().map(|s| (s, number)))
                .collect()
        };
        std::thread::spawn(move || {
            runtime.block_on(async move {
                let waits = streams.into_iter().map(|(mut stream, number)| {
                    Box::pin(async move {
                        stream.recv().await;
                        number
                    })
                });
                let (number, _, _) = futures_util::future::select_all(waits).await;
                let groups = LIVE_GROUPS
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                for &pgid in groups.iter() {
                    let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
                }
                crate::netns::sweep_live();
                std::process::exit(128 + number as i32);
            })
        });
    });
}

/// One line of `/proc/PID/stat`, reduced to what tells where a process belongs.
#[derive(Debug, Clone)]
pub struct ProcStat {
    pub pid: u32,
    pub ppid: u32,
    pub pgrp: u32,
    /// `R`, `S`, `D`, `T`, `Z` (exited, waiting to be reaped), ...
    pub state: char,
    pub comm: String,
}

impl ProcStat {
    pub fn read(pid: u32) -> Option<Self> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        let (head, rest) = stat.rsplit_once(") ")?;
        let comm = head.split_once(" (")?.1.to_owned();
        let mut fields = rest.split_whitespace();
        let state = fields.next()?.chars().next()?;
        let ppid = fields.next()?.parse().ok()?;
        let pgrp = fields.next()?.parse().ok()?;
        Some(Self {
            pid,
            ppid,
            pgrp,
            state,
            comm,
        })
    }

    /// Every process on the machine (those that vanish while being read are skipped).
    pub fn all() -> Vec<Self> {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .filter_map(Self::read)
            .collect()
    }

    /// Exited but not reaped: a zombie holds no memory, no port and runs nothing.
    pub fn is_zombie(&self) -> bool {
        self.state == 'Z'
    }
}

/// The live members of process group `pgid`.
pub fn group_members(pgid: u32) -> Vec<ProcStat> {
    ProcStat::all()
        .into_iter()
        .filter(|p| p.pgrp == pgid && !p.is_zombie())
        .collect()
}

/// A signal by its name without the `SIG` prefix, as `kill -NAME` takes it.
pub fn signal_named(name: &str) -> anyhow::Result<Signal> {
    Signal::from_str(&format!("SIG{}", name.trim_start_matches("SIG")))
        .with_context(|| format!("no signal called {name}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::process::Stdio;

    use super::*;

    /// A shell that forks two children, like a master and its workers; all three ignore the
    /// graceful signals, like a server stuck in a request.
    fn stubborn_tree(grace: Duration) -> ProcessGroup {
        let mut command = Command::new("sh");
        command
            .args(["-c", "trap '' TERM QUIT; sleep 600 & sleep 600 & wait"])
            .stdin(Stdio::null());
        ProcessGroup::spawn(&mut command, Signal::SIGTERM, grace).unwrap()
    }

    async fn wait_for_members(pgid: u32, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while group_members(pgid).len() < n {
            assert!(Instant::now() < deadline, "the tree never grew to {n}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn assert_empty_soon(pgid: u32) {
        // SIGKILL is delivered asynchronously; a process adopted by init may still be on its
        // way out for a moment.
        let deadline = Instant::now() + Duration::from_secs(2);
        while !group_members(pgid).is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(group_members(pgid).is_empty(), "{:?}", group_members(pgid));
    }

    #[tokio::test]
    async fn a_stop_empties_the_group_even_when_it_ignores_the_graceful_signal() {
        let mut tree = stubborn_tree(Duration::from_millis(200));
        let pgid = tree.id().unwrap();
        wait_for_members(pgid, 3).await;
        let started = Instant::now();
        assert!(tree.stop().await.is_some(), "the leader is reaped");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "the wait is bounded"
        );
        assert_eq!(tree.id(), None);
        assert_empty_soon(pgid).await;
    }

    #[tokio::test]
    async fn dropping_a_group_takes_what_its_leader_forked() {
        let tree = stubborn_tree(Duration::from_millis(100));
        let pgid = tree.id().unwrap();
        wait_for_members(pgid, 3).await;
        drop(tree);
        assert_empty_soon(pgid).await;
    }

    /// The way the harness used to stop nginx: the leader killed alone leaves its children
    /// running. Waiting for the leader's exit sweeps them.
    #[tokio::test]
    async fn children_outlive_a_leader_killed_alone_until_the_group_is_swept() {
        let mut tree = stubborn_tree(Duration::from_millis(100));
        let pgid = tree.id().unwrap();
        wait_for_members(pgid, 3).await;
        tree.signal(Signal::SIGKILL).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            group_members(pgid).len(),
            2,
            "the children survive their leader"
        );
        let status = tree.wait_exit(Duration::from_secs(2)).await.unwrap();
        assert!(!status.success());
        assert_empty_soon(pgid).await;
    }

    #[test]
    fn signals_are_named_as_the_kill_command_names_them() {
        assert_eq!(signal_named("KILL").unwrap(), Signal::SIGKILL);
        assert_eq!(signal_named("SIGSTOP").unwrap(), Signal::SIGSTOP);
        assert!(signal_named("NOPE").is_err());
    }
}
