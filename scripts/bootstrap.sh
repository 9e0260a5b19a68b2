#!/usr/bin/env bash
# Sets up a fresh machine for accel, idempotently: system packages (OpenMPI,
# libclang for rsmpi's bindgen), the project venv with PyTorch 2.13.0 and the
# Python peers, the `.libtorch` link the build uses, and a build of the
# workspace. Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'bootstrap: %s\n' "$*" >&2; }

# 1. System packages.
APT_PACKAGES=(openmpi-bin libopenmpi-dev libclang-dev pkg-config slurmctld slurmd slurm-client munge)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [ "$(id -u)" = 0 ]; then
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    say "missing system packages; run as root:"
    say "  sudo apt-get update && sudo apt-get install -y ${missing[*]}"
    exit 1
  fi
fi

# 2. The project venv with PyTorch and the Python peers.
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PY" -m venv .venv
fi
# The packages go in with uv (from PyPI, into the venv by pip): it fetches
# in parallel and installs the same versions as pip, in a fraction of the
# time (PyTorch's wheels and CUDA libraries: 22 s against pip's 3 min).
UV_VERSION=0.13.9
uv_install() {
  if [ "$(.venv/bin/uv --version 2>/dev/null)" != "uv $UV_VERSION" ]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
  fi
  .venv/bin/uv pip install --quiet --python .venv/bin/python "$@"
}
if ! .venv/bin/python - <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import version
want = {}
for line in open("scripts/requirements.txt"):
    line = line.split("#")[0].strip()
    if line:
        name, ver = line.split("==")
        want[name] = ver
sys.exit(0 if all(version(n) == v for n, v in want.items()) else 1)
PYEOF
then
  say "installing Python packages (PyTorch is about 5 GB; half a minute with uv)"
  uv_install -r scripts/requirements.txt
fi
# DeepSpeed, whose loss scaler is the peer of the DEEPSPEED fp16 tests: an
# sdist whose setup.py imports torch, so it builds against the venv's torch
# (--no-build-isolation; setuptools comes with torch) and compiles no ops.
DEEPSPEED_VERSION=0.19.8
if ! .venv/bin/python -c "import sys; from importlib.metadata import version; sys.exit(version('deepspeed') != '$DEEPSPEED_VERSION')" 2>/dev/null; then
  say "installing DeepSpeed $DEEPSPEED_VERSION (a test peer)"
  uv_install --no-build-isolation "deepspeed==$DEEPSPEED_VERSION"
fi

# 3. `.libtorch` -> the wheel's torch/ package (include/ and lib/), which
#    .cargo/config.toml hands to torch-sys as LIBTORCH.
torch_dir=$(.venv/bin/python -c 'import os, torch; print(os.path.dirname(torch.__file__))')
if [ "$(readlink .libtorch 2>/dev/null)" != "$torch_dir" ]; then
  ln -sfn "$torch_dir" .libtorch
fi

# 4. Build everything.
say "building the workspace"
cargo build --quiet
say "ready"
