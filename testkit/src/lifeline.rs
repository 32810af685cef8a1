//! What a process of the harness started, removed by a keeper process when that process ends
//! however it ends, SIGKILL included: a `Drop` runs only on a normal end or a panic, and the
//! signal handler ([`crate::group`]) only on the signals a process may catch. A `scenarios`
//! run killed with SIGKILL left Redis, its sentinels and both instances running for good.
//!
//! The keeper is a `sh` in a process group of its own (so the terminal's Ctrl-C does not
//! reach it) that ignores the catchable signals and reads what to remove from a pipe whose
//! only writer is this process. When this process is gone, however, the pipe reaches its end
//! and the keeper removes what is still listed: every process group (SIGKILL), then every
//! network namespace, its processes and the host's ends of its links. What ends normally is
//! taken off the list first, so at a normal exit there is nothing left to remove. A group is
//! listed right after its spawn returns: one whose parent is killed in that instant escapes.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::{Mutex, PoisonError};

/// Lines `+g PGID`, `+n NAMESPACE`, `+i INTERFACE` add to the list, the same with `-` take
/// off it; at the end of the input, the list is removed: groups first (so nothing is left
/// to hold a namespace), then the namespaces' processes, the links, the namespaces.
const KEEPER: &str = r#"
trap '' INT TERM HUP PIPE
set --
while read -r op what; do
  entry="${op#?}:$what"
  case $op in
    +?) set -- "$@" "$entry" ;;
    -?) for e do shift; [ "$e" = "$entry" ] || set -- "$@" "$e"; done ;;
  esac
done
for e do case $e in g:*) kill -KILL "-${e#g:}" 2>/dev/null ;; esac; done
for e do case $e in n:*)
  for p in $(ip netns pids "${e#n:}" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done ;;
esac; done
for e do case $e in i:*) ip link del "${e#i:}" 2>/dev/null ;; esac; done
for e do case $e in n:*) ip netns del "${e#n:}" 2>/dev/null ;; esac; done
"#;

/// The keeper's end of the pipe; `None` until the first thing is listed, or when it could
/// not be started (then nothing is kept: the rest of the harness still cleans up).
static KEEPER_INPUT: Mutex<Option<ChildStdin>> = Mutex::new(None);

fn tell(line: &str) {
    let mut input = KEEPER_INPUT.lock().unwrap_or_else(PoisonError::into_inner);
    if input.is_none() {
        *input = start();
    }
    if let Some(pipe) = input.as_mut()
        && writeln!(pipe, "{line}").is_err()
    {
        *input = None;
    }
}

fn start() -> Option<ChildStdin> {
    // A session of its own where `setsid` is (util-linux): a kill of this process's whole
    // session (pkill -s) then spares it. A group of its own otherwise. A kill of everything
    // at once (a job's cgroup) takes it too; the next run's sweep removes what is left.
    let mut command = Command::new("setsid");
    command.arg("sh");
    if Command::new("setsid").arg("--version").output().is_err() {
        command = Command::new("sh");
        command.process_group(0);
    }
    let mut keeper = command
        .arg("-c")
        .arg(KEEPER)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    // Not waited for: it outlives this process by design, and init reaps it.
    keeper.stdin.take()
}

pub(crate) fn hold_group(pgid: i32) {
    tell(&format!("+g {pgid}"));
}

pub(crate) fn release_group(pgid: i32) {
    tell(&format!("-g {pgid}"));
}

pub(crate) fn hold_namespace(name: &str) {
    tell(&format!("+n {name}"));
}

pub(crate) fn release_namespace(name: &str) {
    tell(&format!("-n {name}"));
}

pub(crate) fn hold_link(host_if: &str) {
    tell(&format!("+i {host_if}"));
}

pub(crate) fn release_link(host_if: &str) {
    tell(&format!("-i {host_if}"));
}
