#!/usr/bin/env bash
# Budget lease thresholds side by side (issue 24: the default threshold, chosen by
# measurement). A 3-node dev-cluster per run, all load sent to one node; every mode runs
# once per round, in turn, so the machine's load falls on all of them alike.
#   bench/leases-threshold.sh [ROUNDS] [MODE...]
# A MODE is a --lease-threshold (0: leases off) or `local` (leases off, and with KEYS=1 the
# load goes to the whale's owner itself: a check decided where it arrives). Default modes:
# 0 local 50 100 200 500.
# KEYS=1 (default): one whale key under a limit it cannot reach, sent to a node that does
# not own it. KEYS=10000 DISTRIBUTION=uniform|zipf: many keys through node-1 (about a third
# owned by it). Open loop at RATE checks/s (0: closed loop) so every mode does the same work.
# Per run: checks/s, p99, the entry's checks decided locally / forwarded / from leases, the
# grants (granted + renewed) and returns on all nodes, and all three nodes' CPU per check.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
BIN=${BIN:-target/release/ringlimit}
ROUNDS=${1:-3}
shift $(($# < 1 ? $# : 1))
MODES=("$@")
[ ${#MODES[@]} -eq 0 ] && MODES=(0 local 50 100 200 500)
DURATION=${DURATION:-5}
WARMUP=${WARMUP:-1}
CONCURRENCY=${CONCURRENCY:-16}
KEYS=${KEYS:-1}
DISTRIBUTION=${DISTRIBUTION:-uniform}
RATE=${RATE:-6000}
BASE=${BASE:-27460}
dir=$(mktemp -d)
cat >"$dir/rules.toml" <<'TOML'
[[rule]]
name = "whale"
route = "GET /bench"
algorithm = "fixed_window"
limit = 1000000000
window = "1h"
TOML

all_nodes() { # sum of metric $1 (lines matching $2) over the three nodes
    local s=0
    for i in 0 1 2; do s=$((s + $(metric $((BASE + 4 * i + 1)) "$1" "${2:-.}"))); done
    echo "$s"
}

out=$(mktemp)
hz=$(getconf CLK_TCK)
for r in $(seq 1 "$ROUNDS"); do
    for mode in "${MODES[@]}"; do
        threshold=$mode
        [ "$mode" = local ] && threshold=0
        RINGLIMIT_LEASE_THRESHOLD=$threshold "$BIN" dev-cluster --nodes 3 --base-port "$BASE" \
            --rules "$dir/rules.toml" >/dev/null 2>&1 &
        cluster=$!
        trap 'kill $cluster 2>/dev/null || true' EXIT
        sleep 3
        entry_port=$BASE
        if [ "$KEYS" = 1 ]; then
            owner=$("$BIN" check --addr "127.0.0.1:$BASE" --key client_0 --route "GET /bench" --json |
                sed -E 's/.*"node_id":"([^"]+)".*/\1/')
            [ "$owner" = node-1 ] && entry_port=$((BASE + 4))
            [ "$mode" = local ] && entry_port=$((BASE + 4 * (${owner#node-} - 1)))
        fi
        pids=()
        for i in 0 1 2; do
            pids+=("$(ss -ltnp "sport = :$((BASE + 4 * i))" | grep -oE 'pid=[0-9]+' | head -1 | cut -d= -f2)")
        done
        ops=$((entry_port + 1))
        local0=$(metric $ops ringlimit_checks_total)
        fwd0=$(metric $ops ringlimit_forwarded_total)
        lease0=$(metric $ops ringlimit_checks_from_lease_total)
        cpu0=$(cpu_ticks "${pids[@]}")
        res=$("$BIN" bench --addr "127.0.0.1:$entry_port" --keys "$KEYS" --distribution "$DISTRIBUTION" \
            --concurrency "$CONCURRENCY" --duration "$DURATION" --warmup "$WARMUP" --rate "$RATE" 2>/dev/null |
            grep -E 'checks/s' | tail -1 | tr -s ' ')
        cpu1=$(cpu_ticks "${pids[@]}")
        local1=$(metric $ops ringlimit_checks_total)
        fwd1=$(metric $ops ringlimit_forwarded_total)
        lease1=$(metric $ops ringlimit_checks_from_lease_total)
        grants=$(all_nodes ringlimit_budget_leases_total 'granted|renewed')
        returns=$(all_nodes ringlimit_budget_leases_total 'returned')
        kill $cluster
        wait $cluster 2>/dev/null || true
        trap - EXIT
        locl=$((local1 - local0)) fwd=$((fwd1 - fwd0)) lease=$((lease1 - lease0))
        checks=$((locl + fwd + lease))
        us=$(((cpu1 - cpu0) * 1000000 / hz / (checks > 0 ? checks : 1)))
        cps=$(echo "$res" | sed -E 's/.*checks\/s ([0-9]+).*/\1/')
        p99=$(echo "$res" | sed -E 's/.*p99 ([0-9.]+ ms).*/\1/')
        echo "round=$r mode=$mode checks/s=$cps p99=$p99 local=$locl forwarded=$fwd leased=$lease grants=$grants returns=$returns cpu_us_per_check=$us" | tee -a "$out"
        sleep 1
    done
done
echo "medians over $ROUNDS rounds (KEYS=$KEYS $DISTRIBUTION RATE=$RATE): CPU µs/check (ratio to ${MODES[0]}), share of the entry's remote checks decided from leases, grants per s"
awk -v d="$DURATION" -v w="$WARMUP" '
    function med(s,   a, k, i, j, t) { k = split(s, a, " "); for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (a[j] + 0 < a[i] + 0) { t = a[i]; a[i] = a[j]; a[j] = t } return k % 2 ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2 }
    { delete f; for (i = 1; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
      m = f["mode"]; if (!(m in seen)) { seen[m] = 1; order[++n] = m }
      cpu[m] = cpu[m] " " f["cpu_us_per_check"]
      rem = f["forwarded"] + f["leased"]; share[m] = share[m] " " (rem ? f["leased"] / rem : 0)
      gps[m] = gps[m] " " f["grants"] / (d + w) }
    END { base = med(cpu[order[1]]); for (i = 1; i <= n; i++) { m = order[i]; c = med(cpu[m]); printf "%-6s %6.1f µs/check  %.3f×  leased %.4f  grants/s %.1f  (cpu:%s)\n", m, c, c / base, med(share[m]), med(gps[m]), cpu[m] } }
' "$out"
rm -rf "$dir" "$out"
