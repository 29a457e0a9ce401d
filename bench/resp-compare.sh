#!/usr/bin/env bash
# ringlimit's RESP face against Redis at Redis's own protocol: redis-benchmark drives
# `CL.THROTTLE` on one ringlimit node and `EVALSHA` of bench/resp-gcra.lua (the same
# GCRA, the same five integers) on a redis-server, with the same client, the same
# concurrency and the same key space, pipelined (-P 16) and not, runs alternating so
# machine drift spreads over both. For each run it prints the server's CPU per call
# (utime + stime from /proc/<pid>/stat, before and after) and redis-benchmark's calls/s,
# then the medians and their ratios (ringlimit / Redis: CPU below 1 is cheaper).
#
# Needs redis-server and redis-benchmark (Debian: redis-server, redis-tools) and a
# release build. REQUESTS per run (default 200000), CLIENTS (default 50), ROUNDS
# (default 3), THREADS for the node (default 1: like Redis, one thread), KEYS (key
# space, default 100000).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
BIN=target/release/ringlimit
REQUESTS=${REQUESTS:-200000}
CLIENTS=${CLIENTS:-50}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-1}
KEYS=${KEYS:-100000}
OUT=${OUT:-target/bench-results}
mkdir -p "$OUT"
for tool in redis-server redis-benchmark redis-cli; do
    command -v "$tool" >/dev/null || { echo "SKIPPED: $tool not installed (Debian: redis-server, redis-tools)"; exit 0; }
done
[ -x "$BIN" ] || cargo build --release --bin ringlimit

scratch=$(mktemp -d /tmp/ringlimit-resp-bench-XXXXXX)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$scratch"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Redis: no persistence, nothing else running in it.
redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
    --daemonize no --logfile "$scratch/redis.log" &
redis_pid=$!
pids+=("$redis_pid")
# ringlimit: one node, its RESP face.
"$BIN" serve --node-id bench --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
    --gossip-listen 127.0.0.1:0 --peer-listen 127.0.0.1:0 --resp-listen 127.0.0.1:0 \
    --threads "$THREADS" --shards "$THREADS" >"$scratch/ready" 2>"$scratch/node.log" &
node_pid=$!
pids+=("$node_pid")
for _ in $(seq 100); do
    grep -q 'resp=' "$scratch/ready" 2>/dev/null && redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break
    sleep 0.1
done
node_port=$(grep -o 'resp=[^ ]*' "$scratch/ready" | sed 's/.*://')
sha=$(redis-cli -p "$redis_port" SCRIPT LOAD "$(cat bench/resp-gcra.lua)")
# The two answer alike (limit 60, one more per week: the first calls are admitted).
echo "ringlimit: $(redis-cli -p "$node_port" CL.THROTTLE probe 59 1 604800 | tr '\n' ' ')"
echo "redis:     $(redis-cli -p "$redis_port" EVALSHA "$sha" 1 probe 59 1 604800 1 | tr '\n' ' ')"

raw="$OUT/resp-compare.txt"
{
    echo "# bench/resp-compare.sh, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "# $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), REQUESTS=$REQUESTS CLIENTS=$CLIENTS ROUNDS=$ROUNDS THREADS=$THREADS KEYS=$KEYS, $(redis-server --version | cut -d' ' -f1-3)"
} | tee "$raw"

# One run: prints "cpu_us_per_call calls_per_s".
run() { # side pipeline
    local side=$1 pipeline=$2 port pid
    local -a cmd
    if [ "$side" = ringlimit ]; then
        port=$node_port pid=$node_pid
        cmd=(CL.THROTTLE "key:__rand_int__" 59 1 604800)
    else
        port=$redis_port pid=$redis_pid
        cmd=(EVALSHA "$sha" 1 "key:__rand_int__" 59 1 604800 1)
    fi
    local before after out rate
    before=$(cpu_ticks "$pid")
    out=$(redis-benchmark -h 127.0.0.1 -p "$port" -c "$CLIENTS" -n "$REQUESTS" -r "$KEYS" \
        -P "$pipeline" -q "${cmd[@]}" 2>/dev/null | tr '\r' '\n' | grep 'requests per second' | tail -1)
    after=$(cpu_ticks "$pid")
    rate=$(awk '{for (i = 1; i <= NF; i++) if ($(i+1) == "requests") print $i}' <<<"$out")
    awk -v t=$((after - before)) -v hz="$(getconf CLK_TCK)" -v n="$REQUESTS" -v r="$rate" \
        'BEGIN { printf "%.2f %s\n", t / hz * 1e6 / n, r }'
}

for round in $(seq "$ROUNDS"); do
    for pipeline in 1 16; do
        for side in ringlimit redis; do
            read -r cpu rate < <(run "$side" "$pipeline")
            echo "round $round P=$pipeline $side cpu_us_per_call $cpu calls_per_s $rate" | tee -a "$raw"
        done
    done
done

echo
echo "medians (cpu µs per call, calls/s) and ratios ringlimit / redis:"
for pipeline in 1 16; do
    med() { grep " P=$pipeline $1 " "$raw" | awk -v f="$2" '{print $f}' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
    rc=$(med ringlimit 6) rr=$(med ringlimit 8) dc=$(med redis 6) dr=$(med redis 8)
    awk -v p="$pipeline" -v rc="$rc" -v rr="$rr" -v dc="$dc" -v dr="$dr" 'BEGIN {
        printf "P=%-2s ringlimit %6.2f µs %10.0f/s   redis %6.2f µs %10.0f/s   cpu ratio %.2f   rate ratio %.2f\n",
            p, rc, rr, dc, dr, rc / dc, rr / dr }' | tee -a "$raw"
done
