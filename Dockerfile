# Multi-stage build: compile in the Rust image, run in a slim Debian as a non-root user.
# `make test` runs this file's `cargo build` command on the host, on a copy of exactly what
# the COPY lines bring in (tests/it/compose.rs), so the two cannot drift apart.
FROM rust:1-slim-bookworm AS build
WORKDIR /src

# The dependencies get a layer of their own, keyed on the manifests and the lock file only:
# a source change then recompiles the workspace crates (seconds) instead of every crate
# (minutes). Empty stand-ins for the sources are enough for cargo to build the dependency
# graph; the command is the real build's, so it warms exactly the units that build needs.
COPY Cargo.toml Cargo.lock ./
COPY loadtest/Cargo.toml ./loadtest/
COPY testkit/Cargo.toml ./testkit/
RUN mkdir -p src loadtest/src testkit/src \
    && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && echo 'fn main() {}' > loadtest/src/main.rs && touch loadtest/src/lib.rs \
    && touch testkit/src/lib.rs \
    && cargo build --release --locked -p inventory -p loadtest --bin inventory --bin loadtest \
    && rm -rf src loadtest/src testkit/src

COPY src ./src
COPY lua ./lua
COPY loadtest/src ./loadtest/src
COPY testkit/src ./testkit/src
# COPY keeps each file's own modification time, which can be older than the stand-ins built
# above: cargo would then think the workspace crates fresh and ship the empty binaries.
# Touching the crate roots makes them, and only them, rebuild.
RUN touch src/main.rs src/lib.rs loadtest/src/main.rs loadtest/src/lib.rs testkit/src/lib.rs \
    && cargo build --release --locked -p inventory -p loadtest --bin inventory --bin loadtest

FROM debian:bookworm-slim
# curl serves the compose health check.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin inventory
COPY --from=build /src/target/release/inventory /src/target/release/loadtest /usr/local/bin/
USER inventory
ENV BIND_ADDR=0.0.0.0 PORT=7777
EXPOSE 7777
ENTRYPOINT ["/usr/local/bin/inventory"]
