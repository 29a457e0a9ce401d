#!/usr/bin/env bash
# Budget leases on and off (issue 24, docs/leases.md): one whale key under a limit the run
# cannot reach, sent at full speed through a node that does not own it, in a 3-node
# dev-cluster. Prints, per mode: checks/s and latency (the bench's own lines), how many of
# the whale's checks reached its owner (the entry's ringlimit_forwarded_total), how many
# the entry decided from leases, the owner's lease events, and the CPU of all three node
# processes per check. Mode "local" sends to the owner itself (leases off): the cost of a
# check decided where it arrives, without a hop. Short by default (DURATION=5): a sanity
# run, not a benchmark.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
BIN=${BIN:-target/release/ringlimit}
DURATION=${DURATION:-5}
WARMUP=${WARMUP:-1}
CONCURRENCY=${CONCURRENCY:-16}
THRESHOLD=${THRESHOLD:-100}
BASE=${BASE:-27420}
dir=$(mktemp -d)
cat >"$dir/whale.toml" <<'TOML'
[[rule]]
name = "whale"
route = "GET /bench"
algorithm = "fixed_window"
limit = 1000000000
window = "1h"
TOML

for mode in off local on; do
    threshold=0
    [ "$mode" = on ] && threshold=$THRESHOLD
    RINGLIMIT_LEASE_THRESHOLD=$threshold "$BIN" dev-cluster --nodes 3 --base-port "$BASE" \
        --rules "$dir/whale.toml" >/dev/null 2>&1 &
    cluster=$!
    trap 'kill $cluster 2>/dev/null || true' EXIT
    sleep 3
    owner=$("$BIN" check --addr "127.0.0.1:$BASE" --key client_0 --route "GET /bench" --json |
        sed -E 's/.*"node_id":"([^"]+)".*/\1/')
    entry_port=$BASE
    [ "$owner" = node-1 ] && entry_port=$((BASE + 4))
    [ "$mode" = local ] && entry_port=$((BASE + 4 * (${owner#node-} - 1)))
    owner_ops=$((BASE + 4 * (${owner#node-} - 1) + 1))
    pids=()
    for i in 0 1 2; do
        pids+=("$(ss -ltnp "sport = :$((BASE + 4 * i))" | grep -oE 'pid=[0-9]+' | head -1 | cut -d= -f2)")
    done
    local0=$(metric $((entry_port + 1)) ringlimit_checks_total)
    fwd0=$(metric $((entry_port + 1)) ringlimit_forwarded_total)
    lease0=$(metric $((entry_port + 1)) ringlimit_checks_from_lease_total)
    cpu0=$(cpu_ticks "${pids[@]}")
    echo "== $mode (--lease-threshold $threshold): owner $owner, sent to 127.0.0.1:$entry_port"
    out=$("$BIN" bench --addr "127.0.0.1:$entry_port" --keys 1 --concurrency "$CONCURRENCY" \
        --duration "$DURATION" --warmup "$WARMUP" 2>/dev/null)
    echo "$out" | grep -E 'checks/s|p99|CPU' || echo "$out"
    cpu1=$(cpu_ticks "${pids[@]}")
    fwd1=$(metric $((entry_port + 1)) ringlimit_forwarded_total)
    lease1=$(metric $((entry_port + 1)) ringlimit_checks_from_lease_total)
    local1=$(metric $((entry_port + 1)) ringlimit_checks_total)
    echo "entry: forwarded to the owner $((fwd1 - fwd0)), decided from leases $((lease1 - lease0)) (warm-up and measured)"
    echo "owner: $(curl -s "127.0.0.1:$owner_ops/metrics" | grep -E '^ringlimit_budget_leases_total' | tr '\n' ' ')"
    checks=$(( (fwd1 - fwd0) + (lease1 - lease0) ))
    [ "$mode" = local ] && checks=$((local1 - local0))
    hz=$(getconf CLK_TCK)
    if [ "$checks" -gt 0 ]; then
        echo "all three nodes: $(( (cpu1 - cpu0) * 1000000 / hz / checks )) us CPU per check of the whale ($checks checks)"
    fi
    kill $cluster
    wait $cluster 2>/dev/null || true
    trap - EXIT
    sleep 1
done
rm -rf "$dir"
