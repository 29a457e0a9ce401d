#!/usr/bin/env bash
# Two builds side by side against their own floors, in one run: for each build, its bare
# tonic server (`bench-floor-server`, health only) and one node, both with the same
# serve flags (e.g. `--threads 1`), driven in turn by the same lean client (c=50, the
# NEW build's `bench --addr`), the order rotated every round. Prints one line per round
# with each server's CPU per call (µs, from /proc) and calls/s, then the medians and
# each build's node ÷ bare per round.
#   bench/floor-ab.sh BASE_BIN NEW_BIN [ROUNDS] [DURATION] [serve flags...]
# BASE_FLAGS / NEW_FLAGS: more serve flags for one build's node only (say, to switch a
# feature off in the same binary).
set -euo pipefail
BASE=${1:?base binary}
NEW=${2:?new binary}
ROUNDS=${3:-5}
DURATION=${4:-4}
shift $(($# < 4 ? $# : 4))
FLAGS=("$@")
dir=$(mktemp -d /tmp/ringlimit-floor-ab.XXXXXX)
printf '[default]\nalgorithm = "sliding_window_counter"\nlimit = 1000000\nwindow = "60s"\n' >"$dir/rules.toml"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$dir"' EXIT

# Floor servers take only --threads of the serve flags.
threads=()
for ((i = 0; i < ${#FLAGS[@]}; i++)); do
    case ${FLAGS[i]} in
    --threads=*) threads=("${FLAGS[i]}") ;;
    --threads) threads=(--threads "${FLAGS[i + 1]}") ;;
    esac
done

start() { # name bin kind [extra flags...]
    local name=$1 bin=$2 kind=$3
    shift 3
    if [ "$kind" = bare ]; then
        RUST_LOG=warn "$bin" bench-floor-server "${threads[@]}" >"$dir/$name.log" 2>&1 &
    else
        RUST_LOG=warn "$bin" serve --node-id "$name" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
            --gossip-listen 127.0.0.1:0 --peer-listen 127.0.0.1:0 --rules "$dir/rules.toml" \
            --insecure-cluster "${FLAGS[@]}" "$@" >"$dir/$name.log" 2>&1 &
    fi
    pids+=($!)
}
# shellcheck disable=SC2086 # the *_FLAGS are lists of flags
{
    start bare-base "$BASE" bare
    start node-base "$BASE" node ${BASE_FLAGS:-}
    start bare-new "$NEW" bare
    start node-new "$NEW" node ${NEW_FLAGS:-}
}
sleep 3
addr() { grep -o 'grpc=[0-9.:]*' "$dir/$1.log" | head -n 1 | cut -d= -f2; }

echo "# $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg); base $BASE ${BASE_FLAGS:-}, new $NEW ${NEW_FLAGS:-}; serve ${FLAGS[*]}"
orders=("node-new bare-new node-base bare-base" "bare-new bare-base node-new node-base"
    "node-base node-new bare-base bare-new" "bare-base node-base bare-new node-new")
for r in $(seq 1 "$ROUNDS"); do
    line="round=$r"
    for s in ${orders[r % 4]}; do
        protocol=ringlimit
        [ "${s%%-*}" = bare ] && protocol=health
        # --protocol health also drives Check after health (refused by a bare server):
        # the first figure line is the health check's.
        out=$("$NEW" bench --addr "$(addr "$s")" --protocol $protocol --duration "$DURATION" \
            --warmup 1 --concurrency 50 2>/dev/null || true)
        cpu=$(grep -m1 'server CPU' <<<"$out" | grep -oE '[0-9.]+ µs' | cut -d' ' -f1)
        rate=$(grep -m1 'checks/s' <<<"$out" | awk '{print $3}')
        line="$line $s=$cpu/$rate"
    done
    echo "$line load=$(cut -d' ' -f1 /proc/loadavg)"
done | tee "$dir/rounds.txt"

# Medians of CPU per call, and node ÷ bare of each build per round.
awk '
function median(list,   n, a, i, j, t) {
    n = split(list, a, " ")
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
{
    for (i = 2; i <= NF; i++) {
        split($i, kv, "="); split(kv[2], v, "/")
        if (kv[1] != "load") { cpu[kv[1]] = cpu[kv[1]] " " v[1]; this[kv[1]] = v[1] }
    }
    rb = rb " " sprintf("%.2f", this["node-base"] / this["bare-base"])
    rn = rn " " sprintf("%.2f", this["node-new"] / this["bare-new"])
}
END {
    for (s in cpu) printf "median %s %.1f µs per call (per round%s)\n", s, median(cpu[s]), cpu[s]
    printf "ratio base node/bare %.2f (per round%s)\n", median(rb), rb
    printf "ratio new node/bare %.2f (per round%s)\n", median(rn), rn
    printf "ratio node new/base %.2f\n", median(cpu["node-new"]) / median(cpu["node-base"])
}' "$dir/rounds.txt"
