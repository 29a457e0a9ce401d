#!/usr/bin/env bash
# Successor replicas on and off (issue 23), alternating in one run on the same binary:
# server CPU per check of a 3-node cluster (random entry node, so ~2/3 forwarded), then
# the cluster's resident bytes per key with each key also held as a replica.
#   bench/replication.sh [BIN] [ROUNDS] [KEYS]
set -euo pipefail
BIN=${1:-target/release/ringlimit}
ROUNDS=${2:-4}
KEYS=${3:-200000}
off=(--node-arg=--replicate-interval-ms --node-arg=0)
on=(--node-arg=--replicate-interval-ms --node-arg=50)
for r in $(seq 1 "$ROUNDS"); do
    for mode in on off; do
        args=("${on[@]}")
        [ "$mode" = off ] && args=("${off[@]}")
        line=$("$BIN" bench --concurrency 50 --duration 5 --warmup 1 --nodes 3 "${args[@]}" 2>/dev/null |
            grep -E '^ringlimit +(checks/s|server CPU)' | tr -s ' ' | tr '\n' ' ')
        echo "round=$r replicas=$mode $line"
    done
done
for mode in on off; do
    args=("${on[@]}")
    [ "$mode" = off ] && args=("${off[@]}")
    echo "memory replicas=$mode $("$BIN" bench --memory --nodes 3 --keys "$KEYS" "${args[@]}" 2>/dev/null | grep '^ringlimit')"
done
