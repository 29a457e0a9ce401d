#!/usr/bin/env bash
# The RESP face with a client ringlimit did not write: redis-py, pinned by
# tests/redis_py/requirements.txt in a virtualenv under target/, against 3
# `ringlimit serve --resp-listen` processes (AUTH with a token file, pipelines, RESP3),
# and a fourth over mutual TLS (rediss://, certificates made with openssl).
# Usage: .ci/redis-py.sh   (builds the debug binary if needed)
set -euo pipefail
cd "$(dirname "$0")/.."

req=tests/redis_py/requirements.txt
venv=target/redis-py-venv
python=${PYTHON:-python3}
stamp="$venv/.requirements"
if [ ! -x "$venv/bin/python" ] || ! cmp -s "$req" "$stamp"; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$req"
    cp "$req" "$stamp"
fi
cargo build --quiet --bin ringlimit
"$venv/bin/python" tests/redis_py/test_redis_py.py target/debug/ringlimit
