#!/usr/bin/env bash
# The native stack, no Docker needed: its own redis-server, two inventory instances and
# nginx, all on 127.0.0.1, with every pid, log and data file under one run directory.
#
#   scripts/stack.sh up       start what is not running yet (running it twice is harmless)
#   scripts/stack.sh down     stop exactly the processes this stack started
#   scripts/stack.sh status   show what runs
#
# Ports and paths come from the environment; the defaults match docker-compose.yml.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
RUN_DIR=${RUN_DIR:-$root/run}
REDIS_PORT=${REDIS_PORT:-6380}
APP1_PORT=${APP1_PORT:-7777}
APP2_PORT=${APP2_PORT:-8888}
NGINX_PORT=${NGINX_PORT:-8080}
INVENTORY_BIN=${INVENTORY_BIN:-$root/target/release/inventory}
NGINX_BIN=${NGINX_BIN:-$(command -v nginx || echo /usr/sbin/nginx)}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-30}

services=(redis app1 app2 nginx)

pidfile() { echo "$RUN_DIR/$1.pid"; }
# Alive and not a zombie: an exited process stays visible to `kill -0` until whoever
# adopted it gets round to reaping it.
alive() { kill -0 "$1" 2>/dev/null && ! grep -q '^[^)]*) Z' "/proc/$1/stat" 2>/dev/null; }
running() { local f; f=$(pidfile "$1"); [ -s "$f" ] && alive "$(cat "$f")"; }
port_of() {
  case $1 in
    redis) echo "$REDIS_PORT" ;; app1) echo "$APP1_PORT" ;;
    app2) echo "$APP2_PORT" ;; nginx) echo "$NGINX_PORT" ;;
  esac
}
# True when something accepts connections on the port.
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
die() { echo "stack: $*" >&2; exit 1; }

start_redis() {
  mkdir -p "$RUN_DIR/redis"
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
    --dir "$RUN_DIR/redis" --daemonize yes --pidfile "$(pidfile redis)" \
    --logfile "$RUN_DIR/redis.log" >/dev/null
  for _ in $(seq 100); do
    redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "redis-server did not answer on port $REDIS_PORT; see $RUN_DIR/redis.log"
}

start_app() {
  local name=$1 port=$2
  [ -x "$INVENTORY_BIN" ] || die "no binary at $INVENTORY_BIN (build it: cargo build --release)"
  PORT=$port BIND_ADDR=127.0.0.1 INSTANCE_NAME=$name \
    REDIS_URL="redis://127.0.0.1:$REDIS_PORT" \
    nohup "$INVENTORY_BIN" >>"$RUN_DIR/$name.log" 2>&1 </dev/null &
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
      app1 | app2) start_app "$svc" "$port" ;;
      nginx) start_nginx ;;
    esac
    echo "$svc started on 127.0.0.1:$port"
  done
  wait_ready
  echo "stack ready: http://127.0.0.1:$NGINX_PORT (run dir $RUN_DIR)"
}

down() {
  local svc pid
  for svc in nginx app1 app2 redis; do
    running "$svc" || { rm -f "$(pidfile "$svc")"; continue; }
    pid=$(cat "$(pidfile "$svc")")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do alive "$pid" || break; sleep 0.1; done
    if alive "$pid"; then
      echo "$svc (pid $pid) ignored SIGTERM for 10s; killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$(pidfile "$svc")"
    echo "$svc stopped"
  done
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
