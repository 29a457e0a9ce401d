#!/usr/bin/env bash
# The alert rules and the dashboard against a real Prometheus scraping a real cluster.
#
#  1. `promtool check rules` and `promtool test rules` (alerts.test.yml).
#  2. Three `ringlimit serve` processes on 127.0.0.1, every port chosen by the OS, in file
#     mode with a small key cap; Debian's `prometheus` scraping their ops ports every 2 s
#     with alerts.yml loaded.
#  3. Healthy traffic (denials, deny-cache hits, forwards): every alert expression must
#     return nothing.
#  4. Faults: key floods past the cap (live, then denied evictions), a broken and a changed
#     rule file, a changed Envoy config, peer calls without and with a wrong cluster key, a
#     forged gossip datagram, then node 3 paused (SIGSTOP) under load (fail-open answers,
#     forward errors, ownership resets, a failed scrape). Every alert expression must then
#     return at least one series, and so must every query of grafana-dashboard.json.
#
# Usage: deploy/prometheus/test.sh   (RINGLIMIT_BIN: the binary, default target/debug/ringlimit
# under $CARGO_TARGET_DIR or the checkout, as `cargo test` leaves it;
# PROMETHEUS / PROMTOOL: the Prometheus binaries, default from PATH). Exits 0 on success.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=${RINGLIMIT_BIN:-${CARGO_TARGET_DIR:-$root/target}/debug/ringlimit}
prometheus=${PROMETHEUS:-prometheus}
promtool=${PROMTOOL:-promtool}
started=$(date +%s)

say() { echo "== prometheus test: $*"; }
fail() {
    echo "== prometheus test: FAILED: $*" >&2
    [ -n "${work:-}" ] && [ -d "$work" ] && for log in "$work"/*.log; do
        echo "--- $log (last 20 lines)" >&2
        tail -n 20 "$log" >&2
    done
    exit 1
}

[ -x "$bin" ] || fail "no ringlimit binary at $bin (build it, or set RINGLIMIT_BIN)"
command -v "$prometheus" >/dev/null || fail "no prometheus binary ($prometheus): apt-get install prometheus"
command -v "$promtool" >/dev/null || fail "no promtool binary ($promtool): apt-get install prometheus"

say "promtool check rules / test rules"
"$promtool" check rules "$here/alerts.yml"
(cd "$here" && "$promtool" test rules alerts.test.yml)

work=$(mktemp -d "${TMPDIR:-/tmp}/ringlimit-prom.XXXXXX")
pids=()
cleanup() {
    local pid
    for pid in "${pids[@]}"; do
        kill -CONT "$pid" 2>/dev/null || true
        kill -KILL "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- The cluster ---------------------------------------------------------------------
head -c 32 /dev/urandom | base64 >"$work/cluster.secret"
head -c 32 /dev/urandom | base64 >"$work/wrong.secret"
rules() { # rules LIMIT: every check (bench's route included) under one rule
    printf '[default]\nalgorithm = "sliding_window_counter"\nlimit = %s\nwindow = "60s"\n' "$1"
}
envoy() { # envoy N: one domain
    printf 'domain: test\ndescriptors:\n  - key: client_id\n    rate_limit: {unit: minute, requests_per_unit: %s}\n' "$1"
}

declare -A grpc ops gossip peer
start_node() { # start_node I [SEED]
    local i=$1 seed=${2:-} line
    rules 5 >"$work/rules-$i.toml"
    envoy 10 >"$work/envoy-$i.yaml"
    local args=(serve --node-id "node-$i"
        --listen 127.0.0.1:0 --http-listen 127.0.0.1:0
        --gossip-listen 127.0.0.1:0 --peer-listen 127.0.0.1:0
        --cluster-secret-file "$work/cluster.secret"
        --rules "$work/rules-$i.toml" --envoy-config "$work/envoy-$i.yaml"
        --max-keys 24 --shards 2 --threads 1 --forward-timeout-ms 1000
        --replicate-interval-ms 50) # successor replicas: their alert and panels need series
    [ -n "$seed" ] && args+=(--seed "$seed")
    "$bin" "${args[@]}" >"$work/node-$i.out" 2>"$work/node-$i.log" &
    pids+=($!)
    eval "node_pid_$i=$!"
    for _ in $(seq 100); do
        line=$(grep -m1 '^ringlimit ready' "$work/node-$i.out" || true)
        [ -n "$line" ] && break
        kill -0 "$!" 2>/dev/null || fail "node-$i exited before it was ready"
        sleep 0.1
    done
    [ -n "$line" ] || fail "node-$i not ready after 10 s"
    field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$line"; }
    grpc[$i]=$(field grpc)
    ops[$i]=$(field http)
    gossip[$i]=$(field gossip)
    peer[$i]=$(field peer)
    ops[$i]=${ops[$i]#http://}
    ops[$i]=${ops[$i]%/}
}
start_node 1
start_node 2 "${gossip[1]}"
start_node 3 "${gossip[1]}"
say "nodes: ops ${ops[1]} ${ops[2]} ${ops[3]}"

# Every node sees three members before traffic starts (no forward lands on a joiner).
for i in 1 2 3; do
    for _ in $(seq 100); do
        members=$(curl -sf "http://${ops[$i]}/v1/cluster" | jq '.members | length' || echo 0)
        [ "$members" -ge 3 ] && break
        sleep 0.1
    done
    [ "$members" -ge 3 ] || fail "node-$i sees $members members after 10 s"
done

# --- Prometheus ----------------------------------------------------------------------
cat >"$work/prometheus.yml" <<EOF
global:
  scrape_interval: 2s
  scrape_timeout: 2s
  evaluation_interval: 2s
rule_files:
  - $here/alerts.yml
scrape_configs:
  - job_name: ringlimit
    static_configs:
      - targets: ['${ops[1]}', '${ops[2]}', '${ops[3]}']
EOF
"$promtool" check config "$work/prometheus.yml" >/dev/null

# Port 0: the OS picks a free port, which Prometheus logs ("Listening on" address=...).
"$prometheus" --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
    --web.listen-address=127.0.0.1:0 >"$work/prometheus.log" 2>&1 &
prom_pid=$!
pids+=($prom_pid)
prom=""
for _ in $(seq 150); do
    prom=$(sed -n 's/.*msg="Listening on" address=\([0-9.:]*\).*/\1/p' "$work/prometheus.log" | head -n1)
    [ -n "$prom" ] && curl -sf "http://$prom/-/ready" >/dev/null 2>&1 && break
    kill -0 "$prom_pid" 2>/dev/null || fail "prometheus exited"
    prom=""
    sleep 0.1
done
[ -n "$prom" ] || fail "prometheus did not start"
say "prometheus on $prom"

# query EXPR: prints the number of series an instant query returns (fails on an error).
query() {
    local answer
    answer=$(curl -sf --data-urlencode "query=$1" "http://$prom/api/v1/query") ||
        fail "query refused by Prometheus: $1"
    jq -e '.status == "success"' <<<"$answer" >/dev/null || fail "query failed: $1: $answer"
    jq '.data.result | length' <<<"$answer"
}
# value EXPR: the first sample's value of an instant query ("" when it returns nothing).
value() {
    curl -sf --data-urlencode "query=$1" "http://$prom/api/v1/query" | jq -r '.data.result[0].value[1] // ""'
}
# scraped_since T N: waits until N targets were scraped at least once after unix time T + 1
# (so a rate over the last minute sees what was done before T).
scraped_since() {
    for _ in $(seq 150); do
        [ "$(value "count(timestamp(up{job=\"ringlimit\"} == 1) > $1 + 1)")" = "$2" ] && return 0
        sleep 0.2
    done
    fail "prometheus did not scrape $2 nodes after unix time $1 + 1"
}
# The alert expressions as Prometheus loaded them (no YAML parser needed).
mapfile -t alert_names < <(curl -sf "http://$prom/api/v1/rules" | jq -r '.data.groups[].rules[].name')
mapfile -t alert_exprs < <(curl -sf "http://$prom/api/v1/rules" | jq -r '.data.groups[].rules[].query')
[ "${#alert_exprs[@]}" -ge 10 ] || fail "prometheus loaded ${#alert_exprs[@]} rules from alerts.yml"

bench() { # bench KEYS COST SECONDS ADDR...: closed-loop load, route "GET /bench"
    local keys=$1 cost=$2 seconds=$3
    shift 3
    local targets=()
    for addr in "$@"; do targets+=(--addr "$addr"); done
    "$bin" bench "${targets[@]}" --keys "$keys" --cost "$cost" --duration "$seconds" \
        --warmup 0 --concurrency 8 >>"$work/bench.log" 2>&1 || fail "bench failed"
}

# --- Healthy: every alert quiet --------------------------------------------------------
# Prometheus applies its targets a few seconds after it starts: what happened before a
# target's first scrape is in that first sample, which increase() cannot see. So: a first
# scrape, then traffic that creates the counters made at first use (checks by rule), a
# scrape, the healthy traffic itself, and scrapes after it.
scraped_since 0 3
say "healthy traffic: 10 keys over a limit of 5, through every node"
bench 10 1 1 "${grpc[1]}" "${grpc[2]}" "${grpc[3]}"
scraped_since "$(date +%s)" 3
bench 10 1 2 "${grpc[1]}" "${grpc[2]}" "${grpc[3]}"
scraped_since "$(date +%s)" 3
for i in "${!alert_exprs[@]}"; do
    n=$(query "${alert_exprs[$i]}")
    [ "$n" = 0 ] || fail "${alert_names[$i]} fires on a healthy cluster ($n series): ${alert_exprs[$i]}"
done
say "healthy: all ${#alert_exprs[@]} alert expressions empty"

# --- Faults: every alert fires ---------------------------------------------------------
say "faults: a successor paused for 0.9 s, key floods past the cap, rules and Envoy config changed, unauthenticated calls, node 3 paused"
# Replication lag: node 2 stops while node 1 admits keys the healthy traffic left
# fresh (10-29); node 1's batches to node 2 (the successor of about half its keys) time
# out and go again, and arrive once node 2 goes on, with the lag counted from the
# first change: more than 0.5 s. 0.9 s is shorter than failure detection (~1.2 s), so the ring
# stays as it is.
kill -STOP "$node_pid_2"
bench 30 1 1 "${grpc[1]}" &
lagging=$!
sleep 0.9
kill -CONT "$node_pid_2"
wait "$lagging" || fail "bench against node 1 failed while node 2 was paused"
bench 100000 1 1 "${grpc[1]}" "${grpc[2]}" "${grpc[3]}" # live keys evicted
bench 100000 5 2 "${grpc[1]}" "${grpc[2]}" "${grpc[3]}" # exhausted keys evicted
# Every fault but the pause lands on nodes 1 and 2: a paused node's series go stale.
echo 'this is not TOML [' >"$work/rules-1.toml" # reload refused, old rules kept
rules 7 >"$work/rules-2.toml"                   # node 2 now differs from 1 and 3
envoy 11 >"$work/envoy-2.yaml"
"$bin" check --addr "${grpc[1]}" --key k --route "GET /x" --cost 0 >/dev/null 2>&1 || true # refused
"$bin" check --addr "${peer[1]}" --key k --route "GET /x" >/dev/null 2>&1 || true # no key
"$bin" cluster status --addr "${peer[2]}" --cluster-secret-file "$work/wrong.secret" >/dev/null 2>&1 || true
gossip_port=${gossip[1]##*:}
printf 'not gossip' >"/dev/udp/127.0.0.1/$gossip_port"
# Wait for the drift to be seen before pausing node 3 (it is gossip that carries it).
for _ in $(seq 100); do
    curl -sf "http://${ops[1]}/metrics" | grep -q '^ringlimit_rules_drift_nodes [1-9]' && break
    sleep 0.1
done
kill -STOP "$node_pid_3"
bench 100000 1 3 "${grpc[1]}" "${grpc[2]}" # fail-open, forward errors, then resets after detection
fault_end=$(date +%s)

pending=()
for _ in $(seq 60); do
    pending=()
    for i in "${!alert_exprs[@]}"; do
        n=$(query "${alert_exprs[$i]}")
        [ "$n" -ge 1 ] || pending+=("${alert_names[$i]}")
    done
    [ ${#pending[@]} -eq 0 ] && break
    sleep 0.5
done
[ ${#pending[@]} -eq 0 ] || fail "alert expressions still empty 30 s after the faults: ${pending[*]}"
say "faults: all ${#alert_exprs[@]} alert expressions return series"

# --- The dashboard: every query returns series -----------------------------------------
dashboard=$here/grafana-dashboard.json
mapfile -t panel_queries < <(jq -r '.. | objects | select(has("expr")) | .expr' "$dashboard")
[ "${#panel_queries[@]}" -ge 10 ] || fail "found only ${#panel_queries[@]} queries in $dashboard"
scraped_since "$fault_end" 2 # node 3 is paused: two answer
empty=()
for q in "${panel_queries[@]}"; do
    # Grafana's variables, as Grafana fills them for "All" (any range over two scrapes will do).
    q=${q//\$__rate_interval/1m}
    q=${q//\$__interval/1m}
    q=${q//\$instance/.+}
    n=$(query "$q")
    [ "$n" -ge 1 ] || empty+=("$q")
done
[ ${#empty[@]} -eq 0 ] || fail "dashboard queries without a series: $(printf '\n  %s' "${empty[@]}")"
# The instance variable's query, label_values(ringlimit_build_info, instance).
values=$(curl -sfG --data-urlencode 'match[]=ringlimit_build_info' "http://$prom/api/v1/label/instance/values" |
    jq '.data | length') || fail "the label values API refused label_values(ringlimit_build_info, instance)"
[ "$values" -ge 3 ] || fail "label_values(ringlimit_build_info, instance) lists $values instances"
say "dashboard: all ${#panel_queries[@]} queries return series"
say "PASSED in $(($(date +%s) - started)) s"
