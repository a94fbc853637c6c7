#!/usr/bin/env bash
# Runs every check and test stockd has: formatting, lints, unit tests and the black-box HTTP
# suite against the real server binary. This is the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."

# Builds stay warm across fresh clones when the target directory lives outside the clone.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/stockd-target}"
export CARGO_TERM_COLOR=never

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy"
cargo clippy --all-targets --locked -- -D warnings

echo "== cargo test"
cargo test --all-targets --locked
