#!/usr/bin/env bash
# The Gubernator test with a client ringlimit did not write: Python stubs generated at test
# time by grpcio-tools from proto/gubernator/gubernator.proto, in a virtualenv under target/
# pinned by tests/gubernator_client/requirements.txt, against 3 `ringlimit serve
# --gubernator` processes.
# Usage: .ci/gubernator-client.sh   (builds the debug binary if needed)
set -euo pipefail
cd "$(dirname "$0")/.."

req=tests/gubernator_client/requirements.txt
venv=target/gubernator-client-venv
python=${PYTHON:-python3}
stamp="$venv/.requirements"
if [ ! -x "$venv/bin/python" ] || ! cmp -s "$req" "$stamp"; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$req"
    cp "$req" "$stamp"
fi
cargo build --quiet --bin ringlimit
"$venv/bin/python" tests/gubernator_client/test_gubernator.py target/debug/ringlimit
