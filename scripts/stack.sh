#!/usr/bin/env bash
# The native stack, no Docker needed: its own redis-server, two inventory instances and
# nginx, all on 127.0.0.1, with every pid, log and data file under one run directory.
#
#   scripts/stack.sh up       start what is not running yet (running it twice is harmless)
#   scripts/stack.sh down     stop exactly the processes this stack started
#   scripts/stack.sh status   show what runs
#
# Ports and paths come from the environment; the defaults match docker-compose.yml.
#
# Every process runs with the run directory as its working directory, and leads a process
# group of its own (redis-server and nginx make one when they daemonize, the instances are
# started with setsid). `down` stops a service by signalling that group, so whatever it
# forked goes too: nginx's workers outlive a master killed alone, adopted by init and still
# listening.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
# Absolute, because the processes are started from inside the run directory.
RUN_DIR=$(realpath -m "${RUN_DIR:-$root/run}")
REDIS_PORT=${REDIS_PORT:-6380}
APP1_PORT=${APP1_PORT:-7777}
APP2_PORT=${APP2_PORT:-8888}
NGINX_PORT=${NGINX_PORT:-8080}
# Three independent Redis nodes for the quorum lock (`redlock`, `redlock-fenced`).
LOCK1_PORT=${LOCK1_PORT:-6381}
LOCK2_PORT=${LOCK2_PORT:-6382}
LOCK3_PORT=${LOCK3_PORT:-6383}
INVENTORY_BIN=$(realpath -m "${INVENTORY_BIN:-$root/target/release/inventory}")
NGINX_BIN=${NGINX_BIN:-$(command -v nginx || echo /usr/sbin/nginx)}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-30}
# How long `down` waits for a graceful stop before it kills what is left.
STOP_TIMEOUT_S=${STOP_TIMEOUT_S:-10}

services=(redis lock1 lock2 lock3 app1 app2 nginx)

pidfile() { echo "$RUN_DIR/$1.pid"; }
# Alive and not a zombie: an exited process stays visible to `kill -0` until whoever
# adopted it gets round to reaping it.
alive() { kill -0 "$1" 2>/dev/null && ! grep -q '^[^)]*) Z' "/proc/$1/stat" 2>/dev/null; }
running() { local f; f=$(pidfile "$1"); [ -s "$f" ] && alive "$(cat "$f")"; }
port_of() {
  case $1 in
    redis) echo "$REDIS_PORT" ;; app1) echo "$APP1_PORT" ;;
    lock1) echo "$LOCK1_PORT" ;; lock2) echo "$LOCK2_PORT" ;; lock3) echo "$LOCK3_PORT" ;;
    app2) echo "$APP2_PORT" ;; nginx) echo "$NGINX_PORT" ;;
  esac
}
# True when something accepts connections on the port.
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
die() { echo "stack: $*" >&2; exit 1; }

# The stock lives only in Redis, so Redis keeps it on disk: the append-only file logs every
# write and is replayed on start, and a restart no longer loses the stock. fsync once a
# second, not on every write ("always"): a crash of the machine (not of Redis, whose writes
# are in the kernel already) can lose at most the last second of sales, where "always" would
# put a disk flush into every sale made under the lock. RDB snapshots stay off ("save"):
# the append-only file is the one copy, and no periodic fork doubles the memory.
start_redis() {
  mkdir -p "$RUN_DIR/redis"
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" \
    --appendonly yes --appendfsync everysec \
    --dir "$RUN_DIR/redis" --daemonize yes --pidfile "$(pidfile redis)" \
    --logfile "$RUN_DIR/redis.log" >/dev/null
  wait_for_redis redis "$REDIS_PORT"
}

wait_for_redis() {
  local name=$1 port=$2
  for _ in $(seq 100); do
    redis-cli -p "$port" ping >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "$name did not answer on port $port; see $RUN_DIR/$name.log"
}

# A lock node keeps nothing on disk: it holds only leases. The price, which the Redlock
# algorithm states, is that a node must not come back before a lease (LOCK_TTL_MS) has
# passed, or a second owner can reach a majority with it while the first still holds the
# lock; this script never restarts one by itself (`make scenarios` shows the double grant).
start_lock_node() {
  local name=$1 port=$2
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
    --daemonize yes --pidfile "$(pidfile "$name")" \
    --logfile "$RUN_DIR/$name.log" >/dev/null
  wait_for_redis "$name" "$port"
}

start_app() {
  local name=$1 port=$2
  [ -x "$INVENTORY_BIN" ] || die "no binary at $INVENTORY_BIN (build it: cargo build --release)"
  # setsid: a session and process group of its own, so that `down` can signal the group,
  # and so that a Ctrl-C in the terminal that ran `up` does not reach it. It execs (no
  # fork: a background job of a script is no group leader), so $! is the instance itself.
  PORT=$port BIND_ADDR=127.0.0.1 INSTANCE_NAME=$name \
    REDIS_URL="redis://127.0.0.1:$REDIS_PORT" \
    LOCK_NODES="redis://127.0.0.1:$LOCK1_PORT,redis://127.0.0.1:$LOCK2_PORT,redis://127.0.0.1:$LOCK3_PORT" \
    setsid "$INVENTORY_BIN" >>"$RUN_DIR/$name.log" 2>&1 </dev/null &
  echo $! >"$(pidfile "$name")"
}

start_nginx() {
  mkdir -p "$RUN_DIR/nginx-tmp"
  sed -e "s|@RUN_DIR@|$RUN_DIR|g" -e "s|@CONF_DIR@|$root/nginx|g" \
      -e "s|@NGINX_PORT@|$NGINX_PORT|g" -e "s|@APP1_PORT@|$APP1_PORT|g" \
      -e "s|@APP2_PORT@|$APP2_PORT|g" \
      "$root/nginx/nginx.native.conf.template" >"$RUN_DIR/nginx.conf"
  "$NGINX_BIN" -e "$RUN_DIR/nginx-error.log" -p "$RUN_DIR" -c "$RUN_DIR/nginx.conf"
}

wait_ready() {
  local deadline=$((SECONDS + READY_TIMEOUT_S)) url
  for url in "http://127.0.0.1:$APP1_PORT/ready" "http://127.0.0.1:$APP2_PORT/ready" \
             "http://127.0.0.1:$NGINX_PORT/ready"; do
    until curl -fsS -o /dev/null --max-time 2 "$url"; do
      if [ $SECONDS -ge $deadline ]; then
        tail -n 20 "$RUN_DIR"/*.log >&2 || true
        die "$url did not answer within ${READY_TIMEOUT_S}s"
      fi
      sleep 0.2
    done
  done
}

up() {
  mkdir -p "$RUN_DIR"
  cd "$RUN_DIR"
  local svc port
  for svc in "${services[@]}"; do
    if ! running "$svc" && listening "$(port_of "$svc")"; then
      die "port $(port_of "$svc") (for $svc) is taken by another process; stop it or set ${svc^^}_PORT"
    fi
  done
  for svc in "${services[@]}"; do
    if running "$svc"; then
      echo "$svc already running (pid $(cat "$(pidfile "$svc")"))"
      continue
    fi
    port=$(port_of "$svc")
    case $svc in
      redis) start_redis ;;
      lock1 | lock2 | lock3) start_lock_node "$svc" "$port" ;;
      app1 | app2) start_app "$svc" "$port" ;;
      nginx) start_nginx ;;
    esac
    echo "$svc started on 127.0.0.1:$port"
  done
  wait_ready
  echo "stack ready: http://127.0.0.1:$NGINX_PORT (run dir $RUN_DIR)"
}

# The live processes that belong to the service whose leader had pid $1 and whose command
# name starts with $2: its process group (which survives the leader) and its children
# (should one have left the group). The name guards against a pid reused since.
members() {
  local leader=$1 name=$2 file stat pid rest comm state ppid pgrp
  for file in /proc/[0-9]*/stat; do
    # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split at the last ')'.
    { read -r stat <"$file"; } 2>/dev/null || continue
    pid=${stat%% *}
    comm=${stat#*(}; comm=${comm%)*}
    rest=${stat##*) }
    read -r state ppid pgrp _ <<<"$rest"
    [ "$state" = Z ] && continue
    [[ $comm == "$name"* ]] || continue
    if [ "$pgrp" = "$leader" ] || [ "$ppid" = "$leader" ]; then echo "$pid"; fi
  done
}

# Stops one service: its graceful signal to the leader, a bounded wait, then SIGKILL to
# everything left of it (the leader, its group, its children).
stop_service() {
  local svc=$1 signal=$2 name=$3 pid left
  local file; file=$(pidfile "$svc")
  [ -s "$file" ] || return 0
  pid=$(cat "$file")
  if alive "$pid"; then
    kill "-$signal" "$pid" 2>/dev/null || true
    for _ in $(seq $((STOP_TIMEOUT_S * 10))); do alive "$pid" || break; sleep 0.1; done
    if alive "$pid"; then
      echo "$svc (pid $pid) ignored SIG$signal for ${STOP_TIMEOUT_S}s; killing it" >&2
    fi
  fi
  left=$(members "$pid" "$name")
  if [ -n "$left" ]; then
    # shellcheck disable=SC2086 # one pid a word
    kill -KILL $left 2>/dev/null || true
    for _ in $(seq 50); do [ -z "$(members "$pid" "$name")" ] && break; sleep 0.1; done
  fi
  left=$(members "$pid" "$name")
  if [ -n "$left" ]; then
    echo "stack: $svc: pid(s) $left survived SIGKILL" >&2
    return 1
  fi
  rm -f "$file"
  echo "$svc stopped"
}

down() {
  # nginx first, so no request reaches an instance that is going; SIGQUIT is its graceful
  # stop (finish the requests in flight), SIGTERM would be its fast one.
  local status=0 app
  # A command name is at most 15 characters.
  app=$(basename "$INVENTORY_BIN" | cut -c1-15)
  stop_service nginx QUIT nginx || status=1
  stop_service app1 TERM "$app" || status=1
  stop_service app2 TERM "$app" || status=1
  stop_service redis TERM redis || status=1
  stop_service lock1 TERM redis || status=1
  stop_service lock2 TERM redis || status=1
  stop_service lock3 TERM redis || status=1
  return $status
}

status() {
  local svc
  for svc in "${services[@]}"; do
    if running "$svc"; then
      echo "$svc: running (pid $(cat "$(pidfile "$svc")"), 127.0.0.1:$(port_of "$svc"))"
    else
      echo "$svc: stopped"
    fi
  done
}

case ${1:-} in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
