# The two commands a newcomer needs: `make test` (and, once the stack lands, `make demo`).
SHELL := /bin/bash
CARGO ?= cargo
VENV := .venv
PYTHON ?= python3

.PHONY: test deps fmt-check lint unit openapi-check run openapi

## test: install what the tests need, then formatting, lints, every test, OpenAPI validation
test: deps fmt-check lint unit openapi-check

deps:
	@scripts/ensure-deps.sh redis-server:redis-server

fmt-check:
	$(CARGO) fmt --all -- --check

lint:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

unit:
	@if $(CARGO) nextest --version >/dev/null 2>&1; then \
		$(CARGO) nextest run --workspace --no-fail-fast; \
	else \
		$(CARGO) test --workspace --no-fail-fast; \
	fi

$(VENV)/.ready:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check openapi-spec-validator
	touch $@

## openapi-check: validate the OpenAPI document against the 3.1 specification
openapi-check: $(VENV)/.ready
	@mkdir -p target
	$(CARGO) run --quiet --bin inventory -- --openapi > target/openapi.json
	$(VENV)/bin/openapi-spec-validator target/openapi.json

## openapi: print the OpenAPI document
openapi:
	@$(CARGO) run --quiet --bin inventory -- --openapi

## run: one instance against the Redis at REDIS_URL (default redis://127.0.0.1:6379)
run:
	$(CARGO) run --bin inventory
