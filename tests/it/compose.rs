//! The compose stack, checked without a Docker engine: the Dockerfile's build command run on
//! the host, the compose file as `docker-compose` reads it, and the compose nginx
//! configuration run natively (service names mapped to loopback) for its retry rules,
//! client timeouts, per-client limits and JSON errors.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use nix::sys::signal::Signal;
use testkit::fixture::{Cluster, Stack};
use testkit::{DEFAULT_GRACE, ProcessGroup};

use crate::harness::{free_port, repo_path};

// ---------------------------------------------------------------------------------------
// The Dockerfile

/// Every `RUN` instruction of the Dockerfile, continuation lines joined.
fn dockerfile_runs(dockerfile: &str) -> Vec<String> {
    let mut runs = Vec::new();
    let mut current: Option<String> = None;
    for line in dockerfile.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') && current.is_none() {
            continue;
        }
        let (text, continues) = match trimmed.strip_suffix('\\') {
            Some(text) => (text.trim(), true),
            None => (trimmed, false),
        };
        match current.as_mut() {
            Some(run) => {
                run.push(' ');
                run.push_str(text);
            }
            None => match text.strip_prefix("RUN ") {
                Some(rest) => current = Some(rest.trim().to_owned()),
                None => continue,
            },
        }
        if !continues {
            runs.extend(current.take());
        }
    }
    runs
}

/// The `cargo build ...` commands of the Dockerfile, as argument lists.
fn dockerfile_cargo_builds(dockerfile: &str) -> Vec<Vec<String>> {
    dockerfile_runs(dockerfile)
        .iter()
        .flat_map(|run| run.split("&&").map(str::trim).map(str::to_owned))
        .filter(|command| command.starts_with("cargo build"))
        .map(|command| command.split_whitespace().map(str::to_owned).collect())
        .collect()
}

/// What the build stage copies in before its last `cargo build`: `COPY <src>... <dest>`
/// pairs relative to its WORKDIR (the `--from` copies belong to the runtime stage).
fn dockerfile_copies(dockerfile: &str) -> Vec<(String, String)> {
    let mut copies = Vec::new();
    let mut in_build_stage = false;
    for line in dockerfile.lines() {
        if let Some(from) = line.strip_prefix("FROM ") {
            in_build_stage = from.trim().ends_with(" AS build");
        }
        let Some(args) = line.trim().strip_prefix("COPY ").filter(|_| in_build_stage) else {
            continue;
        };
        let args: Vec<&str> = args.split_whitespace().collect();
        let (dest, sources) = args.split_last().expect("COPY has a destination");
        for source in sources {
            let name = Path::new(source).file_name().unwrap().to_str().unwrap();
            let target = if dest.ends_with('/') {
                format!("{dest}{name}")
            } else {
                (*dest).to_owned()
            };
            copies.push(((*source).to_owned(), target));
        }
    }
    copies
}

/// Copies `from` to `to` (a file or a tree), rewriting a file only when its content
/// changed, so that cargo's mtime-based freshness survives from one test run to the next.
fn sync(from: &Path, to: &Path, kept: &mut BTreeSet<PathBuf>) {
    if from.is_dir() {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            sync(&entry.path(), &to.join(entry.file_name()), kept);
        }
    } else {
        let content = std::fs::read(from).unwrap();
        if std::fs::read(to).ok().as_deref() != Some(&content[..]) {
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::write(to, &content).unwrap();
        }
        kept.insert(to.to_owned());
    }
}

fn remove_others(dir: &Path, kept: &BTreeSet<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            remove_others(&path, kept);
        } else if !kept.contains(&path) {
            std::fs::remove_file(&path).unwrap();
        }
    }
}

/// The image's build, on the host: the very `cargo build` the Dockerfile runs last, on a
/// copy of exactly what its COPY lines bring in, so a target that is not there (`--bin
/// loadtest` without `-p loadtest`), a missing COPY or a stale lock file fails here as it
/// would in `docker build`. Two differences, both outside target selection: the dev
/// profile instead of `--release` (minutes saved; the same units, the same errors), and a
/// target directory of its own, since a build without the tests' dev-dependencies compiles
/// some crates with other features and would swap `target/debug/inventory` under the tests
/// running next to this one.
#[test]
fn the_dockerfile_build_command_builds_on_the_host() {
    let dockerfile = std::fs::read_to_string(repo_path("Dockerfile")).unwrap();
    let builds = dockerfile_cargo_builds(&dockerfile);
    assert_eq!(
        builds.len(),
        2,
        "a dependency layer and the real build: {builds:?}"
    );
    assert_eq!(
        builds[0], builds[1],
        "the dependency layer must build what the real build builds, or it caches nothing"
    );
    let command = &builds[1];
    assert!(command.iter().any(|a| a == "--locked"), "{command:?}");

    // The context: what the build stage copies, minus what .dockerignore keeps out.
    let ignored = std::fs::read_to_string(repo_path(".dockerignore")).unwrap();
    let ignored: BTreeSet<&str> = ignored.lines().map(str::trim).collect();
    let context = repo_path("target/dockerfile-build/context");
    std::fs::create_dir_all(&context).unwrap();
    let mut kept = BTreeSet::new();
    for (source, dest) in dockerfile_copies(&dockerfile) {
        let top = source.split('/').next().unwrap();
        assert!(
            !ignored.contains(top),
            "COPY {source}: .dockerignore keeps it out of the context"
        );
        sync(&repo_path(&source), &context.join(dest), &mut kept);
    }
    remove_others(&context, &kept);

    let args: Vec<&str> = command[2..]
        .iter()
        .map(String::as_str)
        .filter(|a| *a != "--release")
        .collect();
    let output = Command::new(env!("CARGO"))
        .arg("build")
        .args(&args)
        .arg("--target-dir")
        .arg(repo_path("target/dockerfile-build/target"))
        .current_dir(&context)
        // Debug info only makes the link slower and the binaries bigger here.
        .env("CARGO_PROFILE_DEV_DEBUG", "0")
        .output()
        .expect("run cargo");
    assert!(
        output.status.success(),
        "the Dockerfile's `{}` fails on the host:\n{}",
        command.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );

    // The runtime stage copies binaries this build made.
    let copy = dockerfile
        .lines()
        .find(|l| l.starts_with("COPY --from=build"))
        .expect("the runtime stage copies the binaries");
    let binaries: Vec<&str> = copy.split_whitespace().collect();
    let binaries = &binaries[2..binaries.len() - 1];
    assert!(!binaries.is_empty());
    for binary in binaries {
        let relative = binary
            .strip_prefix("/src/target/release/")
            .unwrap_or_else(|| panic!("{binary} is not a release binary of the build stage"));
        let built = repo_path("target/dockerfile-build/target/debug").join(relative);
        assert!(built.is_file(), "the build makes no {}", built.display());
    }
}

#[test]
fn the_dockerfile_parser_reads_joined_runs_and_both_kinds_of_copy() {
    let dockerfile = "FROM a AS build\nWORKDIR /src\nCOPY x.toml y.lock ./\nCOPY d/Cargo.toml ./d/\n\
                      # RUN cargo build --commented\nRUN mkdir s \\\n    && cargo build -p a --locked \\\n    \
                      && rm -rf s\nCOPY src ./src\nRUN cargo build -p a --locked\n\
                      FROM b\nCOPY --from=build /src/target/release/a /usr/local/bin/\n";
    assert_eq!(
        dockerfile_cargo_builds(dockerfile),
        vec![
            vec!["cargo", "build", "-p", "a", "--locked"],
            vec!["cargo", "build", "-p", "a", "--locked"]
        ]
    );
    assert_eq!(
        dockerfile_copies(dockerfile),
        [
            ("x.toml", "./x.toml"),
            ("y.lock", "./y.lock"),
            ("d/Cargo.toml", "./d/Cargo.toml"),
            ("src", "./src")
        ]
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
    );
}

// ---------------------------------------------------------------------------------------
// The compose file

/// `docker-compose config` with `.env.example`'s values, and `vars` set on top; variables
/// the test does not name are removed, so the defaults are what is checked.
fn compose_config(vars: &[(&str, &str)]) -> serde_yaml::Value {
    let mut command = Command::new("docker-compose");
    command
        .current_dir(repo_path(""))
        .args(["--env-file", ".env.example", "config"])
        .env_remove("PUBLISH_ADDR")
        .env_remove("SENTINEL_NGINX_PORT")
        .env_remove("CLUSTER_NGINX_PORT");
    for (key, value) in vars {
        command.env(key, value);
    }
    let output = command
        .output()
        .expect("docker-compose is not installed (`make test` installs it)");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_yaml::from_slice(&output.stdout).unwrap()
}

/// Every published port of every service, as (host address, host port).
fn published(config: &serde_yaml::Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (name, service) in config["services"].as_mapping().unwrap() {
        let Some(ports) = service.get("ports").and_then(|p| p.as_sequence()) else {
            continue;
        };
        for port in ports {
            // docker-compose 1.x prints the short form, "ADDR:HOST:CONTAINER/proto"; a
            // port without an address is published on every interface.
            let spec = port
                .as_str()
                .unwrap_or_else(|| panic!("{name:?}: unexpected port form {port:?}"));
            let spec = spec.split('/').next().unwrap();
            let parts: Vec<&str> = spec.rsplitn(3, ':').collect();
            let (address, host_port) = match parts.as_slice() {
                [_, host, address] => ((*address).to_owned(), (*host).to_owned()),
                [_, host] => ("0.0.0.0".to_owned(), (*host).to_owned()),
                _ => ("0.0.0.0".to_owned(), spec.to_owned()),
            };
            out.push((address, host_port));
        }
    }
    out
}

/// The compose profiles besides the default services (`docker compose --profile NAME`).
const PROFILES: [&str; 2] = ["sentinel", "cluster"];

#[test]
fn the_compose_file_publishes_only_on_loopback_unless_told_otherwise() {
    let profile_args = [vec![]].into_iter().chain(
        PROFILES
            .iter()
            .map(|p| vec!["--profile".to_owned(), (*p).to_owned()]),
    );
    for profile in profile_args {
        let quiet = Command::new("docker-compose")
            .current_dir(repo_path(""))
            .args(&profile)
            .args(["--env-file", ".env.example", "config", "-q"])
            .env_remove("PUBLISH_ADDR")
            .env_remove("SENTINEL_NGINX_PORT")
            .env_remove("CLUSTER_NGINX_PORT")
            .output()
            .expect("docker-compose");
        assert!(
            quiet.status.success(),
            "docker-compose {profile:?} config -q: {}",
            String::from_utf8_lossy(&quiet.stderr)
        );
    }

    // `config` lists the profiles' services too: the default nginx, the sentinel one and
    // the cluster one, and nothing else.
    let sorted = |mut ports: Vec<(String, String)>| {
        ports.sort();
        ports
    };
    let expected = |addr: &str| {
        ["8080", "8081", "8082"]
            .map(|p| (addr.to_owned(), p.to_owned()))
            .to_vec()
    };
    let ports = published(&compose_config(&[]));
    assert_eq!(sorted(ports), expected("127.0.0.1"));

    let opened = published(&compose_config(&[("PUBLISH_ADDR", "0.0.0.0")]));
    assert_eq!(sorted(opened), expected("0.0.0.0"));
    let example = std::fs::read_to_string(repo_path(".env.example")).unwrap();
    assert!(
        example.contains("PUBLISH_ADDR="),
        ".env.example documents it"
    );
}

#[test]
fn the_parser_of_published_ports_sees_every_interface() {
    let config: serde_yaml::Value = serde_yaml::from_str(
        "services:\n  a:\n    ports: ['8080:80/tcp', '127.0.0.1:81:81/tcp', '9000']\n  b: {}\n",
    )
    .unwrap();
    assert_eq!(
        published(&config),
        [
            ("0.0.0.0", "8080"),
            ("127.0.0.1", "81"),
            ("0.0.0.0", "9000")
        ]
        .map(|(a, p)| (a.to_owned(), p.to_owned()))
    );
}

#[test]
fn the_compose_services_are_hardened_as_documented() {
    let config = compose_config(&[]);
    let services = &config["services"];

    // Redis: its own user (the entrypoint drops to it only for a `redis-server` command),
    // the password required, the append-only file on, a volume for it, not published.
    let redis = &services["redis"];
    let command: Vec<&str> = redis["command"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(command[0], "redis-server", "{command:?}");
    let arg = |name: &str| {
        command
            .iter()
            .position(|a| *a == name)
            .map(|i| command[i + 1])
    };
    assert_eq!(arg("--requirepass"), Some("change-me-redis-password"));
    assert_eq!(arg("--appendonly"), Some("yes"));
    assert_eq!(arg("--appendfsync"), Some("everysec"));
    let volumes = serde_yaml::to_string(&redis["volumes"]).unwrap();
    assert!(volumes.contains(":/data"), "{volumes}");
    assert!(redis.get("ports").is_none(), "Redis must not be published");

    // Every long-running service comes back by itself.
    for name in ["redis", "app1", "app2", "nginx"] {
        assert_eq!(
            services[name]["restart"].as_str(),
            Some("unless-stopped"),
            "{name}"
        );
    }

    // One image, built once: app1 builds it, app2 runs the same name without building.
    assert_eq!(
        services["app1"]["image"], services["app2"]["image"],
        "both instances run one image"
    );
    assert!(services["app1"].get("build").is_some());
    assert!(services["app2"].get("build").is_none(), "built twice");

    // nginx exempts the host's clients by the compose network's subnet: the two agree.
    let subnet = config["networks"]["default"]["ipam"]["config"][0]["subnet"]
        .as_str()
        .expect("a fixed subnet for the compose network")
        .to_owned();
    let nginx = std::fs::read_to_string(repo_path("nginx/nginx.conf")).unwrap();
    assert!(
        nginx
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == [subnet.as_str(), "1;"]),
        "nginx.conf's geo must exempt {subnet}"
    );
    // The nginx image understands `resolve` (open source since 1.27.3).
    let image = services["nginx"]["image"].as_str().unwrap();
    let version = image
        .trim_start_matches("nginx:")
        .split('-')
        .next()
        .unwrap();
    let version: Vec<u32> = version.split('.').map(|v| v.parse().unwrap()).collect();
    assert!(version >= vec![1, 27], "{image}");
    if version[..2] == [1, 27] {
        assert!(version.len() == 3 && version[2] >= 3, "{image}");
    }

    let ignored = std::fs::read_to_string(repo_path(".dockerignore")).unwrap();
    assert!(
        ignored.lines().any(|l| l.trim() == ".env"),
        "the secrets in .env must stay out of the build context"
    );
}

#[test]
fn the_compose_file_agrees_with_the_native_stack() {
    let config = compose_config(&[]);
    let services = &config["services"];

    // Every variable the compose file gives an instance is one the binary reads.
    let help = Command::new(env!("CARGO_BIN_EXE_inventory"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    let script = std::fs::read_to_string(repo_path("scripts/stack.sh")).unwrap();
    for (app, port) in [("app1", "7777"), ("app2", "8888")] {
        let env = services[app]["environment"].as_mapping().unwrap();
        for key in env.keys() {
            let key = key.as_str().unwrap();
            assert!(
                help.contains(&format!("[env: {key}")),
                "{app} sets {key}, unknown to inventory"
            );
        }
        assert_eq!(env["PORT"].as_str(), Some(port));
        assert_eq!(env["INSTANCE_NAME"].as_str(), Some(app));
        let default = format!(
            "{}_PORT=${{{}_PORT:-{port}}}",
            app.to_uppercase(),
            app.to_uppercase()
        );
        assert!(
            script.contains(&default),
            "the native stack puts {app} on {port} too"
        );
        assert!(
            env["REDIS_URL"]
                .as_str()
                .unwrap()
                .contains("change-me-redis-password@redis"),
            "instances authenticate to Redis"
        );
    }
    // The variables the native stack sets are the binary's as well.
    for key in ["PORT", "BIND_ADDR", "INSTANCE_NAME", "REDIS_URL"] {
        assert!(script.contains(&format!("{key}=")) && help.contains(&format!("[env: {key}")));
    }
    assert!(script.contains("NGINX_PORT=${NGINX_PORT:-8080}"));
    let nginx = std::fs::read_to_string(repo_path("nginx/nginx.conf")).unwrap();
    assert!(nginx.contains("server app1:7777 ") && nginx.contains("server app2:8888 "));
    assert!(nginx.contains("listen 8080;"));
}

/// The `command` (or `entrypoint`) of a service as its words.
fn words(service: &serde_yaml::Value, key: &str) -> Vec<String> {
    service[key]
        .as_sequence()
        .unwrap_or_else(|| panic!("no {key} list: {service:?}"))
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect()
}

fn profiles_of(service: &serde_yaml::Value) -> Vec<&str> {
    service
        .get("profiles")
        .and_then(|p| p.as_sequence())
        .map(|p| p.iter().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default()
}

/// The profiles have the shapes of the native topologies (`make up TOPOLOGY=sentinel`,
/// `CLUSTER=1`): a master, two replicas of it and three sentinels with a quorum of two in
/// front of two instances that find the master through them, and nginx; six cluster nodes
/// joined once. What Docker must not restart by itself is `restart: "no"`.
#[test]
fn the_compose_profiles_have_the_shapes_of_the_native_topologies() {
    let config = compose_config(&[]);
    let services = config["services"].as_mapping().unwrap();
    let in_profile = |profile: &str| -> Vec<String> {
        services
            .iter()
            .filter(|(_, s)| profiles_of(s).contains(&profile))
            .map(|(name, _)| name.as_str().unwrap().to_owned())
            .collect()
    };
    // The default services stay in no profile: `docker compose up` is the single stack.
    for name in ["redis", "lock1", "lock2", "lock3", "app1", "app2", "nginx"] {
        assert!(profiles_of(&config["services"][name]).is_empty(), "{name}");
    }

    let sentinel = in_profile("sentinel");
    let mut expected = vec![
        "sentinel-master",
        "sentinel-replica1",
        "sentinel-replica2",
        "sentinel1",
        "sentinel2",
        "sentinel3",
        "sentinel-app1",
        "sentinel-app2",
        "sentinel-nginx",
    ];
    expected.sort();
    let mut got = sentinel.clone();
    got.sort();
    assert_eq!(got, expected);
    let service = |name: &str| &config["services"][name];
    for replica in ["sentinel-replica1", "sentinel-replica2"] {
        let command = words(service(replica), "command").join(" ");
        assert!(
            command.contains("--replicaof sentinel-master 6379"),
            "{command}"
        );
    }
    for server in ["sentinel-master", "sentinel-replica1", "sentinel-replica2"] {
        assert_eq!(service(server)["restart"].as_str(), Some("no"), "{server}");
        assert!(
            service(server).get("ports").is_none(),
            "{server} is published"
        );
        let command = words(service(server), "command").join(" ");
        assert!(command.contains("--appendonly yes"), "{server}: {command}");
        // `.env.example`'s password, required of clients and given to its master.
        assert!(
            command.contains("--requirepass change-me-redis-password")
                && command.contains("--masterauth change-me-redis-password"),
            "{server}: {command}"
        );
    }
    let conf = std::fs::read_to_string(repo_path("redis/sentinel.conf")).unwrap();
    assert!(
        conf.lines()
            .any(|l| l == "sentinel monitor inventory sentinel-master 6379 2"),
        "{conf}"
    );
    for name in ["sentinel1", "sentinel2", "sentinel3"] {
        let entrypoint = words(service(name), "entrypoint").join(" ");
        assert!(
            entrypoint.contains("redis-server /data/sentinel.conf --sentinel")
                && entrypoint.contains("requirepass")
                && entrypoint.contains("sentinel auth-pass inventory"),
            "{entrypoint}"
        );
        let volumes = serde_yaml::to_string(&service(name)["volumes"]).unwrap();
        assert!(volumes.contains("redis/sentinel.conf"), "{volumes}");
    }
    let help = Command::new(env!("CARGO_BIN_EXE_inventory"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for app in ["sentinel-app1", "sentinel-app2"] {
        let env = known_environment(service(app), app, &help);
        assert!(
            env.get("REDIS_URL").is_none(),
            "{app} must ask the sentinels"
        );
        assert_eq!(
            env["REDIS_SENTINELS"].as_str(),
            Some("sentinel1:26379,sentinel2:26379,sentinel3:26379")
        );
        for key in ["REDIS_SENTINEL_PASSWORD", "REDIS_MASTER_PASSWORD"] {
            assert_eq!(
                env[key].as_str(),
                Some("change-me-redis-password"),
                "{app}: {key}"
            );
        }
        assert!(conf.contains(&format!(
            "monitor {} ",
            env["REDIS_MASTER_NAME"].as_str().unwrap()
        )));
    }
    // Its nginx (the same nginx.conf) finds the profile's instances as app1 and app2 on the
    // profile's network, which nginx.conf exempts from the per-client limits like the
    // default one.
    let aliases = serde_yaml::to_string(&service("sentinel-app1")["networks"]).unwrap();
    assert!(aliases.contains("- app1"), "{aliases}");
    let subnet = config["networks"]["sentinel"]["ipam"]["config"][0]["subnet"]
        .as_str()
        .unwrap()
        .to_owned();
    let nginx = std::fs::read_to_string(repo_path("nginx/nginx.conf")).unwrap();
    assert!(
        nginx
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == [subnet.as_str(), "1;"]),
        "nginx.conf's geo must exempt {subnet}"
    );

    let cluster = in_profile("cluster");
    assert_eq!(cluster.len(), 10, "{cluster:?}");
    for n in 1..=6 {
        let node = service(&format!("cluster-node{n}"));
        assert_eq!(node["restart"].as_str(), Some("no"), "cluster-node{n}");
        assert!(node.get("ports").is_none());
        let command = words(node, "command").join(" ");
        assert!(
            command.contains("--cluster-enabled yes") && command.contains("--requirepass"),
            "{command}"
        );
    }
    let create = service("cluster-create");
    assert_eq!(create["restart"].as_str(), Some("no"));
    let script = words(create, "entrypoint").join(" ");
    assert!(
        script.contains("--cluster create") && script.contains("--cluster-replicas 1"),
        "{script}"
    );
    assert!(
        services
            .iter()
            .filter(|(name, s)| profiles_of(s).contains(&"cluster") && *name != "cluster-nginx")
            .all(|(_, s)| s.get("ports").is_none()),
        "only the cluster profile's nginx is published"
    );
    // Its instances start once the cluster is formed, are seeded with all six nodes, and
    // set nothing the service does not know.
    for app in ["cluster-app1", "cluster-app2"] {
        let env = known_environment(service(app), app, &help);
        assert!(env.get("REDIS_URL").is_none(), "{app} must use the cluster");
        let seeds = env["REDIS_CLUSTER"].as_str().unwrap();
        for n in 1..=6 {
            assert!(seeds.contains(&format!("@cluster-node{n}:6379")), "{seeds}");
        }
        let after = serde_yaml::to_string(&service(app)["depends_on"]["cluster-create"]).unwrap();
        assert!(after.contains("service_completed_successfully"), "{after}");
    }
    let aliases = serde_yaml::to_string(&service("cluster-app2")["networks"]).unwrap();
    assert!(aliases.contains("- app2"), "{aliases}");
    let subnet = config["networks"]["cluster"]["ipam"]["config"][0]["subnet"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        nginx
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == [subnet.as_str(), "1;"]),
        "nginx.conf's geo must exempt {subnet}"
    );
}

/// An instance's environment, every variable of which `inventory --help` (`help`) names.
fn known_environment<'a>(
    service: &'a serde_yaml::Value,
    app: &str,
    help: &str,
) -> &'a serde_yaml::Mapping {
    let env = service["environment"].as_mapping().unwrap();
    for key in env.keys() {
        let key = key.as_str().unwrap();
        assert!(
            help.contains(&format!("[env: {key}")),
            "{app} sets {key}, unknown to inventory"
        );
    }
    env
}

// ---------------------------------------------------------------------------------------
// nginx, run natively on the compose configuration

fn nginx_binary() -> &'static str {
    ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("nginx is not installed (`make test` installs it: apt-get install nginx)")
}

/// The host nginx's version, from `nginx -v`.
fn nginx_version() -> Vec<u32> {
    let output = Command::new(nginx_binary()).arg("-v").output().unwrap();
    let text = String::from_utf8_lossy(&output.stderr);
    let version = text
        .split("nginx/")
        .nth(1)
        .and_then(|v| v.split_whitespace().next())
        .unwrap_or_else(|| panic!("no version in {text:?}"));
    version.split('.').map(|v| v.parse().unwrap()).collect()
}

fn replace_once(text: &str, from: &str, to: &str, file: &str) -> String {
    assert_eq!(
        text.matches(from).count(),
        1,
        "{file}: expected `{from}` exactly once"
    );
    text.replacen(from, to, 1)
}

/// Which configuration to run.
#[derive(Clone, Copy)]
enum Conf {
    /// `nginx/nginx.conf`, the compose one.
    Compose,
    /// `nginx/nginx.native.conf.template`, the one `make up` and the harness run.
    Native,
}

/// A test's change to one of the three files, on top of what running natively needs:
/// (file, text, replacement), the text to be found exactly once.
type Edit<'a> = (&'a str, &'a str, &'a str);

/// Writes nginx.conf, http.conf and locations.conf into `dir`, runnable here on `port` in
/// front of `upstreams`. For the compose file, with the fewest changes: the service names
/// become loopback addresses and ports, the includes and the access log point into `dir`,
/// and `resolve` goes when the host's nginx predates it (1.27.3; Debian's is older).
fn render(conf: Conf, dir: &Path, port: u16, upstreams: [u16; 2], edits: &[Edit]) -> PathBuf {
    let read = |name: &str| std::fs::read_to_string(repo_path(&format!("nginx/{name}"))).unwrap();
    let dir_text = dir.display().to_string();
    let main = match conf {
        Conf::Compose => {
            let mut text = read("nginx.conf");
            let f = "nginx.conf";
            for (name, service_port, upstream) in
                [("app1", 7777, upstreams[0]), ("app2", 8888, upstreams[1])]
            {
                text = replace_once(
                    &text,
                    &format!("server {name}:{service_port} "),
                    &format!("server 127.0.0.1:{upstream} "),
                    f,
                );
            }
            text = replace_once(
                &text,
                "listen 8080;",
                &format!("listen 127.0.0.1:{port};"),
                f,
            );
            for include in ["http.conf", "locations.conf"] {
                text = replace_once(
                    &text,
                    &format!("/etc/nginx/{include}"),
                    &format!("{dir_text}/{include}"),
                    f,
                );
            }
            text = replace_once(
                &text,
                "access_log /dev/stdout",
                &format!("access_log {dir_text}/nginx-access.log"),
                f,
            );
            if nginx_version() < vec![1, 27, 3] {
                assert_eq!(text.matches(" resolve ").count(), 2, "{f}: resolve");
                text = text.replace(" resolve ", " ");
            }
            text
        }
        Conf::Native => {
            std::fs::create_dir_all(dir.join("nginx-tmp")).unwrap();
            read("nginx.native.conf.template")
                .replace("@RUN_DIR@", &dir_text)
                .replace("@CONF_DIR@", &dir_text)
                .replace("@NGINX_PORT@", &port.to_string())
                .replace("@APP1_PORT@", &upstreams[0].to_string())
                .replace("@APP2_PORT@", &upstreams[1].to_string())
                .replace("@PROXY_READ_TIMEOUT@", "20s")
        }
    };
    let mut files = vec![
        ("nginx.conf", main),
        ("http.conf", read("http.conf")),
        ("locations.conf", read("locations.conf")),
    ];
    for (file, from, to) in edits {
        let entry = files
            .iter_mut()
            .find(|(name, _)| name == file)
            .unwrap_or_else(|| panic!("no file {file}"));
        entry.1 = replace_once(&entry.1, from, to, file);
    }
    for (name, text) in &files {
        std::fs::write(dir.join(name), text).unwrap();
    }
    dir.join("nginx.conf")
}

fn nginx_command(conf: Conf, dir: &Path, path: &Path) -> Command {
    let mut command = Command::new(nginx_binary());
    command
        .arg("-p")
        .arg(dir)
        .arg("-c")
        .arg(path)
        .arg("-e")
        .arg(dir.join("nginx-error.log"));
    if let Conf::Compose = conf {
        // The image's nginx keeps its pid file where root can write; here, in `dir`.
        command
            .arg("-g")
            .arg(format!("pid {}/nginx.pid;", dir.display()));
    }
    command
}

/// nginx on a rendered configuration, killed on drop.
/// nginx in its own process group: stopping (or dropping) it stops its workers too, which a
/// kill of the master alone leaves running.
struct Proxy {
    process: ProcessGroup,
    port: u16,
    dir: TempDir,
}

impl Proxy {
    async fn start(conf: Conf, upstreams: [u16; 2], edits: &[Edit<'_>]) -> Self {
        let mut last_log = String::new();
        for _ in 0..5 {
            let dir = tempfile::tempdir().unwrap();
            let port = free_port();
            let path = render(conf, dir.path(), port, upstreams, edits);
            let mut command = nginx_command(conf, dir.path(), &path);
            command
                .args(["-g", "daemon off;"])
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let mut command = tokio::process::Command::from(command);
            let process = ProcessGroup::spawn(&mut command, Signal::SIGQUIT, DEFAULT_GRACE)
                .expect("run nginx");
            let proxy = Proxy { process, port, dir };
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if proxy.process.has_exited() {
                    break;
                }
                if TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
                    return proxy;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            last_log = std::fs::read_to_string(proxy.dir.path().join("nginx-error.log"))
                .unwrap_or_default();
        }
        panic!("nginx did not start; its error log:\n{last_log}");
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn access_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("nginx-access.log")).unwrap_or_default()
    }
}

#[test]
fn the_compose_nginx_conf_passes_nginx_t_with_the_service_names_on_loopback() {
    for conf in [Conf::Compose, Conf::Native] {
        let dir = tempfile::tempdir().unwrap();
        let path = render(conf, dir.path(), free_port(), [7777, 8888], &[]);
        let output = nginx_command(conf, dir.path(), &path)
            .arg("-t")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{text}");
        // A warning is a setting nginx ignores or overrides: not what the file says.
        assert!(!text.contains("[warn]"), "{text}");
    }
}

/// What a test looks at in an answer.
#[derive(Debug)]
struct Answer {
    status: u16,
    instance: Option<String>,
    content_type: Option<String>,
    body: Value,
    elapsed: Duration,
}

async fn send(request: reqwest::RequestBuilder) -> Answer {
    let started = Instant::now();
    let response = request.send().await.expect("nginx answers");
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let instance = header("x-instance");
    let content_type = header("content-type");
    let status = response.status().as_u16();
    let text = response.text().await.unwrap_or_default();
    Answer {
        status,
        instance,
        content_type,
        body: serde_json::from_str(&text).unwrap_or(Value::String(text)),
        elapsed: started.elapsed(),
    }
}

/// Asserts that an answer is nginx's own JSON error with this status and code.
fn assert_nginx_error(answer: &Answer, status: u16, code: &str) {
    assert_eq!(answer.status, status, "{answer:?}");
    assert_eq!(answer.instance.as_deref(), Some("nginx"), "{answer:?}");
    assert_eq!(
        answer.content_type.as_deref(),
        Some("application/json"),
        "{answer:?}"
    );
    assert_eq!(answer.body["error"], code, "{answer:?}");
    assert!(
        answer.body["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty())
    );
}

/// A port nothing listens on: a connection to it is refused at once.
fn refused_port() -> u16 {
    free_port()
}

/// A listener that completes no more connections: with a backlog of 0 and one connection
/// already queued, the kernel drops every further SYN, and a connect times out. That is
/// what a stopped container's address does (its packets go nowhere), here on loopback.
struct Blackhole {
    port: u16,
    _listener: tokio::net::TcpListener,
    _queued: Vec<std::net::TcpStream>,
}

impl Blackhole {
    fn new() -> Self {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(0).unwrap();
        let port = listener.local_addr().unwrap().port();
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let queued = (0..2)
            .filter_map(|_| {
                std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()
            })
            .collect();
        let hole = Self {
            port,
            _listener: listener,
            _queued: queued,
        };
        assert!(
            std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err(),
            "the blackhole still completes connections"
        );
        hole
    }
}

/// A stream of ordinary requests through the compose nginx with one instance dead: every
/// one answers 200 from the live instance, and only the first request that meets the dead
/// one pays for it; then the instance is marked down and no request tries it. Returns how
/// long nginx spent on the dead instance, from its access log (load on the machine does not
/// blur it, unlike the client's clock).
async fn every_request_succeeds_with_one_instance(dead: u16) -> Duration {
    let cluster = Cluster::start(1, |b| b).await;
    let live = &cluster.instances[0];
    live.reset(1000).await;
    let nginx = Proxy::start(Conf::Compose, [dead, live.port], &[]).await;
    let http = reqwest::Client::new();

    let started = Instant::now();
    let mut answers = Vec::new();
    // The first two requests meet the dead instance one way or the other (round robin);
    // after that it is marked down, and even a GET sale, never retried, goes to the live one.
    for round in 0..10 {
        answers.push(send(http.post(nginx.url("/inventory/sale?strategy=atomic"))).await);
        answers.push(send(http.get(nginx.url("/inventory"))).await);
        if round > 0 {
            answers.push(send(http.get(nginx.url("/inventory/sale?strategy=atomic"))).await);
            answers.push(send(http.get(nginx.url("/health"))).await);
        }
    }
    let took = started.elapsed();

    for answer in &answers {
        assert_eq!(answer.status, 200, "{answer:?}");
        assert_eq!(answer.instance.as_deref(), Some(live.name.as_str()));
        // Before, a request meeting a stopped instance waited 1 s for a 504.
        assert!(answer.elapsed < Duration::from_secs(1), "{answer:?}");
    }
    let log = nginx.access_log();
    let attempts: Vec<&str> = log.lines().filter(|l| tried(l, dead)).collect();
    // fail_timeout (5 s) keeps it marked down; a slower run may try it once more.
    let allowed = 1 + (took.as_secs() / 5) as usize;
    assert!(
        !attempts.is_empty() && attempts.len() <= allowed,
        "the dead instance is tried once, then marked down, in {took:?}:\n{log}"
    );
    let audit = live.audit().await;
    assert_eq!(audit["sales"], 19, "every sale sold exactly once: {audit}");
    // `upstream_time=<dead>, <live>`: the time spent on the dead one.
    let spent = attempts[0]
        .split("upstream_time=")
        .nth(1)
        .and_then(|t| t.split(',').next())
        .and_then(|t| t.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no upstream time in {}", attempts[0]));
    Duration::from_secs_f64(spent)
}

/// Whether an access log line shows an attempt on the upstream at `port`.
fn tried(line: &str, port: u16) -> bool {
    let address = format!("127.0.0.1:{port}");
    line.contains(&format!("{address},")) || line.contains(&format!("{address} "))
}

#[tokio::test(flavor = "multi_thread")]
async fn an_instance_that_refuses_connections_is_invisible_to_clients() {
    let spent = every_request_succeeds_with_one_instance(refused_port()).await;
    assert!(spent < Duration::from_millis(100), "{spent:?}");
}

/// A stopped container's address does not refuse: the connect times out. Before, that cost
/// each request meeting it a 1 s wait and a 504.
#[tokio::test(flavor = "multi_thread")]
async fn an_instance_whose_address_drops_connects_costs_one_request_300_ms_and_no_error() {
    let hole = Blackhole::new();
    let spent = every_request_succeeds_with_one_instance(hole.port).await;
    assert!(
        spent >= Duration::from_millis(290) && spent < Duration::from_millis(600),
        "proxy_connect_timeout is 300 ms: {spent:?}"
    );
}

/// With both instances gone, nginx answers itself, in the JSON error shape.
#[tokio::test(flavor = "multi_thread")]
async fn nginx_errors_are_json_with_x_instance_nginx() {
    let nginx = Proxy::start(Conf::Compose, [refused_port(), refused_port()], &[]).await;
    let http = reqwest::Client::new();

    let gone = send(http.post(nginx.url("/inventory/sale"))).await;
    assert_nginx_error(&gone, 502, "instance_failed");
    let long_uri = format!("/{}", "a".repeat(9000));
    assert_nginx_error(
        &send(http.get(nginx.url(&long_uri))).await,
        414,
        "uri_too_long",
    );
    let big_body = http
        .put(nginx.url("/inventory"))
        .header("content-type", "application/json")
        .body(vec![b' '; 20_000]);
    assert_nginx_error(&send(big_body).await, 413, "payload_too_large");
    let big_header = http
        .get(nginx.url("/health"))
        .header("x-big", "a".repeat(9000));
    assert_nginx_error(&send(big_header).await, 431, "headers_too_large");
    let trace = http.request(reqwest::Method::TRACE, nginx.url("/health"));
    assert_nginx_error(&send(trace).await, 405, "method_not_allowed");
    assert_nginx_error(
        &send(http.get(nginx.url("/__error"))).await,
        404,
        "not_found",
    );

    // A request line that is not HTTP: reqwest would not send it.
    let mut raw = TcpStream::connect(("127.0.0.1", nginx.port)).await.unwrap();
    raw.write_all(b"NOT HTTP AT ALL\r\n\r\n").await.unwrap();
    let mut reply = String::new();
    raw.read_to_string(&mut reply).await.unwrap();
    let (head, body) = reply.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 400"), "{reply}");
    assert!(head.to_lowercase().contains("x-instance: nginx"), "{reply}");
    let body: Value = serde_json::from_str(body).unwrap();
    assert_eq!(body["error"], "bad_request");
}

/// A sale whose instance does not answer within the read timeout (1 s here instead of
/// 20 s, the one change to the compose files) answers 504 and is not sent to the other
/// instance, where it would sell a second time: not as POST (nginx never resends one), not
/// as GET or HEAD (the sale's once-only rule). `atomic` with `work_ms` writes after the
/// work, by which time nginx has given up and closed the connection, so the sale is refused
/// as `client_gone` (or, on a slow machine, sold): a resent request would show as a second
/// of either.
#[tokio::test(flavor = "multi_thread")]
async fn nginx_never_resends_a_sale_after_a_read_timeout() {
    let cluster = Cluster::start(2, |b| b).await;
    let ports = [cluster.instances[0].port, cluster.instances[1].port];
    let edits = [(
        "nginx.conf",
        "proxy_read_timeout 20s;",
        "proxy_read_timeout 1s;",
    )];
    let http = reqwest::Client::new();
    // Sales refused before their write because nobody waited for them any more, so far.
    let gone = || {
        cluster
            .instances
            .iter()
            .map(|i| i.log().matches("\"reason\":\"client_gone\"").count() as u64)
            .sum::<u64>()
    };

    for method in [
        reqwest::Method::POST,
        reqwest::Method::GET,
        reqwest::Method::HEAD,
    ] {
        // Its own nginx: the timeout marks the instance down there for fail_timeout.
        let nginx = Proxy::start(Conf::Compose, ports, &edits).await;
        let url = nginx.url("/inventory/sale?strategy=atomic&work_ms=2500");
        cluster.instances[0].reset(10).await;
        let gone_before = gone();
        let answer = send(http.request(method.clone(), &url)).await;
        if method == reqwest::Method::HEAD {
            // HEAD never sells: the instance refuses it at once, so nothing times out.
            assert_eq!(answer.status, 405, "{method}: {answer:?}");
        } else {
            assert_eq!(answer.status, 504, "{method}: {answer:?}");
            assert_nginx_error(&answer, 504, "instance_timeout");
        }
        // Let the sale that timed out finish on its instance (a resent one would have
        // started at the timeout, and finished a second after it). Finished is sold, or, as
        // nginx closed the connection when it gave up, refused before the write because
        // nobody waits for it (`client_gone`): each sale that arrived shows as one or the other.
        let finished = async || {
            cluster.instances[0].audit().await["sales"]
                .as_u64()
                .unwrap()
                + gone()
        };
        let deadline = Instant::now() + Duration::from_secs(8);
        while Instant::now() < deadline && method != reqwest::Method::HEAD && finished().await == 0
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let audit = cluster.instances[0].audit().await;
        let line = nginx
            .access_log()
            .lines()
            .rfind(|l| l.contains(&format!("\"{method} /inventory/sale")))
            .unwrap_or_default()
            .to_owned();
        assert!(
            !line.contains(", 127.0.0.1:"),
            "{method} was sent to a second instance: {line}"
        );
        let sales = audit["sales"].as_u64().unwrap();
        if method == reqwest::Method::HEAD {
            // A HEAD must never sell; that is the service's rule. nginx's is that it is
            // not sent twice, whatever the service does with it.
            assert!(sales <= 1, "{audit}");
        } else {
            assert_eq!(
                sales + gone() - gone_before,
                1,
                "{method}: the sale arrived once (sold, or refused as its client had gone): {audit}"
            );
            assert!(sales <= 1, "{method}: {audit}");
        }
    }
}

/// The compose configuration kills no differently from the native one: a sale that reached
/// an instance which then died is not resent (see stack.rs for the native run).
#[tokio::test(flavor = "multi_thread")]
async fn through_the_compose_nginx_a_sale_whose_instance_died_is_not_resent() {
    for method in [reqwest::Method::POST, reqwest::Method::GET] {
        // A fresh pair each time: a round kills one of them.
        let cluster = Cluster::start(2, |b| b).await;
        let ports = [cluster.instances[0].port, cluster.instances[1].port];
        let nginx = Proxy::start(Conf::Compose, ports, &[]).await;
        let (status, audit) = crate::stack::a_sale_whose_instance_dies_behind(
            &cluster,
            &nginx.url(""),
            method.clone(),
        )
        .await;
        assert_eq!(status, 502, "{method}");
        assert_eq!(
            audit["sales"], 0,
            "{method} resent to the other instance: {audit}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Slow clients and per-client limits (issue 8), on the native stack's configuration

/// Sends a request header one line a second, and returns how long nginx kept the
/// connection open.
async fn slow_header_lasts(port: u16) -> Duration {
    let started = Instant::now();
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    loop {
        tokio::select! {
            read = stream.read(&mut buf) => {
                if matches!(read, Ok(0) | Err(_)) {
                    return started.elapsed();
                }
            }
            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                if stream.write_all(b"X-Slow: 1\r\n").await.is_err() {
                    return started.elapsed();
                }
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "nginx keeps a slow client forever"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slow_header_client_is_dropped_after_the_header_timeout() {
    let stack = Stack::start(|b| b).await;
    let lasted = slow_header_lasts(stack.nginx.port).await;
    // client_header_timeout is 5 s for the whole header, however steadily it trickles.
    assert!(
        lasted >= Duration::from_millis(4500) && lasted < Duration::from_secs(7),
        "{lasted:?}"
    );
}

/// A body that stops half way: nginx closes the connection 5 s after the last bytes came
/// (client_body_timeout), without an answer, and nothing reaches an instance.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_stops_sending_its_body_is_dropped_after_the_body_timeout() {
    let stack = Stack::start(|b| b).await;
    let mut stream = TcpStream::connect(("127.0.0.1", stack.nginx.port))
        .await
        .unwrap();
    stream
        .write_all(b"PUT /inventory HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"stock\":")
        .await
        .unwrap();
    let started = Instant::now();
    let mut reply = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut reply))
        .await
        .expect("nginx keeps a client that stopped sending")
        .ok();
    let lasted = started.elapsed();
    assert!(
        lasted >= Duration::from_millis(4500) && lasted < Duration::from_secs(7),
        "{lasted:?}"
    );
    assert!(
        !stack.nginx.access_log().contains("upstream=127.0.0.1"),
        "the half body was sent to an instance: {}",
        stack.nginx.access_log()
    );
}

/// About a thousand slow clients blocked all traffic for a minute (1024 connections per
/// worker). Now they fit, and an ordinary request still answers at once.
#[tokio::test(flavor = "multi_thread")]
async fn a_thousand_slow_clients_do_not_block_an_ordinary_request() {
    let stack = Stack::start(|b| b).await;
    let mut slow = Vec::new();
    for _ in 0..1200 {
        let mut stream = TcpStream::connect(("127.0.0.1", stack.nginx.port))
            .await
            .unwrap();
        stream.write_all(b"GET /health HTTP/1.1\r\n").await.unwrap();
        slow.push(stream);
    }
    // With 1024 connections per worker, nginx dropped this one.
    let reply = tokio::time::timeout(Duration::from_secs(3), stack.get("/health"))
        .await
        .expect("an ordinary request waited behind the slow clients");
    assert_eq!(reply.status, 200);
}

/// The native stack exempts loopback (every one of its clients); the limits are tested by
/// taking that exemption out, the one change to the files.
const LIMIT_LOOPBACK: Edit<'static> = ("nginx.conf", "127.0.0.0/8  1;", "");

#[tokio::test(flavor = "multi_thread")]
async fn a_client_over_the_sale_rate_gets_a_json_429_and_buys_nothing_more() {
    let cluster = Cluster::start(2, |b| b).await;
    cluster.instances[0].reset(100).await;
    let ports = [cluster.instances[0].port, cluster.instances[1].port];
    let nginx = Proxy::start(Conf::Native, ports, &[LIMIT_LOOPBACK]).await;
    let http = reqwest::Client::new();

    // One after the other: the connection limit stays out of it.
    let started = Instant::now();
    let mut answers = Vec::new();
    for _ in 0..40 {
        answers.push(send(http.post(nginx.url("/inventory/sale?strategy=atomic"))).await);
    }
    let took = started.elapsed();
    let sold = answers.iter().filter(|a| a.status == 200).count();
    let limited: Vec<_> = answers.iter().filter(|a| a.status == 429).collect();
    assert_eq!(sold + limited.len(), 40, "{answers:?}");
    // The first and a burst of 20 at once, then 10 a second.
    let refilled = (took.as_secs_f64() * 10.0).ceil() as usize;
    assert!(
        (21..=21 + refilled).contains(&sold) && !limited.is_empty(),
        "{sold} sold in {took:?}: {answers:?}"
    );
    for answer in &limited {
        assert_nginx_error(answer, 429, "too_many_requests");
    }
    // The GET sale goes another way through nginx, and is limited the same.
    let get = send(http.get(nginx.url("/inventory/sale?strategy=atomic"))).await;
    assert_nginx_error(&get, 429, "too_many_requests");
    // Reads are not sales: not rate limited.
    assert_eq!(send(http.get(nginx.url("/inventory"))).await.status, 200);
    let audit = cluster.instances[0].audit().await;
    assert_eq!(audit["sales"].as_u64(), Some(sold as u64), "{audit}");
}

#[tokio::test(flavor = "multi_thread")]
async fn make_demo_clients_on_loopback_are_not_rate_limited() {
    let stack = Stack::start(|b| b).await;
    stack.cluster.instances[0].reset(100).await;
    let http = reqwest::Client::new();
    let sales = (0..60).map(|_| {
        send(http.post(format!(
            "{}/inventory/sale?strategy=atomic",
            stack.nginx.url()
        )))
    });
    let answers = futures_util::future::join_all(sales).await;
    assert!(answers.iter().all(|a| a.status == 200), "{answers:?}");
}

/// More requests in progress at once than a client may have: the rest answer 429 at once.
/// The instance is a listener that never answers, so the first ones stay in progress.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_over_its_connection_limit_gets_a_json_429() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });
    let nginx = Proxy::start(Conf::Native, [port, port], &[LIMIT_LOOPBACK]).await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(3))
        .build()
        .unwrap();

    let requests = (0..40).map(|_| {
        let request = http.get(nginx.url("/inventory")).send();
        async move {
            match request.await {
                Ok(response) => {
                    let status = response.status().as_u16();
                    let body: Value = response.json().await.unwrap_or_default();
                    Some((status, body))
                }
                Err(_) => None,
            }
        }
    });
    let outcomes = futures_util::future::join_all(requests).await;
    let limited: Vec<_> = outcomes.iter().flatten().collect();
    assert_eq!(
        limited.len(),
        8,
        "32 in progress, the rest refused: {outcomes:?}"
    );
    for (status, body) in limited {
        assert_eq!(*status, 429);
        assert_eq!(body["error"], "too_many_requests");
    }
    held.abort();
}

/// The nginx these tests start for themselves must not outlive them either: dropping a
/// `Proxy` (as a finished or panicking test does) leaves nothing of its process group.
#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_test_nginx_leaves_no_worker_behind() {
    use testkit::ProcStat;
    let proxy = Proxy::start(Conf::Compose, [free_port(), free_port()], &[]).await;
    let master = proxy.process.id().expect("nginx runs");
    let group = |pgrp: u32| {
        ProcStat::all()
            .into_iter()
            .filter(|p| p.pgrp == pgrp && !p.is_zombie())
            .count()
    };
    // The master forks its workers after it has started: on a busy machine, a moment later.
    let deadline = Instant::now() + Duration::from_secs(5);
    while group(master) < 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        group(master) >= 2,
        "the scan sees the master and its workers"
    );
    drop(proxy);
    let deadline = Instant::now() + Duration::from_secs(10);
    while group(master) > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(group(master), 0, "nginx processes survived their test");
}
