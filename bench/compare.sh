#!/usr/bin/env bash
# Any Envoy RLS server beside ringlimit and Redis + Lua, under one independent load
# generator (h2load; redis-benchmark for Redis), at the two shapes a gateway makes:
# 50 connections with one request in flight each (c=50×1), and 5 connections with 10
# streams each (c=5×10, a gateway multiplexing). Rounds alternate between the servers,
# so every ratio is taken within one run on the same machine.
#
#   bench/compare.sh [--ours LABEL='SERVE FLAGS']... [--no-redis] [NAME=HOST:PORT[@PID]]...
#
# Servers:
# - ours: `ringlimit serve` started by this script for each --ours (default two:
#   `ringlimit-t1='--threads 1'` and `ringlimit-default=''`, the node's defaults), on
#   loopback port 0, with an Envoy config whose domain is the request's;
# - redis-lua: redis-server on a free loopback port running the design reference's
#   sliding-window-counter script (bench/sliding_window.lua) by EVALSHA, driven by
#   redis-benchmark with -P as the streams per connection (--no-redis: leave it out);
# - NAME=HOST:PORT[@PID]: an RLS server you started (envoyproxy/ratelimit, another
#   ringlimit, ...). Configure it so the request below is admitted (a high limit): a
#   denied check takes another path. Its CPU comes from /proc/PID/stat; without @PID the
#   PID listening on PORT is looked up with `ss`; when none is found, only req/s is shown.
#
# The request, the same for every RLS server (h2load sends one body): domain $DOMAIN, one
# descriptor ($DESCRIPTOR_KEY = $DESCRIPTOR_VALUE), hits_addend 1. Every server is first
# called once and must answer it (a message, not an error status), or the run stops.
#
# Printed per run: µs of server CPU per request (utime + stime of the server's process
# over the run ÷ succeeded requests) and req/s; then per server and shape the medians
# with the per-round values, and each server's ratio to the first of ours (by default
# `ringlimit-t1`): CPU per request and req/s, medians of the per-round ratios.
#
# Environment: REQUESTS per run (default 200000), ROUNDS (default 2), BIN (default
# target/release/ringlimit, built if missing), DOMAIN (bench), DESCRIPTOR_KEY
# (client_id), DESCRIPTOR_VALUE (h2load). Needs h2load (Debian's nghttp2-client,
# installed by .ci/deps) and, for the Redis rows, redis-server and redis-benchmark (Debian's
# redis-server, redis-tools): a missing tool stops the script; nothing is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN:-target/release/ringlimit}
REQUESTS=${REQUESTS:-200000}
ROUNDS=${ROUNDS:-2}
DOMAIN=${DOMAIN:-bench}
DESCRIPTOR_KEY=${DESCRIPTOR_KEY:-client_id}
DESCRIPTOR_VALUE=${DESCRIPTOR_VALUE:-h2load}
SHAPES=("50x1" "5x10")

ours=()
external=()
redis=1
while [ $# -gt 0 ]; do
    case $1 in
    --ours)
        ours+=("${2:?--ours needs LABEL=FLAGS}")
        shift 2
        ;;
    --ours=*)
        ours+=("${1#--ours=}")
        shift
        ;;
    --no-redis)
        redis=0
        shift
        ;;
    -h | --help)
        sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
    *=*)
        external+=("$1")
        shift
        ;;
    *)
        echo "compare.sh: unknown argument $1 (see --help)" >&2
        exit 2
        ;;
    esac
done
[ ${#ours[@]} -gt 0 ] || ours=("ringlimit-t1=--threads 1" "ringlimit-default=")

need() { # tool, package
    command -v "$1" >/dev/null 2>&1 || {
        echo "compare.sh: $1 not found: install Debian's $2 (.ci/deps installs nghttp2-client)" >&2
        exit 1
    }
}
need h2load nghttp2-client
need ss iproute2
if [ "$redis" = 1 ]; then
    need redis-server redis-server
    need redis-benchmark redis-tools
    need redis-cli redis-tools
fi
[ -x "$BIN" ] || cargo build --release

DIR=$(mktemp -d /tmp/ringlimit-compare-XXXXXX)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$DIR"
}
trap cleanup EXIT

# --- the request: a gRPC frame around RateLimitRequest (protobuf written by hand) ----
hex() { printf '%02x' "$1"; }
pb_len() { # field number, bytes (as a printf %b string), byte count
    (($3 < 128)) || {
        echo "compare.sh: a request field over 127 bytes is not supported" >&2
        exit 2
    }
    printf '\\x%s\\x%s%s' "$(hex $(($1 << 3 | 2)))" "$(hex "$3")" "$2"
}
esc() { # a string as printf %b escapes, so any byte survives
    local s=$1 i out=
    for ((i = 0; i < ${#s}; i++)); do out+=$(printf '\\x%02x' "'${s:i:1}"); done
    printf '%s' "$out"
}
entry=$(pb_len 1 "$(esc "$DESCRIPTOR_KEY")" ${#DESCRIPTOR_KEY})$(pb_len 2 "$(esc "$DESCRIPTOR_VALUE")" ${#DESCRIPTOR_VALUE})
entry_len=$((4 + ${#DESCRIPTOR_KEY} + ${#DESCRIPTOR_VALUE}))
descriptor=$(pb_len 1 "$entry" "$entry_len")
request=$(pb_len 1 "$(esc "$DOMAIN")" ${#DOMAIN})$(pb_len 2 "$descriptor" $((entry_len + 2)))'\x18\x01'
request_len=$((2 + ${#DOMAIN} + entry_len + 4 + 2))
printf '%b' "\\x00\\x00\\x00\\x00\\x$(hex "$request_len")$request" >"$DIR/rls.grpc"
PATH_RLS=/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit

# --- servers: label, address, pid ----------------------------------------------------
names=()
addrs=()
spids=()
kinds=()

cat >"$DIR/envoy.yaml" <<EOF
domain: $DOMAIN
descriptors:
  - key: $DESCRIPTOR_KEY
    rate_limit: {unit: second, requests_per_unit: 1000000000, algorithm: sliding_window_counter}
EOF
for spec in "${ours[@]}"; do
    label=${spec%%=*}
    flags=${spec#*=}
    out="$DIR/$label.out"
    # shellcheck disable=SC2086 # the flags are words
    RUST_LOG=warn "$BIN" serve --node-id "$label" --listen 127.0.0.1:0 --peer-listen 127.0.0.1:0 \
        --gossip-listen 127.0.0.1:0 --no-http --insecure-cluster \
        --envoy-config "$DIR/envoy.yaml" $flags >"$out" 2>"$DIR/$label.err" &
    pid=$!
    pids+=("$pid")
    for _ in $(seq 100); do
        grep -q '^ringlimit ready' "$out" 2>/dev/null && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    addr=$(sed -nE 's/^ringlimit ready .*grpc=([^ ]+).*/\1/p' "$out")
    [ -n "$addr" ] || {
        echo "compare.sh: ringlimit serve $flags did not start:" >&2
        cat "$DIR/$label.err" >&2
        exit 1
    }
    names+=("$label")
    addrs+=("$addr")
    spids+=("$pid")
    kinds+=(rls)
done

for spec in "${external[@]}"; do
    label=${spec%%=*}
    target=${spec#*=}
    addr=${target%@*}
    pid=
    if [ "$addr" != "$target" ]; then
        pid=${target##*@}
    else
        port=${addr##*:}
        pid=$(ss -Hltnp "sport = :$port" 2>/dev/null | grep -oE 'pid=[0-9]+' | head -1 | cut -d= -f2 || true)
    fi
    [ -n "$pid" ] || echo "compare.sh: no process found listening on $addr: $label's CPU is not measured" >&2
    names+=("$label")
    addrs+=("$addr")
    spids+=("$pid")
    kinds+=(rls)
done

if [ "$redis" = 1 ]; then
    port=$((20000 + RANDOM % 20000))
    while ss -Hltn "sport = :$port" | grep -q .; do port=$((20000 + RANDOM % 20000)); done
    redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no \
        --daemonize no >"$DIR/redis.log" 2>&1 &
    rpid=$!
    pids+=("$rpid")
    for _ in $(seq 50); do
        redis-cli -p "$port" ping >/dev/null 2>&1 && break
        sleep 0.1
    done
    sha=$(redis-cli -p "$port" script load "$(cat bench/sliding_window.lua)")
    names+=(redis-lua)
    addrs+=("127.0.0.1:$port")
    spids+=("$rpid")
    kinds+=(redis)
fi

# --- one run ---------------------------------------------------------------------------
ticks() { # utime + stime of a process, in clock ticks
    [ -n "$1" ] && [ -r "/proc/$1/stat" ] || {
        echo 0
        return
    }
    sed -E 's/^.*\) //' "/proc/$1/stat" | awk '{print $12 + $13}'
}
HZ=$(getconf CLK_TCK)

probe() { # i: one call, which must be answered OK
    local i=$1
    if [ "${kinds[i]}" = redis ]; then
        local port=${addrs[i]##*:}
        redis-cli -p "$port" evalsha "$sha" 2 "rl:{$DESCRIPTOR_VALUE}:cur" "rl:{$DESCRIPTOR_VALUE}:prev" \
            1000000000 60000 30000 | head -1 | grep -qx 1
        return
    fi
    local out
    out=$(h2load -n 1 -c 1 -v -H 'content-type: application/grpc' -H 'te: trailers' \
        -d "$DIR/rls.grpc" "http://${addrs[i]}$PATH_RLS" 2>&1)
    # A refusal comes as a trailers-only answer (grpc-status in the headers h2load
    # prints); an answer with a message has data and its status in trailers, which
    # h2load does not print: no error status and some data bytes is an answer.
    if grep -qE 'grpc-status: [1-9]' <<<"$out" || ! grep -q ' 1 succeeded' <<<"$out" ||
        grep -qE 'traffic: .*, 0B \(0\) data' <<<"$out"; then
        echo "compare.sh: ${names[i]} at ${addrs[i]} did not answer the request:" >&2
        grep -E 'grpc-status|grpc-message|:status|error|refused|traffic' <<<"$out" >&2 || echo "$out" >&2
        return 1
    fi
    # overall_code OK or OVER_LIMIT cannot be told apart here (h2load shows no
    # bodies): the limit documented above keeps every request admitted.
}

run() { # i, shape, round → prints "µs/req req/s"
    local i=$1 shape=$2 c m
    c=${shape%x*}
    m=${shape#*x}
    local before after out done_ secs
    before=$(ticks "${spids[i]}")
    if [ "${kinds[i]}" = redis ]; then
        local port=${addrs[i]##*:}
        out=$(redis-benchmark -p "$port" -c "$c" -P "$m" -n "$REQUESTS" --csv \
            EVALSHA "$sha" 2 "rl:{$DESCRIPTOR_VALUE}:cur" "rl:{$DESCRIPTOR_VALUE}:prev" 1000000000 60000 30000 2>&1)
        after=$(ticks "${spids[i]}")
        local rps
        rps=$(tail -1 <<<"$out" | cut -d, -f2 | tr -d '"')
        done_=$REQUESTS
        secs=$(awk -v n="$REQUESTS" -v r="$rps" 'BEGIN {print n / r}')
    else
        out=$(h2load -c "$c" -m "$m" -t 1 -n "$REQUESTS" -H 'content-type: application/grpc' \
            -H 'te: trailers' -d "$DIR/rls.grpc" "http://${addrs[i]}$PATH_RLS" 2>&1)
        after=$(ticks "${spids[i]}")
        done_=$(sed -nE 's/^requests: .* ([0-9]+) succeeded.*/\1/p' <<<"$out")
        secs=$(sed -nE 's/^finished in ([0-9.]+)(m?s),.*/\1 \2/p' <<<"$out" |
            awk '{print ($2 == "ms") ? $1 / 1000 : $1}')
        [ -n "$done_" ] && [ "$done_" -gt 0 ] || {
            echo "compare.sh: h2load against ${names[i]} failed: $out" >&2
            exit 1
        }
        [ "$done_" -eq "$REQUESTS" ] || echo "compare.sh: ${names[i]}: only $done_ of $REQUESTS succeeded" >&2
    fi
    awk -v t=$((after - before)) -v hz="$HZ" -v n="$done_" -v s="$secs" -v has="${spids[i]}" \
        'BEGIN {printf "%s %.0f\n", (has == "") ? "-" : sprintf("%.1f", t / hz * 1e6 / n), n / s}'
}

echo "# bench/compare.sh $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"
echo "# $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg); REQUESTS=$REQUESTS ROUNDS=$ROUNDS"
for i in "${!names[@]}"; do
    echo "# ${names[i]}: ${addrs[i]} pid ${spids[i]:--}"
    probe "$i"
done
# Warm every server once (connections, allocator, caches), unmeasured.
for i in "${!names[@]}"; do REQUESTS=$((REQUESTS / 10)) run "$i" 50x1 >/dev/null; done

declare -A cpu rate
for round in $(seq 1 "$ROUNDS"); do
    for shape in "${SHAPES[@]}"; do
        # The order rotates every round, so no server always runs first.
        n=${#names[@]}
        for k in $(seq 0 $((n - 1))); do
            i=$(((k + round - 1) % n))
            res=$(run "$i" "$shape")
            read -r u r <<<"$res"
            printf 'round=%s shape=c%s %-20s %8s µs/req %8s req/s\n' "$round" "$shape" "${names[i]}" "$u" "$r"
            cpu[$i,$shape]+="$u "
            rate[$i,$shape]+="$r "
        done
    done
done

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{v[NR]=$1} END {if (NR == 0) {print "-"; exit} m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf (m >= 1000) ? "%.0f\n" : "%.2f\n", m}'; }
ratios() { # per-round values a, b → per-round a/b
    paste -d' ' <(tr ' ' '\n' <<<"$1" | grep -v '^$') <(tr ' ' '\n' <<<"$2" | grep -v '^$') |
        awk '$1 != "-" && $2 != "-" && $2 > 0 {printf "%.2f ", $1 / $2}'
}
echo "# medians (per-round values); ratio: ÷ ${names[0]} in the same round, median of the rounds"
for shape in "${SHAPES[@]}"; do
    for i in "${!names[@]}"; do
        c=${cpu[$i,$shape]}
        r=${rate[$i,$shape]}
        cr=$(ratios "$c" "${cpu[0,$shape]}")
        rr=$(ratios "$r" "${rate[0,$shape]}")
        printf 'c%-5s %-20s CPU %6s µs/req (%s) req/s %6s (%s) ratio cpu %s (%s) req/s %s\n' \
            "$shape" "${names[i]}" "$(median <<<"$c")" "${c% }" "$(median <<<"$r")" "${r% }" \
            "$(median <<<"$cr")" "${cr% }" "$(median <<<"$rr")"
    done
done
