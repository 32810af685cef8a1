#!/usr/bin/env bash
# Hostile input from a real client: schemathesis generates requests from the service's own
# OpenAPI document and checks that every answer matches its schema and that no 5xx comes
# back but the documented 503s. Starts its own redis-server and instance on free ports.
# Usage: scripts/schemathesis.sh [path/to/inventory] (default: target/debug/inventory)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# Absolute paths: the fuzzer runs from a scratch directory.
bin=$(realpath "${1:-$root/target/debug/inventory}")
venv=$(realpath "${VENV:-$root/.venv}")
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

free_port() { "$venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no --dir "$work" \
  --logfile "$work/redis.log" &
pids+=($!)
app_port=$(free_port)
# Every strategy the document lists must be usable: the quorum lock gets three lock
# nodes, here three databases of the same server (the fuzzer tests the contract, not the
# failure of a node).
lock_nodes="redis://127.0.0.1:$redis_port/1,redis://127.0.0.1:$redis_port/2,redis://127.0.0.1:$redis_port/3"
env -u ADMIN_TOKEN PORT=$app_port BIND_ADDR=127.0.0.1 INSTANCE_NAME=fuzzed REDIS_URL="redis://127.0.0.1:$redis_port" \
  LOCK_NODES="$lock_nodes" LOCK_WAIT_MS=2000 "$bin" >"$work/app.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  curl -fsS -o /dev/null "http://127.0.0.1:$app_port/ready" && break
  sleep 0.1
done
curl -fsS -o /dev/null -X PUT "http://127.0.0.1:$app_port/inventory" \
  -H 'content-type: application/json' -d '{"stock": 1000}'

# One worker: Python 3.11.7's parser is not safe to use from several threads at once
# ("AST constructor recursion depth mismatch"), and the fuzzer's workers are threads.
# not_a_server_error is replaced by the hook's check, which allows the documented 503s.
status=0
# Run from the scratch directory: schemathesis leaves a cache in its working directory.
cd "$work"
SCHEMATHESIS_HOOKS=hooks PYTHONPATH="$root/tests/schemathesis" \
  "$venv/bin/schemathesis" run "http://127.0.0.1:$app_port/api-docs/openapi.json" \
  --checks all --exclude-checks not_a_server_error --max-examples "${SCHEMATHESIS_EXAMPLES:-40}" \
  --workers 1 \
  --request-timeout 10 --seed "${SCHEMATHESIS_SEED:-20261130}" --no-color || status=$?
if [ $status -ne 0 ]; then
  echo "--- instance log (last 30 lines) ---" >&2
  tail -n 30 "$work/app.log" >&2
fi
exit $status
