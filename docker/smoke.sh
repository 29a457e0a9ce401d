#!/usr/bin/env bash
# Smoke test of the 3-node docker cluster (docker/compose.yaml):
#   build the image, start the cluster, wait for 3 live members, check through node-1,
#   docker kill node-3, check through node-2 (answers, decider is not node-3), bring
#   node-3 back, wait for 3 live members again, check through node-3, tear down.
# Prints "smoke: PASS" and exits 0, or "smoke: FAIL: ..." and exits 1.
# Without a usable docker engine: prints "smoke: SKIP (no docker engine)" and exits 0.
#
# Environment: RINGLIMIT_BIN (use this binary, skip cargo build), RINGLIMIT_PORT_1/2/3
# (host ports, default 17420/17423/17426), RINGLIMIT_PEER_PORT_1/2/3 (peer ports on the
# host, default 18420/18423/18426), RINGLIMIT_OPS_PORT_1/2/3 (ops HTTP ports on the host,
# default 19421/19424/19427), RINGLIMIT_NET (subnet prefix, default
# 172.28.0), RINGLIMIT_IMAGE (image tag, default ringlimit:local), RINGLIMIT_SMOKE_PROJECT
# (compose project name, default ringlimit-smoke). The image is left in place.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
project="${RINGLIMIT_SMOKE_PROJECT:-ringlimit-smoke}"
compose_file="$here/compose.yaml"
export RINGLIMIT_PORT_1="${RINGLIMIT_PORT_1:-17420}"
export RINGLIMIT_PORT_2="${RINGLIMIT_PORT_2:-17423}"
export RINGLIMIT_PORT_3="${RINGLIMIT_PORT_3:-17426}"
export RINGLIMIT_PEER_PORT_1="${RINGLIMIT_PEER_PORT_1:-18420}"
export RINGLIMIT_PEER_PORT_2="${RINGLIMIT_PEER_PORT_2:-18423}"
export RINGLIMIT_PEER_PORT_3="${RINGLIMIT_PEER_PORT_3:-18426}"
export RINGLIMIT_OPS_PORT_1="${RINGLIMIT_OPS_PORT_1:-19421}"
export RINGLIMIT_OPS_PORT_2="${RINGLIMIT_OPS_PORT_2:-19424}"
export RINGLIMIT_OPS_PORT_3="${RINGLIMIT_OPS_PORT_3:-19427}"
addr1="127.0.0.1:$RINGLIMIT_PORT_1"
addr2="127.0.0.1:$RINGLIMIT_PORT_2"
addr3="127.0.0.1:$RINGLIMIT_PORT_3"
# The peer service (cluster face) of each node, where `cluster status` is answered.
peer_of() {
    case "$1" in
        "$addr1") echo "127.0.0.1:$RINGLIMIT_PEER_PORT_1" ;;
        "$addr2") echo "127.0.0.1:$RINGLIMIT_PEER_PORT_2" ;;
        "$addr3") echo "127.0.0.1:$RINGLIMIT_PEER_PORT_3" ;;
        *) echo "$1" ;;
    esac
}
t0=$SECONDS

step() { printf 'smoke: [%3ds] %s\n' "$((SECONDS - t0))" "$*"; }
info() { printf 'smoke:         %s\n' "$*"; }

if ! command -v docker >/dev/null 2>&1 || ! docker info >/dev/null 2>&1; then
    echo "smoke: SKIP (no docker engine)"
    exit 0
fi

if docker compose version >/dev/null 2>&1; then
    compose_cmd=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
    compose_cmd=(docker-compose)
else
    echo "smoke: FAIL: docker engine present but neither 'docker compose' nor 'docker-compose' is installed"
    exit 1
fi
dc() { "${compose_cmd[@]}" -p "$project" -f "$compose_file" "$@"; }

failed=0
passed=0
fail() {
    failed=1
    echo "smoke: FAIL: $*"
    echo "smoke: --- docker compose ps"
    dc ps 2>&1 | sed 's/^/smoke:   /' || true
    echo "smoke: --- last log lines of each node"
    dc logs --no-color --tail=25 2>&1 | sed 's/^/smoke:   /' || true
    exit 1
}

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    step "tear down: ${compose_cmd[*]} -p $project down -v"
    dc down -v --remove-orphans >/dev/null 2>&1 || dc down -v >/dev/null 2>&1 || true
    if [[ $rc -eq 0 && $passed -eq 1 ]]; then
        echo "smoke: PASS ($((SECONDS - t0))s)"
        exit 0
    fi
    if [[ $failed -eq 0 ]]; then
        echo "smoke: FAIL: unexpected error (exit $rc), see the output above"
    fi
    exit 1
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- build
step "build image (docker/build-image.sh)"
"$here/build-image.sh"
if [[ -n "${RINGLIMIT_BIN:-}" ]]; then
    bin="$RINGLIMIT_BIN"
else
    target_dir="${CARGO_TARGET_DIR:-$repo/target}"
    [[ "$target_dir" = /* ]] || target_dir="$repo/$target_dir"
    bin="$target_dir/release/ringlimit"
fi
[[ -x "$bin" ]] || fail "host binary $bin missing"
info "host client: $bin"

# A CLI call that cannot hang the smoke test.
rl() {
    if command -v timeout >/dev/null 2>&1; then timeout 5 "$bin" "$@"; else "$bin" "$@"; fi
}

# Number of members in state "live" as the node at $1 sees them (0 if it does not answer).
live_members() {
    { rl cluster status --addr "$(peer_of "$1")" 2>/dev/null || true; } | awk '$NF == "live" { n++ } END { print n + 0 }'
}

# Generation of node $2 as the node at $1 sees it (empty if not listed).
generation_of() {
    { rl cluster status --addr "$(peer_of "$1")" 2>/dev/null || true; } | awk -v id="$2" '$1 == id { print $2; exit }'
}

# Waits up to $2 seconds until the node at $1 lists 3 live members, and, given $3, until
# node-3's generation there is not $3 (the restarted node-3, not the killed one).
wait_three_live() {
    local addr=$1 limit=$2 not_gen=${3:-} start=$SECONDS n=0
    while ((SECONDS - start < limit)); do
        n="$(live_members "$addr")"
        if [[ "$n" -eq 3 && -n "$not_gen" && "$(generation_of "$addr" node-3)" == "$not_gen" ]]; then
            n="3 (but node-3 still at its old generation $not_gen)"
        elif [[ "$n" -eq 3 ]]; then
            info "$addr sees 3 live members after $((SECONDS - start))s:"
            rl cluster status --addr "$(peer_of "$addr")" 2>&1 | sed 's/^/smoke:           /'
            return 0
        fi
        sleep 1
    done
    fail "$addr sees $n live members, not 3, after ${limit}s"
}

# Top-level fields of `ringlimit check --json` (the per-descriptor list is cut off first).
json_top() { sed 's/"descriptors":\[[^]]*\]//' <<<"$1"; }
field_allowed() { json_top "$1" | grep -o '"allowed":[a-z]*' | head -1 | cut -d: -f2; }
field_degraded() { json_top "$1" | grep -o '"degraded":[a-z]*' | head -1 | cut -d: -f2; }
field_decider() { grep -o '"decider":{[^}]*}' <<<"$1" | grep -o '"node_id":"[^"]*"' | head -1 | cut -d'"' -f4; }

# check ADDR KEY: prints the JSON answer, fails the call if the node did not answer.
check() { rl check --addr "$1" --key "$2" --route "GET /smoke" --json 2>&1; }

# ---------------------------------------------------------------- start
if [[ ! -s "$here/cluster.secret" ]]; then
    step "generate the cluster key docker/cluster.secret"
    head -c 32 /dev/urandom | base64 > "$here/cluster.secret"
    chmod 644 "$here/cluster.secret"   # the image runs as uid 65534
fi
export RINGLIMIT_CLUSTER_SECRET_FILE="$here/cluster.secret"

step "remove leftovers of an earlier run (if any)"
dc down -v --remove-orphans >/dev/null 2>&1 || true

step "start the cluster: ${compose_cmd[*]} -p $project up -d"
dc up -d 2>&1 | sed 's/^/smoke:   /' || fail "docker compose up failed"

step "wait for 3 live members through node-1 ($addr1, up to 30s)"
wait_three_live "$addr1" 30

# ---------------------------------------------------------------- rules through node-3's ops port
step "rules: node-3's ops port serves the seeded cluster rules (127.0.0.1:$RINGLIMIT_OPS_PORT_3)"
out="$(rl rules get --addr "127.0.0.1:$RINGLIMIT_OPS_PORT_3" 2>&1)" || fail "rules get failed: $out"
info "$(head -1 <<<"$out")"
[[ "$(head -1 <<<"$out")" == "# rules version 1, digest "*", source cluster "* ]] || fail "node-3 does not serve the seeded rules at version 1"

# ---------------------------------------------------------------- check through node-1
step "check through node-1: key=smoke route=\"GET /smoke\""
out="$(check "$addr1" smoke)" || fail "node-1 did not answer: $out"
info "$out"
[[ "$(field_allowed "$out")" == true ]] || fail "node-1: check was not allowed"
info "allowed, decided by $(field_decider "$out")"

# A key node-3 owns, so that killing node-3 matters to the next check.
step "find a key owned by node-3 (the decider names the owner)"
victim=""
for i in $(seq 1 200); do
    out="$(check "$addr1" "smoke-$i")" || fail "node-1 did not answer: $out"
    if [[ "$(field_decider "$out")" == node-3 ]]; then
        victim="smoke-$i"
        break
    fi
done
[[ -n "$victim" ]] || fail "no key among smoke-1..200 is owned by node-3 (is node-3 on the ring?)"
info "key $victim is owned by node-3"

# ---------------------------------------------------------------- kill node-3
old_gen3="$(generation_of "$addr1" node-3)"
[[ -n "$old_gen3" ]] || fail "node-1 does not list node-3"
node3="$(dc ps -q node-3)"
[[ -n "$node3" ]] || fail "no container for node-3"
step "docker kill node-3 (container ${node3:0:12}, generation $old_gen3)"
docker kill "$node3" >/dev/null

step "check key $victim through node-2 ($addr2): must answer, decider not node-3 (up to 10s)"
start=$SECONDS
ok=0
while ((SECONDS - start < 10)); do
    if out="$(check "$addr2" "$victim")"; then
        decider="$(field_decider "$out")"
        if [[ -n "$decider" && "$decider" != node-3 ]]; then
            ok=1
            break
        fi
        info "answered by decider '${decider:-?}', retrying"
    else
        info "no answer yet: $out"
    fi
    sleep 1
done
[[ $ok -eq 1 ]] || fail "node-2 gave no answer with a decider other than node-3 within 10s (last: $out)"
info "$out"
info "answered after $((SECONDS - start))s: allowed=$(field_allowed "$out") decider=$decider degraded=$(field_degraded "$out")"
info "node-2 now sees $(live_members "$addr2") live members"

# ---------------------------------------------------------------- bring node-3 back
step "bring node-3 back: ${compose_cmd[*]} -p $project up -d node-3"
dc up -d node-3 2>&1 | sed 's/^/smoke:   /' || fail "docker compose up -d node-3 failed"

step "wait for 3 live members, node-3 with a new generation, through node-1 and node-3 (up to 30s)"
wait_three_live "$addr1" 30 "$old_gen3"
wait_three_live "$addr3" 30 "$old_gen3"

step "check through node-3 ($addr3): key=smoke"
out="$(check "$addr3" smoke)" || fail "node-3 did not answer: $out"
info "$out"
[[ "$(field_allowed "$out")" == true ]] || fail "node-3: check was not allowed"
info "allowed, decided by $(field_decider "$out")"

step "all checks passed"
passed=1
exit 0
