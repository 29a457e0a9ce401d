#!/usr/bin/env bash
# Builds the user guide (docs/, an mdBook) with the pinned mdbook, failing on any warning
# or error. mdbook itself does not check links; `cargo test --test docs_examples` does
# (every relative link and #anchor of README.md and docs/), and runs the examples.
# Installs mdbook with `cargo install --locked` when the pinned version is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

MDBOOK_VERSION=0.5.4
if ! mdbook --version 2>/dev/null | grep -qx "mdbook v$MDBOOK_VERSION"; then
    echo "== docs: installing mdbook $MDBOOK_VERSION (cargo install --locked)"
    cargo install mdbook --version "$MDBOOK_VERSION" --locked --no-default-features --features search
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
mdbook build docs >"$log" 2>&1 || status=$?
cat "$log"
if [ "$status" -ne 0 ]; then
    echo "== docs: mdbook build failed (exit $status)"
    exit 1
fi
if grep -Eq '(^|[[:space:]])(WARN|ERROR|warning|error)([[:space:]:]|$)' "$log"; then
    echo "== docs: mdbook printed warnings or errors (above): the guide must build clean"
    exit 1
fi
echo "== docs: the guide built in target/book"
