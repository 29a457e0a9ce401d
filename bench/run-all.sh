#!/usr/bin/env bash
# Runs every scenario of bench/RESULTS.md (issue 14, part 5) and leaves the raw output
# of each in $OUT (default target/bench-results), plus $OUT/summary.txt: one line per
# figure with checks/s, p50/p99/p99.9 and server CPU per check, and the command.
#
# Scenarios: native Check and CheckBatch 32 against Redis + the reference Lua; tonic's
# health check beside them (the floor of a unary gRPC call); the true floor (a bare tonic
# server's health check beside the node's health, Check and Envoy RLS, and the bare
# server with each of the node's layers; h2load too when installed); Envoy RLS
# and Gubernator against the native Check on the same node; 3-node cluster with random
# entry and with the ring-aware client (plain and coalescing); half-peak latency (open
# loop at half the closed-loop peak just measured) on one node (Redis beside it at the same
# rate, as the control) and on the 3-node cluster;
# a hot key through a node that does not own it; memory per key at 1,000,000 keys for
# every algorithm; the HTTP/2 window settings (bench/h2-settings.sh); allocations per
# check; the store and algorithm microbenchmarks. At the end, issue 25's table
# (bench/table.sh): every row as a ratio of this run with the issue's figure and goal.
#
# Takes about 30 minutes on 2 cores with the defaults. Needs nothing but a release build
# (made if missing) and Debian's redis-server (installed by `ringlimit bench` if missing).
# DURATION (s per run, default 8) and ROUNDS (alternating rounds, default 2; H2_ROUNDS,
# default 3, for bench/h2-settings.sh) trade time for spread. Run it on a quiet machine:
# compare ratios within one run, not across runs.
#
# TABLE_ONLY=1 runs only the scenarios issue 25's table reads (about 10 minutes on 2
# cores with DURATION=5 ROUNDS=2 WARMUP=1): unary and CheckBatch 32 against Redis, the
# true floor on 2 workers and on one, the fronts, forwarded against local, the gateway
# path (ring-aware client, coalescing) against Redis on 1 and 3 nodes, half of peak.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=target/release/ringlimit
OUT=${OUT:-target/bench-results}
DURATION=${DURATION:-8}
ROUNDS=${ROUNDS:-2}
WARMUP=${WARMUP:-2}
TABLE_ONLY=${TABLE_ONLY:-0}
mkdir -p "$OUT"
: >"$OUT/summary.txt"
[ -x "$BIN" ] || cargo build --release

{
    echo "# ringlimit bench/run-all.sh, $(date -u +%Y-%m-%dT%H:%MZ)"
    echo "# commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"
    echo "# $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), DURATION=$DURATION ROUNDS=$ROUNDS WARMUP=$WARMUP TABLE_ONLY=$TABLE_ONLY"
} | tee -a "$OUT/summary.txt"

run() { # name, bench args...
    local name=$1
    shift
    echo "== $name: $BIN bench $*" | tee "$OUT/$name.txt"
    "$BIN" bench --warmup "$WARMUP" "$@" 2>/dev/null | tee -a "$OUT/$name.txt"
    {
        echo "== $name: ringlimit bench --warmup $WARMUP $*"
        # Every measured run's figure line and every ratio line of the scenario.
        grep -E '^(ringlimit|redis|envoy-rls|gubernator|ring-aware|health|local|forwarded) +(checks/s|server CPU)|^median|^ratio|^floor' "$OUT/$name.txt" || true
    } >>"$OUT/summary.txt"
}

# The median closed-loop checks/s of the system named $2 in scenario file $1.
peak() {
    grep -E "^$2 +checks/s" "$OUT/$1.txt" | awk '{print $3}' | sort -n |
        awk '{v[NR]=$1} END {if (NR == 0) exit 1; print v[int((NR + 1) / 2)]}'
}

common=(--concurrency 50 --duration "$DURATION")

# One node: the native API against Redis + Lua, unary and batched.
run unary-c50 --compare-redis "${common[@]}" --rounds "$ROUNDS"
run batch32-c50 --compare-redis "${common[@]}" --batch 32 --rounds "$ROUNDS"
if [ "$TABLE_ONLY" != 1 ]; then
# The same with the node on one worker thread (`serve --threads 1`), like single-threaded
# Redis: on cores it shares with the load generator, no wake-ups between its own threads.
run unary-c50-threads1 --compare-redis --node-arg=--threads=1 "${common[@]}" --rounds "$ROUNDS"
run unary-c10 --compare-redis --concurrency 10 --duration "$DURATION" --rounds "$ROUNDS"
run zipf-unary-c50 --compare-redis "${common[@]}" --distribution zipf --zipf-s 1.1

# The floor: tonic's own health check (a call that decides nothing) beside the native
# Check and Redis, alternating on one node: what any unary gRPC call costs this server.
run health-floor-c50 --protocol health --compare-redis "${common[@]}" --rounds "$ROUNDS"
run health-floor-threads1-c50 --protocol health --node-arg=--threads=1 "${common[@]}" --rounds "$ROUNDS"
fi

# The true floor (issue 25, point 0): a bare tonic server (this binary's hidden
# bench-floor-server: the same tonic, hyper and runtime builder, health only, no layers)
# beside the node's health check, native Check and Envoy RLS, and the bare server with
# each of the node's layers, alternating; h2load's rounds when h2load is on the PATH
# (Debian's nghttp2-client, installed by .ci/deps; skipped with a message otherwise).
run floor-c50 --protocol floor "${common[@]}" --rounds "$ROUNDS"
run floor-threads1-c50 --protocol floor --node-arg=--threads=1 "${common[@]}" --rounds "$ROUNDS"

# One node: Envoy RLS and Gubernator against the native Check, alternating on one node.
run fronts-c50 --protocol all "${common[@]}" --rounds "$ROUNDS"

# Forwarded against local (issue 25, point 2), alternating in one run on a 3-node
# cluster: every caller's keys are those its node owns, then those it does not own.
run forwarded-c50 --nodes 3 --entry both "${common[@]}" --rounds "$ROUNDS"

# The gateway path as a user runs it (issue 25, point 3): the client crate, ring-aware
# and coalescing, beside Redis + Lua with the same callers, on one node and on 3.
run gateway-nodes1 --client ring-aware --coalesce --compare-redis "${common[@]}" --rounds "$ROUNDS"
run gateway-nodes3 --nodes 3 --client ring-aware --coalesce --compare-redis "${common[@]}" --rounds "$ROUNDS"

if [ "$TABLE_ONLY" != 1 ]; then
# 3-node cluster: random entry (about 2/3 forwarded), batched, and the ring-aware client
# (each round also runs a random-entry round first, for a ratio within one run).
run cluster3-unary-c50 --nodes 3 "${common[@]}"
# The same with one unary Peer/Forward call per batch instead of the per-peer stream.
run cluster3-unary-forward-calls-c50 --nodes 3 --node-arg=--forward-unary "${common[@]}"
# Each node on one worker thread: three sidecars sharing two cores.
run cluster3-unary-threads1-c50 --nodes 3 --node-arg=--threads=1 "${common[@]}"
run cluster3-batch32-c50 --nodes 3 "${common[@]}" --batch 32
run single-batch32-c50 --nodes 1 "${common[@]}" --batch 32
run cluster3-ring-aware --nodes 3 --client ring-aware "${common[@]}" --rounds "$ROUNDS"
run cluster3-ring-aware-coalesce --nodes 3 --client ring-aware --coalesce "${common[@]}"
fi

# Latency at half of the peak just measured (open loop: no coordinated omission).
one_peak=$(peak unary-c50 ringlimit)
# Redis at the same open-loop rate is the control: what the machine and the load
# generator sharing its cores add to any server's tail at this load.
run half-peak-one-node --compare-redis --rate "$(awk -v p="$one_peak" 'BEGIN {printf "%d", p / 2}')" "${common[@]}" --rounds "$ROUNDS"
if [ "$TABLE_ONLY" != 1 ]; then
cluster_peak=$(peak cluster3-unary-c50 ringlimit)
run half-peak-cluster3 --nodes 3 --rate "$(awk -v p="$cluster_peak" 'BEGIN {printf "%d", p / 2}')" "${common[@]}"
fronts_peak=$(peak fronts-c50 envoy-rls)
run half-peak-envoy-rls --protocol envoy-rls --rate "$(awk -v p="$fronts_peak" 'BEGIN {printf "%d", p / 2}')" "${common[@]}"

# Hot abusive key: one key at full speed through a node that does not own it. Nodes of
# dev-cluster share one process, so /metrics of any node shows the process' totals: all
# decisions are the owner's (the entry node forwards), and deny-cache hits the entry's.
# dev-cluster takes a base port (node i on base + 4i); pick one in a random range.
base=${BASE_PORT:-$((20000 + RANDOM % 20000))}
echo "== hot-key (dev-cluster on base port $base)" | tee "$OUT/hot-key.txt"
"$BIN" dev-cluster --nodes 3 --base-port "$base" >/dev/null 2>&1 &
cluster=$!
trap 'kill $cluster 2>/dev/null || true' EXIT
sleep 3
owner=$("$BIN" check --addr "127.0.0.1:$base" --key client_0 --route "GET /bench" --json | sed -E 's/.*"node_id":"([^"]+)".*/\1/')
entry=127.0.0.1:$base
[ "$owner" = node-1 ] && entry=127.0.0.1:$((base + 4))
echo "owner of client_0: $owner; sending through $entry" | tee -a "$OUT/hot-key.txt"
"$BIN" bench --addr "$entry" --keys 1 "${common[@]}" --warmup "$WARMUP" 2>/dev/null | tee -a "$OUT/hot-key.txt"
curl -s "127.0.0.1:$((base + 1))/metrics" | grep -E '^ringlimit_(checks_total|deny_cache_hits_total|forwarded_total)' | tee -a "$OUT/hot-key.txt"
kill $cluster
wait $cluster 2>/dev/null || true
trap - EXIT
{
    echo "== hot-key: ringlimit bench --addr <non-owner> --keys 1 ${common[*]}"
    grep -E '^ringlimit +checks/s|^ringlimit_' "$OUT/hot-key.txt" || true
} >>"$OUT/summary.txt"

# Memory per key at 1,000,000 keys (RSS delta), every algorithm; Redis for the one the
# reference's Lua implements.
for algorithm in token_bucket leaky_bucket fixed_window sliding_window_counter sliding_window_log; do
    extra=()
    [ "$algorithm" = sliding_window_counter ] && extra=(--compare-redis)
    echo "== memory-$algorithm: $BIN bench --memory --algorithm $algorithm --keys 1000000 ${extra[*]}" | tee "$OUT/memory-$algorithm.txt"
    "$BIN" bench --memory --algorithm "$algorithm" --keys 1000000 "${extra[@]}" 2>/dev/null | tee -a "$OUT/memory-$algorithm.txt"
    {
        echo "== memory-$algorithm"
        grep -iE 'bytes' "$OUT/memory-$algorithm.txt" || true
    } >>"$OUT/summary.txt"
done

# HTTP/2 flow-control windows: the measurement behind the defaults (its own script).
OUT="$OUT" DURATION="$DURATION" ROUNDS="${H2_ROUNDS:-3}" bash bench/h2-settings.sh >/dev/null
{
    echo "== h2-settings: bench/h2-settings.sh (CPU per check and checks/s, medians)"
    sed -n '/^# medians/,$p' "$OUT/h2-settings.txt"
} >>"$OUT/summary.txt"

# Allocations per check (a counting allocator, not timed) with the nodes' defaults, then
# without replicas (the check path alone), and the microbenchmarks.
echo "== allocations: cargo bench --bench allocations" | tee "$OUT/allocations.txt"
cargo bench --bench allocations 2>/dev/null | tee -a "$OUT/allocations.txt"
echo "== allocations: RINGLIMIT_BENCH_REPLICATE_MS=0 cargo bench --bench allocations" | tee -a "$OUT/allocations.txt"
RINGLIMIT_BENCH_REPLICATE_MS=0 cargo bench --bench allocations 2>/dev/null | tee -a "$OUT/allocations.txt"
echo "== microbenchmarks: cargo bench --bench decision" | tee "$OUT/micro.txt"
cargo bench --bench decision 2>/dev/null | tee -a "$OUT/micro.txt"
{
    grep -iE 'alloc|replicate every' "$OUT/allocations.txt" || true
    echo "== microbenchmarks: cargo bench --bench decision"
    # divan's table: name, fastest, slowest, median, mean, samples, iterations.
    grep -E '[0-9.]+ (ns|µs|ms) +│' "$OUT/micro.txt" || true
} >>"$OUT/summary.txt"

fi

bash bench/table.sh "$OUT" >>"$OUT/summary.txt"
echo
echo "summary: $OUT/summary.txt"
cat "$OUT/summary.txt"
