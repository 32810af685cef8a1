//! The binary's own output, outside the service: `--openapi` written to a stdout that
//! cannot take it.

use std::process::{Command, Stdio};

fn openapi_to(stdout: impl Into<Stdio>) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_inventory"))
        .arg("--openapi")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::piped())
        .output()
        .expect("inventory runs")
}

#[test]
fn openapi_to_a_reader_that_left_exits_quietly() {
    // `inventory --openapi | head -c 10`, with `head` gone before the first write: every
    // write fails with EPIPE, whatever the document's size against the pipe's buffer.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = openapi_to(writer);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{:?}: {stderr}", out.status);
    assert!(stderr.is_empty(), "a broken pipe is no error: {stderr}");
}

#[test]
fn openapi_to_the_first_bytes_of_a_pipe_exits_quietly() {
    // As `| head -c 10` does: read a little, then close.
    use std::io::Read;
    let mut child = Command::new(env!("CARGO_BIN_EXE_inventory"))
        .arg("--openapi")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 10];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap();
    assert_eq!(&first[..1], b"{");
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn openapi_to_a_full_disk_fails_with_one_line_and_no_panic() {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let out = openapi_to(full);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{:?}: {stderr}", out.status);
    assert_ne!(out.status.code(), Some(101), "a panic: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("error: cannot write the OpenAPI document to stdout: "),
        "{stderr}"
    );
}
