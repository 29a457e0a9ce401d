#!/usr/bin/env bash
# The measurement behind the HTTP/2 flow-control defaults (issue 14: "HTTP/2 settings
# chosen by measurement"). For each pair of windows (per stream, per connection) it runs
# the same closed-loop loads, rounds alternating between the settings so machine drift
# spreads over all of them, and prints each run's server CPU per check and checks/s,
# then the median of each (setting, load).
#
# Loads: one node unary and CheckBatch 32 (the public server's windows), and the 3-node
# cluster with random entry (the peer server's windows carry the forward streams).
#
# The header table is not among the settings: tonic's server builder does not expose
# SETTINGS_HEADER_TABLE_SIZE, so it stays at HTTP/2's 4,096 bytes, which holds every
# header a gRPC client repeats (they are sent indexed after the first call).
#
# DURATION (s per run, default 5) and ROUNDS (default 3). About 12 minutes with the
# defaults. Compare the settings within one run only.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=target/release/ringlimit
DURATION=${DURATION:-5}
ROUNDS=${ROUNDS:-3}
OUT=${OUT:-target/bench-results}
mkdir -p "$OUT"
[ -x "$BIN" ] || cargo build --release

# stream window, connection window: HTTP/2's initial 65,535 bytes for both, ringlimit's
# defaults, and hyper's server defaults and larger.
settings=("65535 65535" "262144 1048576" "1048576 4194304")
loads=("unary:--concurrency 50" "batch32:--concurrency 50 --batch 32" "cluster3:--nodes 3 --concurrency 50")

raw="$OUT/h2-settings.txt"
{
    echo "# bench/h2-settings.sh, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "# $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), DURATION=$DURATION ROUNDS=$ROUNDS"
} | tee "$raw"
for round in $(seq "$ROUNDS"); do
    for load in "${loads[@]}"; do
        name=${load%%:*}
        read -r -a args <<<"${load#*:}"
        for setting in "${settings[@]}"; do
            read -r stream conn <<<"$setting"
            out=$("$BIN" bench "${args[@]}" --duration "$DURATION" --warmup 1 \
                --node-arg=--h2-stream-window="$stream" \
                --node-arg=--h2-connection-window="$conn" 2>/dev/null || true)
            # A run that failed shows as n/a (left out of the medians), not as the end
            # of the measurement.
            cpu=$(grep -E '^ringlimit +server CPU' <<<"$out" | awk '{print $4}' || true)
            rate=$(grep -E '^ringlimit +checks/s' <<<"$out" | awk '{print $3}' || true)
            cpu=${cpu:-n/a} rate=${rate:-n/a}
            echo "round $round $name stream=$stream conn=$conn cpu_us_per_check $cpu checks_per_s $rate" | tee -a "$raw"
        done
    done
done

# The median of the numbers on stdin (the mean of the middle two for an even count).
median() {
    { grep -E '^[0-9.]+$' || true; } | sort -n | awk '{v[NR]=$1} END {
        if (NR == 0) print "n/a";
        else if (NR % 2) print v[(NR + 1) / 2];
        else printf "%.1f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
echo "# medians over $ROUNDS rounds" | tee -a "$raw"
for load in "${loads[@]}"; do
    name=${load%%:*}
    for setting in "${settings[@]}"; do
        read -r stream conn <<<"$setting"
        sel=$(grep -E "^round [0-9]+ $name stream=$stream conn=$conn " "$raw" || true)
        cpu=$(awk '{print $7}' <<<"$sel" | median)
        rate=$(awk '{print $9}' <<<"$sel" | median)
        printf '%-9s stream %8s conn %8s  CPU %5s us/check  %7s checks/s\n' "$name" "$stream" "$conn" "$cpu" "$rate" | tee -a "$raw"
    done
done
