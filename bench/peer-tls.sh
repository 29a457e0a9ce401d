#!/usr/bin/env bash
# Peer mTLS overhead (bench/RESULTS.md): the same 3-node cluster (cluster key on) with
# and without mutual TLS on the peer face, alternating. Needs openssl and a release
# build (cargo build --release). Usage: bench/peer-tls.sh
set -euo pipefail
BIN=${RINGLIMIT_BIN:-$(cd "$(dirname "$0")/.." && pwd)/target/release/ringlimit}
D=$(mktemp -d); trap 'rm -rf "$D"' EXIT; cd "$D"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 -subj /CN=ringlimit-ca -keyout ca.key -out ca.pem 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=member -keyout member.key -out member.csr 2>/dev/null
openssl x509 -req -in member.csr -CA ca.pem -CAkey ca.key -days 30 -extfile <(printf 'subjectAltName=DNS:ringlimit-peer') -out member.pem 2>/dev/null
head -c 32 /dev/urandom | base64 > secret
cat > rules.toml <<'R'
[default]
algorithm = "sliding_window_counter"
limit = 1000000
window = "60s"
R
run() { # $1 = plain|tls
  local tls=()
  [ "$1" = tls ] && tls=(--peer-tls-cert member.pem --peer-tls-key member.key --peer-tls-ca ca.pem)
  local pids=() addrs=() seed=""
  for i in 1 2 3; do
    local args=(serve --node-id n$i --listen 127.0.0.1:0 --peer-listen 127.0.0.1:0 --gossip-listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --rules rules.toml --cluster-secret-file secret "${tls[@]}")
    [ -n "$seed" ] && args+=(--seed "$seed")
    RUST_LOG=warn $BIN "${args[@]}" > n$i.$1.out 2> n$i.$1.err &
    pids+=($!)
    for _ in $(seq 50); do grep -q "ringlimit ready" n$i.$1.out 2>/dev/null && break; sleep 0.1; done
    addrs+=($(grep -o "grpc=[0-9.:]*" n$i.$1.out | cut -d= -f2))
    [ -z "$seed" ] && seed=$(grep -o "gossip=[0-9.:]*" n$i.$1.out | cut -d= -f2)
  done
  sleep 3
  local targets=()
  for a in "${addrs[@]}"; do targets+=(--addr "$a"); done
  echo "== $1: ${addrs[*]}"
  $BIN bench "${targets[@]}" --duration 8 --warmup 2 --concurrency 50 2>&1 | grep -E "^ringlimit "
  kill "${pids[@]}"; wait "${pids[@]}" 2>/dev/null || true
}
for round in 1 2; do run plain; run tls; done
