//! `scripts/stack.sh` refuses a setting it cannot use before it starts anything: an empty
//! one (which `${VAR:-default}` took for unset, so that `NGINX_PORT= scripts/stack.sh up`
//! ran nginx on 8080), and a number that is none (which bash's arithmetic met first, with
//! its own "value too great for base"). Every run here is given a binary that does not
//! exist: should a check be missing, `up` stops at that one, and starts nothing on a
//! default port either.

// A panic is how a test reports a failure.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Every service of every topology: each has a port variable `<SERVICE>_PORT`.
const SERVICES: [&str; 18] = [
    "nginx",
    "app1",
    "app2",
    "sentinel1",
    "sentinel2",
    "sentinel3",
    "replica1",
    "replica2",
    "redis",
    "node1",
    "node2",
    "node3",
    "node4",
    "node5",
    "node6",
    "lock1",
    "lock2",
    "lock3",
];

/// Settings of the caller's environment that must not reach the script.
const INHERITED: [&str; 8] = [
    "TOPOLOGY",
    "CLUSTER",
    "STACK_LOCKED",
    "LOCK_WAIT_MS",
    "MAX_WORK_MS",
    "REDIS_TIMEOUT_MS",
    "READY_TIMEOUT_S",
    "STOP_TIMEOUT_S",
];

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/stack.sh")
}

/// A run directory of the test's own, removed when dropped.
struct RunDir(PathBuf);

impl RunDir {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("stack-settings-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    /// What is in it: nothing but `up`'s lock file once `up` refused.
    fn entries(&self) -> Vec<String> {
        std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name != ".stack.lock")
            .collect()
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A free port for each service, no two the same (a cluster node's bus port, + 10000, is
/// valid too).
fn free_ports() -> BTreeMap<String, u16> {
    let mut taken = Vec::new();
    let mut ports = BTreeMap::new();
    for service in SERVICES {
        let port = (0..100)
            .map(|_| {
                if service.starts_with("node") {
                    testkit::free_cluster_port()
                } else {
                    testkit::free_port()
                }
                .unwrap()
            })
            .find(|port| !taken.contains(port))
            .expect("a free port");
        taken.push(port);
        ports.insert(format!("{}_PORT", service.to_uppercase()), port);
    }
    ports
}

/// The variables of the script's head with a default (`VAR=${VAR:-default}`), read from
/// the script itself, so that one added later is checked too.
fn defaulted_settings() -> Vec<String> {
    let text = std::fs::read_to_string(script()).unwrap();
    let mut names: Vec<String> = text
        .lines()
        .filter_map(|line| {
            let (name, value) = line.split_once('=')?;
            let plain = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
            (plain && value.contains(&format!("${{{name}:-"))).then(|| name.to_owned())
        })
        .collect();
    names.dedup();
    names
}

/// `stack.sh <verb>` on `run_dir` with every port set to `ports`, a binary that does not
/// exist, and `env` on top (an empty value set as such; `None` unsets the variable).
fn stack(
    verb: &str,
    run_dir: &Path,
    ports: &BTreeMap<String, u16>,
    env: &[(&str, Option<&str>)],
) -> Output {
    let mut command = Command::new(script());
    command.arg(verb);
    for var in defaulted_settings()
        .iter()
        .map(String::as_str)
        .chain(INHERITED)
    {
        command.env_remove(var);
    }
    command
        .env("RUN_DIR", run_dir)
        .env("INVENTORY_BIN", run_dir.join("no-such-inventory"));
    for (var, port) in ports {
        command.env(var, port.to_string());
    }
    for (var, value) in env {
        match value {
            Some(value) => command.env(var, value),
            None => command.env_remove(var),
        };
    }
    command.output().expect("run scripts/stack.sh")
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn listening(port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
}

/// `up` refused, saying `said`, with nothing started: no output of a start, no pid file or
/// log in the run directory, none of the ports taken.
fn assert_refused_before_anything(
    case: &str,
    up: &Output,
    said: &str,
    run_dir: &RunDir,
    ports: &BTreeMap<String, u16>,
) {
    let (stdout, stderr) = text(up);
    assert!(!up.status.success(), "{case}: {stdout}{stderr}");
    assert!(
        stderr.contains(said),
        "{case}: expected {said:?} in: {stderr}"
    );
    assert!(
        !stderr.contains("value too great for base") && !stderr.contains("syntax error"),
        "{case}: a raw bash error: {stderr}"
    );
    assert!(!stdout.contains("started"), "{case}: {stdout}");
    assert_eq!(run_dir.entries(), Vec::<String>::new(), "{case}: written");
    for (var, port) in ports {
        assert!(!listening(*port), "{case}: {var} {port} taken");
    }
}

/// `NGINX_PORT= scripts/stack.sh up` started nginx on 8080: an empty port is refused like
/// a wrong one, naming the valid ports, before anything starts.
#[test]
fn an_empty_port_is_refused_before_anything_starts_not_taken_for_the_default() {
    let run_dir = RunDir::new("empty-port");
    let ports = free_ports();
    let up = stack("up", &run_dir.0, &ports, &[("NGINX_PORT", Some(""))]);
    assert_refused_before_anything(
        "NGINX_PORT=''",
        &up,
        "NGINX_PORT is ''; valid: a port number in 1..=65535",
        &run_dir,
        &ports,
    );
}

/// Every variable of the script's head that has a default, set but empty, is refused by
/// name; unset, it still takes its default (the run then stops at the missing binary).
#[test]
fn every_defaulted_setting_set_empty_is_refused_by_name_and_unset_takes_its_default() {
    let settings = defaulted_settings();
    for expected in [
        "RUN_DIR",
        "NGINX_PORT",
        "NODE6_PORT",
        "REDIS_MASTER_NAME",
        "DOWN_AFTER_MS",
        "WORKER_THREADS",
        "INVENTORY_BIN",
        "NGINX_BIN",
        "READY_TIMEOUT_S",
        "STOP_TIMEOUT_S",
    ] {
        assert!(settings.iter().any(|s| s == expected), "{settings:?}");
    }
    let run_dir = RunDir::new("empty-each");
    let ports = free_ports();
    for var in &settings {
        let up = stack("up", &run_dir.0, &ports, &[(var, Some(""))]);
        assert_refused_before_anything(
            &format!("{var}=''"),
            &up,
            &format!("{var} is ''; valid: "),
            &run_dir,
            &ports,
        );
    }
    // Unset, a port is its default: the checks pass and `up` stops at the binary.
    let up = stack("up", &run_dir.0, &ports, &[("NGINX_PORT", None)]);
    assert_refused_before_anything("NGINX_PORT unset", &up, "no binary at", &run_dir, &ports);
}

/// A number the script computes with is checked first, for `up` and `down` alike: `1e3`
/// met bash's arithmetic (`locked` adds the timeouts) and its "value too great for base";
/// `08` is octal there.
#[test]
fn a_number_that_is_none_is_refused_by_the_script_naming_the_valid_values() {
    let run_dir = RunDir::new("numbers");
    let ports = free_ports();
    for (var, value, valid) in [
        (
            "READY_TIMEOUT_S",
            "1e3",
            "valid: a whole number of seconds in 1..=999999999",
        ),
        (
            "READY_TIMEOUT_S",
            "08",
            "valid: a whole number of seconds in 1..=999999999",
        ),
        (
            "STOP_TIMEOUT_S",
            "1e3",
            "valid: a whole number of seconds in 0..=999999999",
        ),
        (
            "DOWN_AFTER_MS",
            "0",
            "valid: a whole number of milliseconds in 1..=999999999",
        ),
        (
            "CLUSTER_NODE_TIMEOUT_MS",
            "1e3",
            "valid: a whole number of milliseconds in 1..=999999999",
        ),
        (
            "WORKER_THREADS",
            "0",
            "valid: a whole number of threads in 1..=1024",
        ),
        (
            "LOCK_WAIT_MS",
            "09",
            "valid: a whole number of milliseconds in 0..=999999999",
        ),
        ("NODE1_PORT", "08080", "valid: a port number in 1..=65535"),
        ("APP1_PORT", "65536", "valid: a port number in 1..=65535"),
    ] {
        let said = format!("{var} is '{value}'; {valid}");
        for verb in ["up", "down"] {
            let output = stack(verb, &run_dir.0, &ports, &[(var, Some(value))]);
            assert_refused_before_anything(
                &format!("{verb} {var}={value}"),
                &output,
                &said,
                &run_dir,
                &ports,
            );
        }
    }
}
