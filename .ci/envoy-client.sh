#!/usr/bin/env bash
# The Envoy RLS test with clients ringlimit did not write: Envoy's generated Python stubs
# (PyPI xds-protos) and the stock grpcio-reflection client, pinned in
# tests/envoy_client/requirements.txt, installed into a virtualenv under target/.
# Usage: .ci/envoy-client.sh   (builds the debug binary if needed)
set -euo pipefail
cd "$(dirname "$0")/.."

req=tests/envoy_client/requirements.txt
venv=target/envoy-client-venv
python=${PYTHON:-python3}
stamp="$venv/.requirements"
if [ ! -x "$venv/bin/python" ] || ! cmp -s "$req" "$stamp"; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$req"
    cp "$req" "$stamp"
fi
cargo build --quiet --bin ringlimit
"$venv/bin/python" tests/envoy_client/test_rls.py target/debug/ringlimit
