# Multi-stage build: compile in the Rust image, run in a slim Debian as a non-root user.
FROM rust:1-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY lua ./lua
COPY loadtest ./loadtest
RUN cargo build --release --locked --bin inventory --bin loadtest

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
