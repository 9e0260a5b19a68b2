#!/usr/bin/env bash
# The whole test suite: formatting, lints, and every test of the workspace
# (unit, integration, doc). CI runs exactly this; it passes on a plain clone.
#
# The conformance corpus (Accelerate's own config files) sits beside the
# repository in CI, at ../shared/conformance (ACCEL_CONFORMANCE_DIR names
# another place). When it is there, its suite runs once more on its own,
# required and loud, and says what it checked; without it, every test that
# reads it says it skipped, and so does this script.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "== cargo test"
cargo test --workspace

corpus="${ACCEL_CONFORMANCE_DIR:-../shared/conformance}"
if [ -d "$corpus" ]; then
  ACCEL_CONFORMANCE_DIR="$(cd "$corpus" && pwd)"
  echo "== conformance: $ACCEL_CONFORMANCE_DIR"
  export ACCEL_CONFORMANCE_DIR ACCEL_REQUIRE_CONFORMANCE=1
  # --nocapture: each test prints a `conformance: ...` line saying what it checked.
  for suite in "-p accel-config --test conformance" \
               "-p accel-integration-tests --test config_cli conformance" \
               "-p accel-fsdp --lib conformance"; do
    # shellcheck disable=SC2086
    if ! out=$(cargo test -q $suite -- --nocapture 2>&1); then
      printf '%s\n' "$out"
      echo "conformance: FAILED: cargo test $suite"
      exit 1
    fi
    printf '%s\n' "$out" | grep -o 'conformance: .*' ||
      { echo "conformance: cargo test $suite checked nothing"; exit 1; }
  done
else
  echo "== conformance: skipped (no corpus at $corpus; CI has it beside the repository)"
fi
