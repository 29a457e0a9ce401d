#!/usr/bin/env bash
# Validates the manifests in deploy/kubernetes against the Kubernetes API schemas
# (kubernetes-validate from PyPI, strict: unknown fields are errors), and the seed rules
# in configmap.yaml with `ringlimit rules check`. Installs kubernetes-validate with pip
# when it is missing. Run from anywhere; .ci/run runs it.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

if ! command -v kubernetes-validate >/dev/null 2>&1; then
    echo "validate: installing kubernetes-validate (pip)"
    python3 -m pip install --quiet --disable-pip-version-check kubernetes-validate
fi
kubernetes-validate --strict "$here"/*.yaml "$here"/examples/*.yaml

# The ConfigMap's rules must be a valid rule file (a seed a node would refuse to start with
# is caught here, not in a rollout). PyYAML comes with kubernetes-validate.
rules="$(mktemp "${TMPDIR:-/tmp}/ringlimit-k8s-rules.XXXXXX.toml")"
trap 'rm -f "$rules"' EXIT
python3 - "$here/configmap.yaml" >"$rules" <<'PY'
import sys, yaml
print(yaml.safe_load(open(sys.argv[1]))["data"]["rules.toml"], end="")
PY
bin="${RINGLIMIT_BIN:-}"
if [[ -z "$bin" ]]; then
    (cd "$repo" && cargo build --quiet)
    bin="${CARGO_TARGET_DIR:-$repo/target}/debug/ringlimit"
fi
"$bin" rules check "$rules"
