# The two commands a newcomer needs: `make demo` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
VENV := .venv
PYTHON ?= python3
NGINX_PORT ?= 8080
LOADTEST_ARGS ?= --stock 100 --requests 1000 --concurrency 64
# Items the demo's requests are spread over, each stocked with --stock (`make demo
# CLUSTER=1 ITEMS=64` spreads them over the cluster's masters).
ITEMS ?= 1
REPORT ?= run/report.html

.PHONY: failover-table cluster-table test deps stack-deps fmt-check lint unit test-build openapi-check fuzz run openapi release up down status demo scenarios scenario-pictures compose-check bench-lock bench

## demo: install redis-server and nginx if missing, build, start the native stack, load-test every strategy
demo: stack-deps up
	@echo
	@echo "== load test: every strategy, through nginx on port $(NGINX_PORT) =="
	@status=0; target/release/loadtest --target http://127.0.0.1:$(NGINX_PORT) --strategy all \
		--items $(ITEMS) $(LOADTEST_ARGS) --report $(REPORT) || status=$$?; \
	echo; \
	echo "The stack is still running:"; \
	echo "  curl -si -X POST 'http://127.0.0.1:$(NGINX_PORT)/inventory/sale?strategy=local'   # see X-Instance alternate"; \
	echo "  curl -s http://127.0.0.1:$(NGINX_PORT)/inventory/audit"; \
	echo "  Swagger UI:  http://127.0.0.1:$(NGINX_PORT)/swagger-ui/"; \
	echo "  HTML report: $(REPORT)"; \
	echo "Stop it with: make down"; \
	exit $$status

## scenarios: make each version's flaw happen on demand (own redis-server and instances), with a verdict;
## run/scenarios.html draws each run as a picture
SCENARIO_REPORT ?= run/scenarios.html
scenarios: stack-deps release
	target/release/scenarios --report $(SCENARIO_REPORT) $(SCENARIO_ARGS)

## scenario-pictures: the README's picture of one flaw (the paused holder's stale write), rendered
## from a fresh run's page by headless Chromium into docs/scenario-process-pause.png
PICTURE_ROW ?= --scenario process-pause --strategy watchdog
PICTURE_PNG ?= docs/scenario-process-pause.png
PICTURE_SIZE ?= 1000,740
scenario-pictures: stack-deps release
	@scripts/ensure-deps.sh chromium:chromium
	target/release/scenarios $(PICTURE_ROW) --report run/scenario-picture.html
	chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars --no-first-run \
		--disable-background-networking --user-data-dir=run/chromium-profile \
		--window-size=$(PICTURE_SIZE) --screenshot=$(PICTURE_PNG) \
		file://$(CURDIR)/run/scenario-picture.html 2>run/chromium.log \
		|| { cat run/chromium.log; exit 1; }
	@test -s $(PICTURE_PNG) && echo "wrote $(PICTURE_PNG)"

## failover-table: the load test through nginx on the sentinel topology, the master killed
## part-way, per strategy and REPLICA_ACKS: how many sales answered 200 were lost
FAILOVER_ARGS ?=
failover-table: stack-deps
	$(CARGO) build --release -p inventory --bin inventory
	$(CARGO) build --release -p loadtest --bin failover-table
	target/release/failover-table $(FAILOVER_ARGS)

## cluster-table: the load test through nginx on one Redis against a Redis Cluster of three
## masters (atomic and fenced, 1 and 64 items): sales/s, p99, each master's share of commands
cluster-table: stack-deps
	$(CARGO) build --release -p inventory --bin inventory
	$(CARGO) build --release -p loadtest --bin cluster-table
	target/release/cluster-table $(CLUSTER_TABLE_ARGS)

## bench-lock: C client processes on one lock, the project's waits against rslock (JSON lines)
BENCH_LOCK_ARGS ?= --clients 16,64 --duration 10
bench-lock: stack-deps
	$(CARGO) build --release -p loadtest --bin lock-bench
	target/release/lock-bench $(BENCH_LOCK_ARGS)

## bench: the lock bench against rslock, wrk against the load generator, sales through nginx,
## memory; writes the README's performance section and docs/bench-lock.svg
BENCH_ARGS ?=
bench: stack-deps
	@scripts/ensure-deps.sh wrk:wrk
	$(CARGO) build --release --workspace --bins
	target/release/bench --readme README.md $(BENCH_ARGS)

## test: install what the tests need, then formatting, lints, every test, OpenAPI validation, fuzzing
test: deps fmt-check lint unit openapi-check fuzz

deps:
	@scripts/ensure-deps.sh redis-server:redis-server nginx:nginx curl:curl \
		docker-compose:docker-compose chromium:chromium chromedriver:chromium-driver

stack-deps:
	@scripts/ensure-deps.sh redis-server:redis-server nginx:nginx curl:curl

release:
	$(CARGO) build --release --workspace --bins

## up: start redis-server, two instances and nginx on 127.0.0.1 (run/ holds pids and logs).
## TOPOLOGY=sentinel: a master, two replicas and three sentinels instead of the one redis-server;
## TOPOLOGY=cluster (or CLUSTER=1): six Redis Cluster nodes (see README, "Topologies")
TOPOLOGY ?= single
ifneq ($(filter 1 yes true,$(CLUSTER)),)
override TOPOLOGY := cluster
endif
up: stack-deps release
	@TOPOLOGY=$(TOPOLOGY) scripts/stack.sh up

## down: stop exactly the processes `make up` started, whatever the topology
down:
	@scripts/stack.sh down

## status: what runs; under sentinel the master of the moment and each replica's link and
## offset, under cluster the slots of each master and which replica follows which
status:
	@scripts/stack.sh status

fmt-check:
	$(CARGO) fmt --all -- --check

lint:
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	@$(PYTHON) scripts/module-graph.py >/dev/null

unit:
	@if $(CARGO) nextest --version >/dev/null 2>&1; then \
		$(CARGO) nextest run --workspace --no-fail-fast; \
	else \
		$(CARGO) test --workspace --no-fail-fast; \
	fi

PY_TOOLS := openapi-spec-validator==0.9.0 schemathesis==4.32.5

$(VENV)/.ready: Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check $(PY_TOOLS)
	touch $@

## compose-check: what `make test` checks of the Docker path without a Docker engine: the Dockerfile's
## build command on the host, the compose file (`config -q` without a profile and with each of
## `sentinel` and `cluster`, and the profiles' shapes), and nginx natively on the compose nginx.conf
compose-check: deps
	$(CARGO) test --test it -- compose::

# The instance binary as the tests build it: `cargo build --bin inventory` alone resolves the
# dependencies' features without the dev-dependencies, and compiled a second copy of tokio, syn
# and the rest (gigabytes, after the tests had built theirs).
test-build:
	$(CARGO) test --workspace --no-run --quiet

## openapi-check: validate the OpenAPI document against the 3.1 specification
openapi-check: $(VENV)/.ready test-build
	@mkdir -p target
	target/debug/inventory --openapi > target/openapi.json
	$(VENV)/bin/openapi-spec-validator target/openapi.json

## fuzz: schemathesis against a running instance (its own redis-server), from the OpenAPI document
fuzz: $(VENV)/.ready test-build
	VENV=$(VENV) scripts/schemathesis.sh target/debug/inventory

## openapi: print the OpenAPI document
openapi:
	@$(CARGO) run --quiet --bin inventory -- --openapi

## run: one instance against the Redis at REDIS_URL (default redis://127.0.0.1:6379)
run:
	$(CARGO) run --bin inventory
