#!/usr/bin/env bash
# Runs every scenario of bench/RESULTS.md and leaves the raw output in $OUT (default
# target/bench-results). Takes about 10 minutes on 2 cores. Needs a release build.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=target/release/ringlimit
OUT=${OUT:-target/bench-results}
DURATION=${DURATION:-10}
ROUNDS=${ROUNDS:-3}
mkdir -p "$OUT"
[ -x "$BIN" ] || cargo build --release

run() { # name, args...
    local name=$1; shift
    echo "== $name: $BIN bench $*" | tee "$OUT/$name.txt"
    "$BIN" bench "$@" 2>/dev/null | tee -a "$OUT/$name.txt"
}

run unary-c50 --compare-redis --concurrency 50 --duration "$DURATION" --rounds "$ROUNDS"
run batch32-c50 --compare-redis --concurrency 50 --batch 32 --duration "$DURATION" --rounds "$ROUNDS"
run unary-c10 --compare-redis --concurrency 10 --duration "$DURATION" --rounds "$ROUNDS"
run cluster3-unary-c50 --nodes 3 --concurrency 50 --duration "$DURATION"
run cluster3-batch32-c50 --nodes 3 --concurrency 50 --batch 32 --duration "$DURATION"
run single-batch32-c50 --nodes 1 --concurrency 50 --batch 32 --duration "$DURATION"
run zipf-unary-c50 --compare-redis --concurrency 50 --distribution zipf --zipf-s 1.1 --duration "$DURATION"

# Hot abusive key: one key at full speed through a node that does not own it. Nodes of
# dev-cluster share one process, so /metrics of any node shows the process' totals: all
# decisions are the owner's (the entry node forwards), and deny-cache hits the entry's.
echo "== hot-key" | tee "$OUT/hot-key.txt"
"$BIN" dev-cluster --nodes 3 --base-port 18420 >/dev/null 2>&1 &
cluster=$!
trap 'kill $cluster 2>/dev/null || true' EXIT
sleep 3
owner=$("$BIN" check --addr 127.0.0.1:18420 --key client_0 --route "GET /bench" --json | sed -E 's/.*"node_id":"([^"]+)".*/\1/')
entry=127.0.0.1:18420
[ "$owner" = node-1 ] && entry=127.0.0.1:18424   # dev-cluster: node i on base+4i
echo "owner of client_0: $owner; sending through $entry" | tee -a "$OUT/hot-key.txt"
"$BIN" bench --addr "$entry" --keys 1 --concurrency 50 --duration "$DURATION" 2>/dev/null | tee -a "$OUT/hot-key.txt"
curl -s 127.0.0.1:18421/metrics | grep -E '^ringlimit_(checks_total|deny_cache_hits_total|forwarded_total)' | tee -a "$OUT/hot-key.txt"
kill $cluster; wait $cluster 2>/dev/null || true
trap - EXIT

for algorithm in token_bucket leaky_bucket fixed_window sliding_window_counter sliding_window_log; do
    extra=()
    [ "$algorithm" = sliding_window_counter ] && extra=(--compare-redis)
    run "memory-$algorithm" --memory --algorithm "$algorithm" --keys 1000000 "${extra[@]}"
done

echo "== microbenchmarks" | tee "$OUT/micro.txt"
cargo bench --bench decision 2>/dev/null | tee -a "$OUT/micro.txt"
