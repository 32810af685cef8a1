#!/usr/bin/env bash
# The native stack, no Docker needed: its own redis-server, two inventory instances and
# nginx, all on 127.0.0.1, with every pid, log and data file under one run directory.
#
#   scripts/stack.sh up       start what is not running yet (running it twice is harmless)
#   scripts/stack.sh down     stop exactly the processes this stack started
#   scripts/stack.sh status   show what runs (and, per topology, who is master of what)
#
# TOPOLOGY (for `up`; `down` and `status` read the one `up` recorded in the run directory):
#   single    (default) one redis-server, three lock nodes, two instances, nginx
#   sentinel  a master, two replicas and three sentinels instead of the one redis-server;
#             the instances find the master through the sentinels (REDIS_SENTINELS)
#   cluster   six cluster nodes (three masters, three replicas); CLUSTER=1 means the same.
#             The instances run on it only once the binary knows REDIS_CLUSTER.
# A topology is a list of services (topology_services) and each service a start function
# (start_service) and a port variable <SERVICE>_PORT: adding one touches those three places.
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
die() { echo "stack: $*" >&2; exit 1; }

# Every service any topology has, in the order `down` stops them: the front first, so no
# request reaches an instance that is going; the sentinels before the servers they watch,
# so that stopping the master starts no failover.
all_services=(nginx app1 app2 sentinel1 sentinel2 sentinel3 replica1 replica2 redis
  node1 node2 node3 node4 node5 node6 lock1 lock2 lock3)
cluster_nodes=(node1 node2 node3 node4 node5 node6)

# The settings below with a default: every <SERVICE>_PORT, and these. Unset, a setting takes
# its default; set but empty, it is refused (check_values), where `${VAR:-default}` alone
# took the default: `NGINX_PORT= scripts/stack.sh up` ran nginx on 8080, the very port the
# caller had meant to move it off. Found here, before the defaults fill them in.
defaulted_settings=(RUN_DIR REDIS_MASTER_NAME DOWN_AFTER_MS FAILOVER_TIMEOUT_MS
  CLUSTER_NODE_TIMEOUT_MS WORKER_THREADS INVENTORY_BIN NGINX_BIN READY_TIMEOUT_S STOP_TIMEOUT_S)
for svc in "${all_services[@]}"; do defaulted_settings+=("${svc^^}_PORT"); done
empty_settings=()
for var in "${defaulted_settings[@]}"; do
  if [ -n "${!var+set}" ] && [ -z "${!var}" ]; then empty_settings+=("$var"); fi
done
unset svc var

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
# sentinel: the master is REDIS_PORT, with two replicas and three sentinels beside it.
REPLICA1_PORT=${REPLICA1_PORT:-6384}
REPLICA2_PORT=${REPLICA2_PORT:-6385}
SENTINEL1_PORT=${SENTINEL1_PORT:-26380}
SENTINEL2_PORT=${SENTINEL2_PORT:-26381}
SENTINEL3_PORT=${SENTINEL3_PORT:-26382}
REDIS_MASTER_NAME=${REDIS_MASTER_NAME:-inventory}
# How fast the sentinels act: a master silent this long is down (once two of the three
# agree), and a failover not done within FAILOVER_TIMEOUT_MS is given up and retried.
DOWN_AFTER_MS=${DOWN_AFTER_MS:-1000}
FAILOVER_TIMEOUT_MS=${FAILOVER_TIMEOUT_MS:-3000}
# cluster: six nodes; each also listens on its port + 10000 (the cluster bus).
NODE1_PORT=${NODE1_PORT:-7001}
NODE2_PORT=${NODE2_PORT:-7002}
NODE3_PORT=${NODE3_PORT:-7003}
NODE4_PORT=${NODE4_PORT:-7004}
NODE5_PORT=${NODE5_PORT:-7005}
NODE6_PORT=${NODE6_PORT:-7006}
# A node unreachable this long is failed and its replica promoted: fast, for a demo.
CLUSTER_NODE_TIMEOUT_MS=${CLUSTER_NODE_TIMEOUT_MS:-1000}
# The two instances share the machine's cores with each other, nginx and Redis: each gets
# half of them (at least one) instead of a thread per core that would preempt the others.
cores=$(nproc 2>/dev/null || echo 2)
WORKER_THREADS=${WORKER_THREADS:-$((cores / 2 > 0 ? cores / 2 : 1))}
INVENTORY_BIN=$(realpath -m "${INVENTORY_BIN:-$root/target/release/inventory}")
NGINX_BIN=${NGINX_BIN:-$(command -v nginx || echo /usr/sbin/nginx)}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-30}
# How long `down` waits for a graceful stop before it kills what is left.
STOP_TIMEOUT_S=${STOP_TIMEOUT_S:-10}

# What each setting may be, as the refusals name it.
valid_value() {
  case $1 in
    *_PORT) echo "a port number in 1..=65535" ;;
    *) local unit min max; read -r unit min max <<<"$(number_range "$1")"
       echo "a whole number of $unit in $min..=$max, without leading zeros" ;;
  esac
}
# "unit min max" of a numeric setting: what the script computes with (bash reads `08` as
# octal, `1e3` as an error of its own) and what the servers accept (a sentinel refuses a
# time of 0, the binary fewer than 1 or more than 1024 worker threads).
number_range() {
  case $1 in
    WORKER_THREADS) echo "threads 1 1024" ;;
    STOP_TIMEOUT_S) echo "seconds 0 999999999" ;;
    *_S) echo "seconds 1 999999999" ;;
    LOCK_WAIT_MS | MAX_WORK_MS | REDIS_TIMEOUT_MS) echo "milliseconds 0 999999999" ;;
    *_MS) echo "milliseconds 1 999999999" ;;
  esac
}

# Every setting, for every verb and before anything uses it (`locked` computes with the
# timeouts, `down` with STOP_TIMEOUT_S): an empty one, a number that is none or out of its
# range, a port that is none. LOCK_WAIT_MS, MAX_WORK_MS and REDIS_TIMEOUT_MS are the
# instances' (empty is their default there too); the script computes nginx's timeout from them.
check_values() {
  local var value unit min max
  for var in "${empty_settings[@]}"; do
    case $var in
      *_PORT | *_MS | *_S | WORKER_THREADS) value=$(valid_value "$var") ;;
      RUN_DIR) value="a directory" ;;
      INVENTORY_BIN) value="the path of the inventory binary" ;;
      NGINX_BIN) value="the path of nginx" ;;
      *) value="a name" ;;
    esac
    die "$var is ''; valid: $value (unset it for its default, ${!var})"
  done
  for var in READY_TIMEOUT_S STOP_TIMEOUT_S DOWN_AFTER_MS FAILOVER_TIMEOUT_MS \
      CLUSTER_NODE_TIMEOUT_MS WORKER_THREADS LOCK_WAIT_MS MAX_WORK_MS REDIS_TIMEOUT_MS; do
    value=${!var:-}
    [ -n "$value" ] || continue
    read -r unit min max <<<"$(number_range "$var")"
    # The pattern first: only a plain decimal reaches the comparisons.
    [[ $value =~ ^(0|[1-9][0-9]{0,8})$ ]] && [ "$value" -ge "$min" ] && [ "$value" -le "$max" ] \
      || die "$var is '$value'; valid: $(valid_value "$var")"
  done
  for var in "${all_services[@]}"; do
    var="${var^^}_PORT"
    value=${!var}
    [[ $value =~ ^[1-9][0-9]{0,4}$ ]] && [ "$value" -le 65535 ] \
      || die "$var is '$value'; valid: $(valid_value "$var")"
  done
}
check_values

topology_file() { echo "$RUN_DIR/topology"; }
# Under the sentinel topology, "host port" of the master when the stack was last stopped:
# the servers keep their append-only files through `down`, and the next `up` must start
# from the one that had the newest data, not from REDIS_PORT's again.
master_file() { echo "$RUN_DIR/sentinel-master"; }
ports_file() { echo "$RUN_DIR/ports.env"; }
# The topology `up` recorded, or the one asked for when nothing is recorded.
recorded_topology() {
  local f; f=$(topology_file)
  if [ -s "$f" ]; then cat "$f"; else requested_topology; fi
}
requested_topology() {
  case ${CLUSTER:-} in 1 | yes | true) echo cluster; return ;; esac
  echo "${TOPOLOGY:-single}"
}

# Whether the binary reads REDIS_CLUSTER (another change adds it): until then the cluster
# topology runs the cluster alone.
app_knows_cluster() { [ -x "$INVENTORY_BIN" ] && "$INVENTORY_BIN" --help 2>/dev/null | grep -q 'REDIS_CLUSTER'; }

# The services of a topology, in start order.
topology_services() {
  case $1 in
    single) echo redis lock1 lock2 lock3 app1 app2 nginx ;;
    sentinel) echo redis replica1 replica2 sentinel1 sentinel2 sentinel3 lock1 lock2 lock3 app1 app2 nginx ;;
    cluster)
      if app_knows_cluster; then
        echo "${cluster_nodes[*]}" lock1 lock2 lock3 app1 app2 nginx
      else
        echo "${cluster_nodes[*]}"
      fi
      ;;
    *) die "unknown TOPOLOGY '$1': single, sentinel or cluster" ;;
  esac
}

pidfile() { echo "$RUN_DIR/$1.pid"; }
# Alive and not a zombie: an exited process stays visible to `kill -0` until whoever
# adopted it gets round to reaping it.
alive() { kill -0 "$1" 2>/dev/null && ! grep -q '^[^)]*) Z' "/proc/$1/stat" 2>/dev/null; }
running() { local f; f=$(pidfile "$1"); [ -s "$f" ] && alive "$(cat "$f")"; }
# A service's port is the variable <SERVICE>_PORT.
port_of() { local var="${1^^}_PORT"; echo "${!var}"; }
is_cluster_node() { [[ $1 == node[0-9]* ]]; }
# True when something accepts connections on the port.
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# A path as the replacement of a `sed s|...|...|`: its `\`, `|` and `&` taken literally.
sed_escaped() { printf '%s' "$1" | sed -e 's/[\\|&]/\\&/g'; }

# What `up` would otherwise find out half-way, with services already started: a setting
# that is not a number where the script computes with it, a binary that is not there, a
# run directory that the servers' configuration files cannot name.
check_settings() {
  # The numbers and ports were checked with the script's head (check_values).
  # nginx reads `$name` in a path as a variable, whatever the quotes.
  case $RUN_DIR$root in
    *'"'* | *$'\n'* | *'$'*) die "RUN_DIR ($RUN_DIR) or the repository ($root) holds a double quote, a \$ or a line break, which nginx's configuration cannot name; give a path without them" ;;
  esac
  [ -x "$INVENTORY_BIN" ] || die "no binary at $INVENTORY_BIN (build it: cargo build --release, or set INVENTORY_BIN)"
}

# The stock lives only in Redis, so Redis keeps it on disk: the append-only file logs every
# write and is replayed on start, and a restart no longer loses the stock. fsync once a
# second, not on every write ("always"): a crash of the machine (not of Redis, whose writes
# are in the kernel already) can lose at most the last second of sales, where "always" would
# put a disk flush into every sale made under the lock. RDB snapshots stay off ("save"):
# the append-only file is the one copy, and no periodic fork doubles the memory.
#
# Under the sentinel topology the replicas keep the same file: one of them may become the
# master, and then it is the stock's copy.
start_redis() {
  local name=$1 port=$2; shift 2
  mkdir -p "$RUN_DIR/$name"
  redis-server --port "$port" --bind 127.0.0.1 --save "" \
    --appendonly yes --appendfsync everysec \
    --dir "$RUN_DIR/$name" --daemonize yes --pidfile "$(pidfile "$name")" \
    --logfile "$RUN_DIR/$name.log" "$@" >/dev/null
  wait_for_redis "$name" "$port"
}

# "host port" of the master now: what a running sentinel names; else what the sentinels
# last wrote in their configuration files (they rewrite it after a failover), when they
# were killed with the stack still up; else the master when the stack was last stopped
# (master_file); else REDIS_PORT's server (the master of a fresh stack).
current_master() {
  # Of all the sentinels' answers, running or in their files, the one with the highest
  # config epoch: each failover raises it, and a sentinel that was down during one (or has
  # just been started) still names the master from before it.
  local svc reply epoch best="" best_epoch=-1 info
  for svc in sentinel1 sentinel2 sentinel3; do
    if running "$svc"; then
      # The address from get-master-addr-by-name, which names the promoted replica as soon
      # as a failover has promoted it (`sentinel master` names the old one until the end).
      reply=$({ redis-cli -p "$(port_of "$svc")" sentinel get-master-addr-by-name "$REDIS_MASTER_NAME" 2>/dev/null || true; } | tr -d '\r' | paste -sd' ' -)
      info=$({ redis-cli -p "$(port_of "$svc")" sentinel master "$REDIS_MASTER_NAME" 2>/dev/null || true; } | tr -d '\r' | paste -sd' ' -)
      epoch=$(sed -n 's/.* config-epoch \([0-9]*\) .*/\1/p' <<<" $info ")
    else
      reply=$(sed -n "s/^sentinel monitor $REDIS_MASTER_NAME \\([^ ]*\\) \\([0-9]*\\) .*/\\1 \\2/p" "$RUN_DIR/$svc.conf" 2>/dev/null || true)
      epoch=$(sed -n "s/^sentinel config-epoch $REDIS_MASTER_NAME \\([0-9]*\\).*/\\1/p" "$RUN_DIR/$svc.conf" 2>/dev/null || true)
    fi
    [ -n "$reply" ] || continue
    epoch=${epoch:-0}
    if [ "$epoch" -gt "$best_epoch" ]; then best=$reply; best_epoch=$epoch; fi
  done
  if [ -n "$best" ]; then echo "$best"; return; fi
  if [ -s "$(master_file)" ]; then cat "$(master_file)"; return; fi
  echo "127.0.0.1 $REDIS_PORT"
}

# The sentinel topology's services in start order: the server that is master now first (it
# may be any of the three after a failover), so that the others join it and a stopped
# master is not started as a replica of its own replicas, which have older data.
sentinel_start_order() {
  local master svc first=""
  master=$(current_master)
  for svc in redis replica1 replica2; do
    [ "$master" = "127.0.0.1 $(port_of "$svc")" ] && first=$svc
  done
  echo "$first"
  for svc in "$@"; do [ "$svc" = "$first" ] || echo "$svc"; done
}

# A server of the sentinel topology (the master, a replica), started as a replica of the
# master of the moment unless it is that master: after a failover, a server that `up`
# starts again (the old master among them) joins the new master instead of being a
# second one with old data. `up` waits for its first sync, so that the sentinels, started
# next, find the replicas in sync.
start_replica() {
  local name=$1 port=$2 master
  master=$(current_master)
  if [ "$master" = "127.0.0.1 $port" ]; then
    start_redis "$name" "$port"
    return
  fi
  # shellcheck disable=SC2086 # host and port, two words
  start_redis "$name" "$port" --replicaof $master
  for _ in $(seq 100); do
    redis-cli -p "$port" info replication 2>/dev/null | grep -q '^master_link_status:up' && return 0
    sleep 0.1
  done
  die "$name did not sync with the master at $master; see $RUN_DIR/$name.log"
}

# A sentinel rewrites its own configuration file (what it learnt: replicas, other
# sentinels, the master after a failover), so each has a file of its own under the run
# directory, written here only when absent: a sentinel started again while the stack runs
# keeps what it knew. `down` removes them with the stack. Quorum 2 of 3.
start_sentinel() {
  local name=$1 port=$2 conf="$RUN_DIR/$1.conf" master
  mkdir -p "$RUN_DIR/$name"
  master=$(current_master)
  # A file that names another master is from before a failover this sentinel missed (it
  # was down): started on it, it would name the old master until the others told it.
  if [ -s "$conf" ] && ! grep -q "^sentinel monitor $REDIS_MASTER_NAME $master " "$conf"; then
    rm -f "$conf"
  fi
  if [ ! -s "$conf" ]; then
    cat >"$conf" <<CONF
port $port
bind 127.0.0.1
daemonize yes
pidfile "$(pidfile "$name")"
logfile "$RUN_DIR/$name.log"
dir "$RUN_DIR/$name"
sentinel monitor $REDIS_MASTER_NAME $master 2
sentinel down-after-milliseconds $REDIS_MASTER_NAME $DOWN_AFTER_MS
sentinel failover-timeout $REDIS_MASTER_NAME $FAILOVER_TIMEOUT_MS
sentinel parallel-syncs $REDIS_MASTER_NAME 1
CONF
  fi
  redis-server "$conf" --sentinel >/dev/null
  wait_for_redis "$name" "$port"
}

# A server still running as a master beside the master now (an old master that the
# sentinels had not yet turned into a replica when they were killed) becomes a replica of it,
# as the sentinels would once they find it: until then each would take writes.
rejoin_master() {
  local master svc port
  master=$(current_master)
  for svc in redis replica1 replica2; do
    port=$(port_of "$svc")
    [ "$master" = "127.0.0.1 $port" ] && continue
    running "$svc" || continue
    if [ "$(replication_field "$port" role)" = master ]; then
      # shellcheck disable=SC2086 # host and port, two words
      redis-cli -p "$port" replicaof $master >/dev/null
      echo "$svc was a master beside $master: now its replica"
    fi
  done
}

# Until each sentinel knows the two others and both replicas: a master lost before that
# is never failed over in time (a sentinel that cannot gather the votes to be elected
# aborts, and waits twice the failover timeout to try again), and `up` would have
# reported a stack ready that cannot fail over.
wait_for_sentinels() {
  local svc info deadline=$((SECONDS + 30))
  for svc in sentinel1 sentinel2 sentinel3; do
    while :; do
      info=$(redis-cli -p "$(port_of "$svc")" sentinel master "$REDIS_MASTER_NAME" 2>/dev/null | paste -sd' ' - || true)
      [[ " $info " == *" num-other-sentinels 2 "* && " $info " == *" num-slaves 2 "* ]] && break
      [ "$SECONDS" -lt "$deadline" ] || die "$svc never saw the two other sentinels and both replicas: $info"
      sleep 0.2
    done
  done
  echo "sentinels: each knows the two others and both replicas"
  wait_for_sentinels_out_of_tilt
}

# Until no sentinel is in TILT. A sentinel whose own loop stalled for more than 2 s (a
# config rewrite's fsync behind a busy disk, right after the discoveries above; a starved
# CPU) distrusts its timers for 30 s: meanwhile it answers every other sentinel that the
# master is up, and with two of the three so, no failover happens at all. The stall shows
# only on the sentinel's next tick, after it answered what was queued, hence the pause.
wait_for_sentinels_out_of_tilt() {
  local svc tilt deadline=$((SECONDS + 45)) said=
  sleep 0.3
  for svc in sentinel1 sentinel2 sentinel3; do
    while :; do
      tilt=$(redis-cli -p "$(port_of "$svc")" info sentinel 2>/dev/null | tr -d '\r' | sed -n 's/^sentinel_tilt://p' || true)
      [ "$tilt" = 0 ] && break
      [ "$SECONDS" -lt "$deadline" ] || die "$svc is still in TILT (sentinel_tilt: ${tilt:-no answer}); see $RUN_DIR/$svc.log"
      [ "$said" = "$svc" ] || echo "sentinels: $svc is in TILT (its loop stalled); waiting for it to end"
      said=$svc
      sleep 0.5
    done
  done
}

# A cluster node keeps its cluster state (nodes.conf) and an append-only file in its
# directory, which `down` removes: the cluster topology is a demo of slots and failover,
# started fresh by every `up` after a `down`. The file is for the `up` that repairs a stack
# whose processes were killed: a master it restarts before its replica has taken over (within
# cluster-node-timeout) is still master of its slots, and without its data it served them
# empty, and its replica copied the emptiness (every item of that shard: 404 unknown_item).
# With the file it comes back with its data up to the last second (appendfsync everysec); one
# restarted after the failover rejoins as a replica of the new master and copies it. Its bus
# port (port + 10000) must be free too. Without full coverage required, the masters that
# are up keep serving their slots while one shard fails over.
start_cluster_node() {
  local name=$1 port=$2
  mkdir -p "$RUN_DIR/$name"
  redis-server --port "$port" --bind 127.0.0.1 --save "" \
    --appendonly yes --appendfsync everysec \
    --cluster-enabled yes --cluster-config-file nodes.conf \
    --cluster-node-timeout "$CLUSTER_NODE_TIMEOUT_MS" \
    --repl-diskless-sync-delay 0 \
    --cluster-require-full-coverage no \
    --dir "$RUN_DIR/$name" --daemonize yes --pidfile "$(pidfile "$name")" \
    --logfile "$RUN_DIR/$name.log" >/dev/null
  wait_for_redis "$name" "$port"
}

# Until every replica has synced with its master: a replica that never synced refuses to
# take over (its data could be anything), so a master killed before that stayed down until
# the next `up` (Redis waits 5 s before a first sync by default; the nodes here do not).
wait_for_cluster_replicas() {
  local node port deadline=$((SECONDS + READY_TIMEOUT_S))
  for node in "${cluster_nodes[@]}"; do
    port=$(port_of "$node")
    [ "$(replication_field "$port" role)" = slave ] || continue
    until [ "$(replication_field "$port" master_link_status)" = up ]; do
      [ $SECONDS -ge $deadline ] && die "$node: its replication link is not up within ${READY_TIMEOUT_S}s"
      sleep 0.2
    done
  done
  echo "cluster replicas: each has synced with its master"
}

# A field of `CLUSTER INFO` of the node on port $1; empty when it does not answer.
cluster_field() { { redis-cli -p "$1" cluster info 2>/dev/null || true; } | tr -d '\r' | sed -n "s/^$2://p"; }

# Joins the six nodes into one cluster (three masters, a replica each) unless they already
# are one, then waits until every node says cluster_state:ok.
create_cluster() {
  local node known fresh=0 addrs=()
  for node in "${cluster_nodes[@]}"; do
    known=$(cluster_field "$(port_of "$node")" cluster_known_nodes)
    [ "$known" = 1 ] && fresh=$((fresh + 1))
    addrs+=("127.0.0.1:$(port_of "$node")")
  done
  if [ "$fresh" = "${#cluster_nodes[@]}" ]; then
    redis-cli --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes \
      >"$RUN_DIR/cluster-create.log" 2>&1 \
      || { cat "$RUN_DIR/cluster-create.log" >&2; die "redis-cli --cluster create failed"; }
    echo "cluster created: ${addrs[*]}"
  elif [ "$fresh" != 0 ]; then
    die "some cluster nodes are fresh and others already in a cluster; run down, then up"
  fi
  local deadline=$((SECONDS + READY_TIMEOUT_S))
  for node in "${cluster_nodes[@]}"; do
    until [ "$(cluster_field "$(port_of "$node")" cluster_state)" = ok ]; do
      [ $SECONDS -ge $deadline ] && die "$node: no cluster_state:ok within ${READY_TIMEOUT_S}s"
      sleep 0.2
    done
  done
}

wait_for_redis() {
  local name=$1 port=$2
  for _ in $(seq 100); do
    # PONG, not just a zero exit: on a port in the ephemeral range with nothing listening,
    # the kernel can connect redis-cli to itself, which then reads its own PING back.
    [ "$({ redis-cli -p "$port" ping 2>/dev/null || true; } | tr -d '\r')" = PONG ] && return 0
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
  # Where the stock is: the one server, the master the sentinels name, or the cluster.
  # The lock nodes are the same three in every topology.
  local store=() node
  case $topology in
    single) store=(REDIS_URL="redis://127.0.0.1:$REDIS_PORT") ;;
    sentinel)
      store=(REDIS_SENTINELS="127.0.0.1:$SENTINEL1_PORT,127.0.0.1:$SENTINEL2_PORT,127.0.0.1:$SENTINEL3_PORT"
        REDIS_MASTER_NAME="$REDIS_MASTER_NAME")
      ;;
    cluster)
      local seeds=()
      for node in "${cluster_nodes[@]}"; do seeds+=("redis://127.0.0.1:$(port_of "$node")"); done
      store=(REDIS_CLUSTER="$(IFS=,; echo "${seeds[*]}")")
      ;;
  esac
  # Only the store of this topology: a REDIS_URL exported in the shell beside the sentinels
  # or the cluster is refused by the instance.
  env -u REDIS_URL -u REDIS_SENTINELS -u REDIS_CLUSTER PORT="$port" BIND_ADDR=127.0.0.1 INSTANCE_NAME="$name" WORKER_THREADS="$WORKER_THREADS" "${store[@]}" \
    LOCK_NODES="redis://127.0.0.1:$LOCK1_PORT,redis://127.0.0.1:$LOCK2_PORT,redis://127.0.0.1:$LOCK3_PORT" \
    setsid "$INVENTORY_BIN" >>"$RUN_DIR/$name.log" 2>&1 </dev/null &
  echo $! >"$(pidfile "$name")"
}

start_nginx() {
  mkdir -p "$RUN_DIR/nginx-tmp"
  # The instances' sale budget, as they read it from this environment: the wait for the
  # lock, the longest work, and four Redis timeouts (a call that outlives the wait, and the
  # pool's checkout round trips before a failed call answers), with 4 s to spare.
  local budget_ms=$(( ${LOCK_WAIT_MS:-10000} + ${MAX_WORK_MS:-2000} \
    + 4 * ${REDIS_TIMEOUT_MS:-1000} + 4000 ))
  sed -e "s|@RUN_DIR@|$(sed_escaped "$RUN_DIR")|g" -e "s|@CONF_DIR@|$(sed_escaped "$root/nginx")|g" \
      -e "s|@NGINX_PORT@|$NGINX_PORT|g" -e "s|@APP1_PORT@|$APP1_PORT|g" \
      -e "s|@APP2_PORT@|$APP2_PORT|g" -e "s|@PROXY_READ_TIMEOUT@|$(( (budget_ms + 999) / 1000 ))s|g" \
      "$root/nginx/nginx.native.conf.template" >"$RUN_DIR/nginx.conf"
  "$NGINX_BIN" -e "$RUN_DIR/nginx-error.log" -p "$RUN_DIR" -c "$RUN_DIR/nginx.conf"
}

wait_ready() {
  local deadline=$((SECONDS + READY_TIMEOUT_S)) url app
  for url in "http://127.0.0.1:$APP1_PORT/ready" "http://127.0.0.1:$APP2_PORT/ready" \
             "http://127.0.0.1:$NGINX_PORT/ready"; do
    # Quiet while it starts (a 503 until Redis answers is expected); the last answer is shown
    # when it never comes.
    until curl -fs -o /dev/null --max-time 2 "$url"; do
      # An instance that exited (a setting it refused) will never answer: say why now,
      # from its own log, rather than after the whole timeout among every other log.
      for app in app1 app2; do
        if [ -s "$(pidfile "$app")" ] && ! running "$app"; then
          tail -n 5 "$RUN_DIR/$app.log" >&2 || true
          die "$app exited at start (its log, above: $RUN_DIR/$app.log); what started is still running, stop it with: $0 down"
        fi
      done
      if [ $SECONDS -ge $deadline ]; then
        tail -n 20 "$RUN_DIR"/*.log >&2 || true
        # Its last answer says why (`not_replicated`: REPLICA_ACKS above the replicas).
        echo "last answer of $url: $(curl -sS --max-time 2 "$url" 2>&1 || true)" >&2
        die "$url was not ready within ${READY_TIMEOUT_S}s (its last answer is above)"
      fi
      sleep 0.2
    done
  done
}

# Refuses a port given to two services of the topology (a cluster node's bus port counts
# as its own): the second would fail to bind, and its start check, which only pings the
# port, would take the first service's answer for its own and call the stack ready.
check_distinct_ports() {
  local svc port
  local -A owner=()
  claim() {
    [ -z "${owner[$1]:-}" ] || die "${owner[$1]} and $2 are both port $1; give each service a port of its own"
    owner[$1]=$2
  }
  for svc in "$@"; do
    port=$(port_of "$svc")
    claim "$port" "${svc^^}_PORT"
    if is_cluster_node "$svc"; then claim $((port + 10000)) "${svc^^}_PORT+10000 (its cluster bus)"; fi
  done
}

up() {
  check_settings
  mkdir -p "$RUN_DIR"
  cd "$RUN_DIR"
  topology=$(requested_topology)
  local svc port services recorded
  services=$(topology_services "$topology")
  # shellcheck disable=SC2086 # one service a word
  check_distinct_ports $services
  recorded=$(topology_file)
  if [ -s "$recorded" ] && [ "$(cat "$recorded")" != "$topology" ] && [ -n "$(running_services)" ]; then
    die "the stack runs as topology $(cat "$recorded") ($(running_services)); run down first"
  fi
  if [ "$topology" = sentinel ]; then
    # shellcheck disable=SC2086 # one service a word
    services=$(sentinel_start_order $services)
  elif [ -s "$(master_file)" ] && [ "$(cat "$(master_file)")" != "127.0.0.1 $REDIS_PORT" ]; then
    # The single topology runs REDIS_PORT's server on its own data, which a failover left
    # behind: started so, it would put the sales made since up for sale again.
    die "the last sentinel run ended with its master on $(cat "$(master_file)" | tr ' ' :), \
not on REDIS_PORT ($REDIS_PORT): its data is newer than what a single stack would start \
from. Run TOPOLOGY=sentinel, or remove $(master_file) to start from the older data"
  fi
  for svc in $services; do
    running "$svc" && continue
    # Its leader is gone, but what it forked may still run: nginx's workers outlive a
    # master killed alone and keep its port, so that the new master could not bind it.
    clear_leftovers "$svc"
    port=$(port_of "$svc")
    if listening "$port"; then
      die "port $port (for $svc) is taken by another process; stop it or set ${svc^^}_PORT"
    fi
    if is_cluster_node "$svc" && listening $((port + 10000)); then
      die "port $((port + 10000)) (cluster bus of $svc) is taken by another process; stop it or set ${svc^^}_PORT"
    fi
  done
  echo "$topology" >"$recorded"
  # The ports of this run, for `status` (which asks the servers themselves) in a shell
  # that lacks the variables `up` had.
  for svc in "${all_services[@]}"; do echo "${svc^^}_PORT=$(port_of "$svc")"; done >"$(ports_file)"
  echo "REDIS_MASTER_NAME=$REDIS_MASTER_NAME" >>"$(ports_file)"
  for svc in $services; do
    if running "$svc"; then
      echo "$svc already running (pid $(cat "$(pidfile "$svc")"))"
      continue
    fi
    port=$(port_of "$svc")
    start_service "$svc" "$port"
    echo "$svc started on 127.0.0.1:$port"
  done
  case $topology in
    sentinel)
      rejoin_master
      wait_for_sentinels
      ;;
    cluster)
      create_cluster
      wait_for_cluster_replicas
      if ! app_knows_cluster; then
        echo "cluster ready: ${#cluster_nodes[@]} nodes from 127.0.0.1:$NODE1_PORT (run dir $RUN_DIR)"
        echo "note: the instances and nginx are not started on the cluster yet: $(basename "$INVENTORY_BIN") does not read REDIS_CLUSTER"
        return 0
      fi
      ;;
  esac
  wait_ready
  echo "stack ready ($topology): http://127.0.0.1:$NGINX_PORT (run dir $RUN_DIR)"
}

start_service() {
  local svc=$1 port=$2
  case $svc in
    redis) if [ "$topology" = sentinel ]; then start_replica redis "$port"; else start_redis redis "$port"; fi ;;
    replica1 | replica2) start_replica "$svc" "$port" ;;
    sentinel1 | sentinel2 | sentinel3) start_sentinel "$svc" "$port" ;;
    node[1-6]) start_cluster_node "$svc" "$port" ;;
    lock1 | lock2 | lock3) start_lock_node "$svc" "$port" ;;
    app1 | app2) start_app "$svc" "$port" ;;
    nginx) start_nginx ;;
    *) die "no way to start $svc" ;;
  esac
}

# The services whose process runs, whatever the topology.
running_services() {
  local svc out=()
  for svc in "${all_services[@]}"; do running "$svc" && out+=("$svc"); done
  echo "${out[*]}"
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

# The command name of a service's processes (at most 15 characters, as the kernel keeps it).
process_name() {
  case $1 in
    nginx) echo nginx ;;
    app1 | app2) basename "$INVENTORY_BIN" | cut -c1-15 ;;
    *) echo redis ;;
  esac
}

# The processes left of a service whose leader died (its pid file remains): killed, and the
# pid file removed. Nothing to do for a service that was stopped, or never started.
clear_leftovers() {
  local svc=$1 file pid left
  file=$(pidfile "$svc")
  [ -s "$file" ] || return 0
  pid=$(cat "$file")
  alive "$pid" && return 0
  left=$(members "$pid" "$(process_name "$svc")")
  if [ -n "$left" ]; then
    echo "$svc: its leader (pid $pid) is gone; stopping what is left of it (pid(s) $(paste -sd" " <<<"$left"))"
    stop_service "$svc" KILL "$(process_name "$svc")" >/dev/null || die "$svc: pid(s) $left survived SIGKILL"
  fi
  rm -f "$file"
}

down() {
  # Every service that has a pid file, whatever the topology: what was started is stopped,
  # also after a topology was changed by hand. nginx stops with SIGQUIT, its graceful stop
  # (finish the requests in flight); SIGTERM would be its fast one.
  local status=0 svc signal
  # The master of the moment, for the next `up` (the sentinels' files go below).
  if [ -s "$(topology_file)" ] && [ "$(cat "$(topology_file)")" = sentinel ]; then
    current_master >"$(master_file).new" && mv "$(master_file).new" "$(master_file)"
  fi
  for svc in "${all_services[@]}"; do
    case $svc in
      nginx) signal=QUIT ;;
      *) signal=TERM ;;
    esac
    stop_service "$svc" "$signal" "$(process_name "$svc")" || status=1
  done
  if [ $status = 0 ]; then
    # What the sentinels and the cluster nodes learnt belongs to the processes just
    # stopped: the next `up` starts them from scratch (the stock's append-only files stay).
    rm -f "$RUN_DIR"/sentinel[1-3].conf "$(topology_file)" "$(ports_file)"
    for svc in "${cluster_nodes[@]}"; do rm -rf "${RUN_DIR:?}/$svc"; done
  fi
  return $status
}

# `INFO replication` field of the server on port $1.
replication_field() { { redis-cli -p "$1" info replication 2>/dev/null || true; } | tr -d '\r' | sed -n "s/^$2://p"; }

status_sentinel() {
  local svc port master="" reply
  for svc in sentinel1 sentinel2 sentinel3; do
    running "$svc" || continue
    reply=$({ redis-cli -p "$(port_of "$svc")" sentinel get-master-addr-by-name "$REDIS_MASTER_NAME" 2>/dev/null || true; } | paste -sd: -)
    if [ -n "$reply" ]; then master=$reply; echo "master now (says $svc): $master"; break; fi
  done
  [ -n "$master" ] || echo "master now: unknown (no sentinel answers)"
  for svc in redis replica1 replica2; do
    running "$svc" || continue
    port=$(port_of "$svc")
    case $(replication_field "$port" role) in
      master)
        echo "$svc 127.0.0.1:$port: master, offset $(replication_field "$port" master_repl_offset), $(replication_field "$port" connected_slaves) replica(s) connected" ;;
      slave)
        echo "$svc 127.0.0.1:$port: replica of $(replication_field "$port" master_host):$(replication_field "$port" master_port), link $(replication_field "$port" master_link_status), offset $(replication_field "$port" slave_repl_offset)" ;;
      *) echo "$svc 127.0.0.1:$port: does not answer" ;;
    esac
  done
}

status_cluster() {
  local svc port=""
  for svc in "${cluster_nodes[@]}"; do
    if running "$svc"; then port=$(port_of "$svc"); break; fi
  done
  if [ -z "$port" ]; then echo "cluster: no node runs"; return; fi
  echo "cluster_state: $(cluster_field "$port" cluster_state) (asked 127.0.0.1:$port)"
  # CLUSTER NODES: id addr@bus flags master-id ping pong epoch link slot...
  { redis-cli -p "$port" cluster nodes 2>/dev/null || true; } | tr -d '\r' | awk '
    { id[NR] = $1; addr[$1] = $2; sub(/@.*/, "", addr[$1]); flags[NR] = $3; master[NR] = $4
      slots[NR] = ""; for (i = 9; i <= NF; i++) slots[NR] = slots[NR] " " $i; link[NR] = $8 }
    END {
      for (n = 1; n <= NR; n++) if (flags[n] ~ /master/)
        printf "master  %s slots%s (%s%s)\n", addr[id[n]], (slots[n] == "" ? " none" : slots[n]), link[n], (flags[n] ~ /fail/ ? ", failed" : "")
      for (n = 1; n <= NR; n++) if (flags[n] ~ /slave/)
        printf "replica %s follows %s (%s%s)\n", addr[id[n]], addr[master[n]], link[n], (flags[n] ~ /fail/ ? ", failed" : "")
    }' | sort
}

status() {
  local svc topology
  # shellcheck disable=SC1090 # written by `up`
  if [ -s "$(ports_file)" ]; then source "$(ports_file)"; fi
  topology=$(recorded_topology)
  echo "topology: $topology"
  for svc in $(topology_services "$topology"); do
    if running "$svc"; then
      echo "$svc: running (pid $(cat "$(pidfile "$svc")"), 127.0.0.1:$(port_of "$svc"))"
    else
      echo "$svc: stopped"
    fi
  done
  case $topology in
    sentinel) status_sentinel ;;
    cluster)
      status_cluster
      app_knows_cluster || echo "(the instances are not started on the cluster: the binary does not read REDIS_CLUSTER yet)"
      ;;
  esac
}

# One `up` or `down` at a time per run directory: two at once each started what they saw
# stopped, and the pid file named the copy that lost the port (it then exited), so `status`
# said stopped and `down` left the running one behind. flock(1) holds the lock in a process
# of its own and closes it for the script (-o), so the services started do not inherit it.
locked() {
  if [ -n "${STACK_LOCKED:-}" ] || ! command -v flock >/dev/null; then
    "$@"
    return
  fi
  mkdir -p "$RUN_DIR"
  local status=0
  STACK_LOCKED=1 flock -o -w "$((READY_TIMEOUT_S + STOP_TIMEOUT_S + 60))" -E 75 \
    "$RUN_DIR/.stack.lock" "$0" "$1" || status=$?
  [ "$status" -ne 75 ] || die "another up or down on $RUN_DIR did not finish in time; try again"
  exit "$status"
}

case ${1:-} in
  up) locked up ;;
  down) locked down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
