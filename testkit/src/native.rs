//! `scripts/stack.sh`, the native stack of `make up`, run on free ports in a directory of
//! its own, so that tests can start, restart and stop it without touching a running demo.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The stack's services, in the order `stack.sh` starts them; each listens on the port of
/// the variable `<SERVICE>_PORT`.
pub const SERVICES: [&str; 7] = ["redis", "lock1", "lock2", "lock3", "app1", "app2", "nginx"];

/// One port per service of [`SERVICES`], in that order.
pub type Ports = [u16; SERVICES.len()];

/// Free ports for every service.
pub fn free_ports() -> Ports {
    SERVICES.map(|_| crate::free_port().expect("a free port"))
}

/// nginx's port: the stack's front door.
pub fn nginx_port(ports: &Ports) -> u16 {
    ports[SERVICES.len() - 1]
}

/// Runs `stack.sh <verb>` for the stack kept in `run_dir`, with `inventory` as its binary.
pub fn stack_script(
    script: &Path,
    run_dir: &Path,
    ports: &Ports,
    inventory: &Path,
    verb: &str,
) -> Output {
    let mut command = Command::new(script);
    command
        .arg(verb)
        .env("RUN_DIR", run_dir)
        .env("INVENTORY_BIN", inventory);
    for (service, port) in SERVICES.iter().zip(ports) {
        command.env(format!("{}_PORT", service.to_uppercase()), port.to_string());
    }
    command.output().expect("run scripts/stack.sh")
}

/// The pid files of a stack's services, in [`SERVICES`] order.
pub fn pid_files(run_dir: &Path) -> Vec<PathBuf> {
    SERVICES
        .iter()
        .map(|s| run_dir.join(format!("{s}.pid")))
        .collect()
}

/// Runs `stack.sh down` when dropped: a test that fails half-way (a panic) must not leave
/// its stack running. Harmless when the stack is already down.
pub struct DownOnDrop<'a> {
    pub script: &'a Path,
    pub run_dir: &'a Path,
    pub inventory: &'a Path,
}

impl Drop for DownOnDrop<'_> {
    fn drop(&mut self) {
        let _ = Command::new(self.script)
            .arg("down")
            .env("RUN_DIR", self.run_dir)
            .env("INVENTORY_BIN", self.inventory)
            .output();
    }
}
