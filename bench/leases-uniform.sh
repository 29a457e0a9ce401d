#!/usr/bin/env bash
# What budget leases cost traffic that is never hot (issue 24, docs/leases.md "What it
# costs"): 3 local nodes, uniform keys (10,000 by default, so each key is seen a few times
# a second at most), every check sent to a node that does not own its key, each mode in
# turn in every round (alternating, so the machine's load falls on all of them alike).
#   bench/leases-uniform.sh [ROUNDS] [MODE...]
# A MODE is label=binary:threshold (default: off=$BIN:0 on=$BIN:100). Prints one line per
# run, then per mode the median server CPU per check and its ratio to the first mode's.
# Environment: BIN, KEYS (10000), CONCURRENCY (32), DURATION (5 s), RATE (6000 checks/s).
set -euo pipefail
BIN=${BIN:-target/release/ringlimit}
ROUNDS=${1:-5}
shift $(($# < 1 ? $# : 1))
MODES=("$@")
[ ${#MODES[@]} -eq 0 ] && MODES=("off=$BIN:0" "on=$BIN:100")
KEYS=${KEYS:-10000}
CONCURRENCY=${CONCURRENCY:-32}
DURATION=${DURATION:-5}
# Open loop at a fixed rate by default, below what the machine sustains even when loaded:
# every mode does the same work per second, so CPU per check compares like with like (in a
# closed loop a faster run batches more and pays less per check). RATE=0: closed loop.
RATE=${RATE:-6000}
out=$(mktemp)
for r in $(seq 1 "$ROUNDS"); do
    for mode in "${MODES[@]}"; do
        label=${mode%%=*}
        rest=${mode#*=}
        bin=${rest%:*}
        threshold=${rest##*:}
        line=$("$bin" bench --nodes 3 --entry non-owner --keys "$KEYS" --concurrency "$CONCURRENCY" \
            --duration "$DURATION" --warmup 1 --rate "$RATE" "--node-arg=--lease-threshold=$threshold" 2>/dev/null |
            grep -E '^forwarded +(checks/s|server CPU)' | tr -s ' ' | tr '\n' ' ')
        echo "round=$r mode=$label threshold=$threshold $line" | tee -a "$out"
    done
done
echo "median server CPU per check (µs) over $ROUNDS rounds, and ratio to ${MODES[0]%%=*}:"
awk '
    { for (i = 1; i <= NF; i++) if ($i == "CPU") { split($(i + 1), v, "µ"); m = $2; sub("mode=", "", m); cpu[m] = cpu[m] " " v[1]; if (!(m in seen)) { seen[m] = 1; order[++n] = m } } }
    function median(s,   a, k, i, j, t) { k = split(s, a, " "); for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (a[j] + 0 < a[i] + 0) { t = a[i]; a[i] = a[j]; a[j] = t } return k % 2 ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2 }
    END { base = median(cpu[order[1]]); for (i = 1; i <= n; i++) { m = median(cpu[order[i]]); printf "%-10s %6.1f µs/check  %.3f×  (runs:%s)\n", order[i], m, m / base, cpu[order[i]] } }
' "$out"
rm -f "$out"
