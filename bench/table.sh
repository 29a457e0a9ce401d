#!/usr/bin/env bash
# Issue 25's table from one bench/run-all.sh run: each row's figure as a ratio of this
# run, the issue's "today" figure, the goal and whether it is met, with the scenario
# (and so the command, in $OUT/<scenario>.txt's first line) it was read from.
#   bench/table.sh [OUT]   (default target/bench-results)
set -euo pipefail
OUT=${1:-${OUT:-target/bench-results}}

# The first number after "$2" on the first line of $OUT/$1.txt matching "$2".
value() {
    local file=$OUT/$1.txt
    [ -f "$file" ] || return 0
    awk -v needle="$2" 'found == 0 && (i = index($0, needle)) > 0 {
        rest = substr($0, i + length(needle))
        if (match(rest, /[0-9]+(\.[0-9]+)?/)) print substr(rest, RSTART, RLENGTH)
        found = 1
    }' "$file"
}

# The per-round values in brackets "(... per round A B C)" of that line.
per_round() {
    local file=$OUT/$1.txt
    [ -f "$file" ] || return 0
    grep -F -- "$2" "$file" | head -n 1 | sed -nE 's/.*per round ([0-9. ]+)\).*/\1/p'
}

# met / not met / n/a: $1 value, $2 "<=" or ">=", $3 goal.
verdict() {
    [ -n "$1" ] || {
        echo "not measured"
        return
    }
    awk -v v="$1" -v op="$2" -v g="$3" 'BEGIN {
        ok = (op == "<=") ? (v <= g) : (v >= g)
        print ok ? "**met**" : "not met"
    }'
}

row() { # figure, scenario, value, per-round, today, op, goal
    local figure=$1 scenario=$2 v=$3 rounds=$4 today=$5 op=$6 goal=$7 shown verdict_text
    shown=${v:-–}
    [ -n "$rounds" ] && shown="$shown (rounds $rounds)"
    verdict_text=$(verdict "$v" "$op" "$goal")
    printf '| %s | %s | %s | %s | %s %s | %s |\n' "$figure" "$scenario" "$shown" "$today" "$op" "$goal" "$verdict_text"
}

# The smallest of a list of numbers (for "in every round").
smallest() { tr ' ' '\n' | grep -E '^[0-9.]+$' | sort -g | head -n 1; }

echo "# issue 25's table ($OUT; each scenario's command is the first line of its file)"
echo "| figure | scenario | this run | today (issue 25) | goal | |"
echo "|---|---|---|---|---|---|"
row "node health ÷ bare tonic health, lean client" floor-c50 \
    "$(value floor-c50 'ratio node-health/bare cpu_per_call')" "$(per_round floor-c50 'ratio node-health/bare cpu_per_call')" \
    "not measured" "<=" 1.05
row "the same, h2load" floor-c50 "$(value floor-c50 'ratio h2load node-health/bare cpu_per_call')" "" "not measured" "<=" 1.05
row "native Check ÷ bare health, 2 workers" floor-c50 \
    "$(value floor-c50 'ratio node-check/bare cpu_per_call')" "$(per_round floor-c50 'ratio node-check/bare cpu_per_call')" \
    "≈ 1.46 (own health as floor)" "<=" 1.15
row "native Check ÷ bare health, one worker" floor-threads1-c50 \
    "$(value floor-threads1-c50 'ratio node-check/bare cpu_per_call')" "$(per_round floor-threads1-c50 'ratio node-check/bare cpu_per_call')" \
    "≈ 1.24 (own health as floor)" "<=" 1.05
row "Envoy RLS CPU ÷ native" fronts-c50 "$(value fronts-c50 'ratio envoy-rls/native')" "" 1.09 "<=" 1.05
row "Gubernator CPU ÷ native" fronts-c50 "$(value fronts-c50 'ratio gubernator/native')" "" 1.05 "<=" 1.05
row "forwarded check CPU ÷ local check" forwarded-c50 \
    "$(value forwarded-c50 'ratio forwarded/local cpu_per_check')" "$(per_round forwarded-c50 'ratio forwarded/local cpu_per_check')" \
    "≈ 2.1" "<=" 1.5
for nodes in 1 3; do
    s=gateway-nodes$nodes
    row "gateway path, $nodes node(s): server CPU per check ÷ Redis + Lua unary" $s \
        "$(value $s 'ratio ring-aware/redis cpu_per_check')" "$(per_round $s 'ratio ring-aware/redis cpu_per_check')" \
        "$([ $nodes = 3 ] && echo '17.0 µs vs ~11 µs' || echo 'not measured')" "<=" 1.0
    row "gateway path, $nodes node(s): checks/s ÷ Redis + Lua unary" $s \
        "$(value $s 'ratio ring-aware/redis checks_per_s')" "$(per_round $s 'ratio ring-aware/redis checks_per_s')" \
        "$([ $nodes = 3 ] && echo '58.6k vs 93k, not side by side' || echo 'not measured')" ">=" 1.0
done
row "p99 at half of peak ÷ Redis's p99 at that rate" half-peak-one-node \
    "$(value half-peak-one-node 'ratio ringlimit/redis p99')" "$(per_round half-peak-one-node 'ratio ringlimit/redis p99')" \
    "2.68 ÷ 1.61 = 1.66" "<=" 1.3
batch_rounds=$(per_round batch32-c50 'ratio ringlimit/redis checks_per_s')
row "CheckBatch 32 ÷ Redis pipelined 32 (checks/s; goal in every round: the worst round)" batch32-c50 \
    "$(printf '%s' "$batch_rounds" | smallest)" "$batch_rounds" "1.98–2.57" ">=" 2.5
grep -h "h2load not found" "$OUT"/floor-c50.txt "$OUT"/floor-threads1-c50.txt 2>/dev/null | head -n 1 |
    sed 's/^/note: /' || true
