#!/usr/bin/env bash
# The whole test suite: formatting, lints, doc links, and every test of the
# workspace (unit, integration, doc). CI runs exactly this; it passes on a plain clone.
#
# The conformance corpus (Accelerate's own config files) sits beside the
# repository in CI, at ../shared/conformance (ACCEL_CONFORMANCE_DIR names
# another place). When it is there, its suite runs once more on its own,
# required and loud, and says what it checked; without it, every test that
# reads it says it skipped, and so does this script.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each phase's header says how long the run has taken so far, so a CI log
# shows where its minutes went.
phase() { echo "== [$((SECONDS / 60))m$((SECONDS % 60))s] $*"; }
phase "bootstrap"
bash scripts/bootstrap.sh

phase "cargo fmt --check"
cargo fmt --all -- --check
phase "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --quiet -- -D warnings
phase "cargo doc -D warnings (broken doc links)"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace --quiet
phase "cargo test"
cargo test --workspace

corpus="${ACCEL_CONFORMANCE_DIR:-../shared/conformance}"
if [ -d "$corpus" ]; then
  ACCEL_CONFORMANCE_DIR="$(cd "$corpus" && pwd)"
  phase "conformance: $ACCEL_CONFORMANCE_DIR"
  export ACCEL_CONFORMANCE_DIR ACCEL_REQUIRE_CONFORMANCE=1
  # The test binaries `cargo test --workspace` just built, run again (not
  # rebuilt: `-p` selects features differently and would relink them).
  # --nocapture: each test prints a `conformance: ...` line saying what it checked.
  exes=$(cargo test --workspace --no-run --message-format=json 2>/dev/null | python3 -c '
import json, os, sys
want = ("config/tests/conformance.rs", "tests/config_cli.rs", "plugins/fsdp/src/lib.rs")
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    src = os.path.relpath(m["target"]["src_path"])
    if src in want and m["profile"]["test"]:
        print(m["target"]["name"], os.path.dirname(m["manifest_path"]), m["executable"])
')
  phase "conformance: running its 3 test binaries"
  [ "$(printf '%s\n' "$exes" | wc -l)" -eq 3 ] ||
    { echo "conformance: expected 3 test binaries, found: $exes"; exit 1; }
  while read -r name dir exe; do
    case "$name" in
      conformance) filter="" ;;
      *) filter=conformance ;;
    esac
    # shellcheck disable=SC2086
    if ! out=$(cd "$dir" && "$exe" $filter --nocapture 2>&1); then
      printf '%s\n' "$out"
      echo "conformance: FAILED: $exe $filter"
      exit 1
    fi
    printf '%s\n' "$out" | grep -o 'conformance: .*' ||
      { echo "conformance: $exe $filter checked nothing"; exit 1; }
  done <<< "$exes"
else
  phase "conformance: skipped (no corpus at $corpus; CI has it beside the repository)"
fi
phase "all passed"
