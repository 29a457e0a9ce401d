#!/usr/bin/env bash
# Server CPU per check of two builds, alternating in one run: a change's A/B on this
# shared machine, where only ratios within one run mean anything.
#   bench/ab.sh BASE_BIN NEW_BIN [ROUNDS] [extra `ringlimit bench` flags...]
# Each round runs unary on one node and the 3-node cluster (random entry) for each build,
# base first; each build starts its own nodes. Prints one line per run.
set -euo pipefail
BASE=${1:?base binary}
NEW=${2:?new binary}
ROUNDS=${3:-3}
shift $(($# < 3 ? $# : 3))
for r in $(seq 1 "$ROUNDS"); do
    for who in base new; do
        bin=$BASE
        [ "$who" = new ] && bin=$NEW
        for scenario in unary cluster3; do
            nodes=1
            [ "$scenario" = cluster3 ] && nodes=3
            line=$("$bin" bench --concurrency 50 --duration 5 --warmup 1 --nodes "$nodes" "$@" 2>/dev/null |
                grep -E '^ringlimit +(checks/s|server CPU)' | tr -s ' ' | tr '\n' ' ')
            echo "round=$r build=$who scenario=$scenario $line"
        done
    done
done
