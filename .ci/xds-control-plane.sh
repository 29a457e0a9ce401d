#!/usr/bin/env bash
# The --envoy-xds test with a control plane ringlimit's Rust code did not write: an
# Aggregated Discovery Service in Python over Envoy's generated stubs (PyPI xds-protos), with
# the RateLimitConfig stubs grpcio-tools generates from proto/ratelimit/, pinned in
# tests/xds_control_plane/requirements.txt and installed into a virtualenv under the cargo
# target directory.
# Usage: .ci/xds-control-plane.sh   (builds the debug binary if needed)
set -euo pipefail
cd "$(dirname "$0")/.."

target=${CARGO_TARGET_DIR:-target}
req=tests/xds_control_plane/requirements.txt
venv=$target/xds-control-plane-venv
python=${PYTHON:-python3}
stamp="$venv/.requirements"
if [ ! -x "$venv/bin/python" ] || ! cmp -s "$req" "$stamp"; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$req"
    cp "$req" "$stamp"
fi
cargo build --quiet --bin ringlimit
"$venv/bin/python" tests/xds_control_plane/test_xds.py "$target/debug/ringlimit"
