#!/usr/bin/env bash
# Budget leases, exhausting run (issue 24, point 6): one key with a limit of 20,000 per 60 s
# (fixed window), checked at full speed through the three nodes of a 4-node dev-cluster
# that do not own it, leases on. Admitted is counted from the nodes' own metrics: checks
# the owner admitted (ringlimit_checks_total{rule="whale",verdict="allowed"}, every node,
# which also counts fail-open stand-ins) plus checks the entries decided from leases
# (ringlimit_checks_from_lease_total). The run starts early in a minute and lasts under
# 10 s, so it stays inside one window. Must print admitted <= 20000 (and >= 19000).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
BIN=${BIN:-target/release/ringlimit}
DURATION=${DURATION:-5}
CONCURRENCY=${CONCURRENCY:-24}
THRESHOLD=${THRESHOLD:-100}
BASE=${BASE:-27420}
dir=$(mktemp -d)
cat >"$dir/whale.toml" <<'TOML'
[[rule]]
name = "whale"
route = "GET /bench"
algorithm = "fixed_window"
limit = 20000
window = "60s"
TOML

RINGLIMIT_LEASE_THRESHOLD=$THRESHOLD "$BIN" dev-cluster --nodes 4 --base-port "$BASE" \
    --rules "$dir/whale.toml" >/dev/null 2>&1 &
cluster=$!
trap 'kill $cluster 2>/dev/null || true; rm -rf "$dir"' EXIT
sleep 3
# Early in a minute: the whole run stays in one window.
while [ "$(date +%-S)" -lt 2 ] || [ "$(date +%-S)" -gt 45 ]; do sleep 1; done
owner=$("$BIN" check --addr "127.0.0.1:$BASE" --key client_0 --route "GET /bench" --json |
    sed -E 's/.*"node_id":"([^"]+)".*/\1/')
entries=()
for i in 0 1 2 3; do
    [ "node-$((i + 1))" = "$owner" ] || entries+=(--addr "127.0.0.1:$((BASE + 4 * i))")
done
echo "== exhausting: owner $owner, entries ${entries[*]}, started at $(date +%T)"
"$BIN" bench "${entries[@]}" --keys 1 --concurrency "$CONCURRENCY" --duration "$DURATION" \
    --warmup 1 2>/dev/null | grep -E 'checks/s' || true
echo "ended at $(date +%T)"
admitted=0 leased=0 open=0
for i in 0 1 2 3; do
    ops=$((BASE + 4 * i + 1))
    a=$(metric $ops ringlimit_checks_total 'rule="whale".*verdict="allowed"|verdict="allowed".*rule="whale"')
    l=$(metric $ops ringlimit_checks_from_lease_total)
    o=$(metric $ops ringlimit_degraded_total 'fail_open')
    echo "node-$((i + 1)): admitted as owner or stand-in $a, from leases $l, fail-open $o"
    admitted=$((admitted + a + l)) leased=$((leased + l)) open=$((open + o))
done
echo "admitted $admitted (limit 20000), of which from leases $leased; fail-open answers $open"
kill $cluster
wait $cluster 2>/dev/null || true
