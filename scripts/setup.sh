#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv and install everything, at the
# versions requirements.lock pins (scripts/lock.py; `make lock` makes it).
#
#   scripts/setup.sh [EXTRAS]     # default extras: book,test,lab,frameworks
#
# The lock is a constraints file: the extras named are installed, each package at its locked
# version. Before anything is installed, a lock that no longer matches pyproject.toml (a range
# changed, `make lock` not run) is refused in one line.
#
# On a machine without an NVIDIA GPU (no /dev/nvidia0, no nvidia-smi), the CPU build of the
# locked torch is installed first (on the course's machines `pip install torch==VERSION` finds a
# CPU wheel on disk), so the lock's torch==VERSION is already satisfied (its local label, +cpu,
# matches) and the installer does not fetch a multi-GB CUDA build. With a GPU, uv takes the CUDA
# build of the same version from PyPI; setup then checks that torch can use the GPU, and says in
# one line what to do when it cannot (a CPU build kept, a driver too old).

# A GPU is here, whatever torch says: the device node (containers often lack nvidia-smi), or
# nvidia-smi lists one.
has_gpu() { [[ -e /dev/nvidia0 ]] || nvidia-smi -L >/dev/null 2>&1; }

# Where a GPU is, torch must be a CUDA build that can use it; else one line saying what to do
# (handbook_lib.launch.gpu_check.no_gpu_message: a CPU build, or a driver too old). $1: python.
check_gpu_torch() {
  has_gpu || return 0
  "$1" - <<'PY' || true
import sys

import torch

from handbook_lib.launch.gpu_check import no_gpu_message

if not (torch.version.cuda and torch.cuda.is_available()):
    print("setup: " + no_gpu_message(torch.version.cuda, True, torch.__version__), file=sys.stderr)
PY
}

[[ "${BASH_SOURCE[0]}" == "$0" ]] || return 0  # sourced (tests): the functions only
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-book,test,lab,frameworks}"
venv="${VENV:-.venv}"

# The lock must be the one pyproject.toml's requirements give, before anything is installed
# (Python 3.10 has no tomllib: there the check runs in the new venv, whose pip carries tomli).
checker=python3
python3 -c "import tomllib" 2>/dev/null || { python3 -m venv "$venv"; checker="$venv/bin/python"; }
"$checker" scripts/lock.py check || exit 2
torch_pin="$("$checker" scripts/lock.py pin torch)"  # torch==VERSION
uv_pin="$("$checker" scripts/lock.py pin uv)"

# Is NAME==VERSION ($1) installed in the venv (a local label such as +cpu aside)?
installed() {
  "$venv/bin/python" - "$1" 2>/dev/null <<'PY'
import importlib.metadata as metadata, sys
name, version = sys.argv[1].split("==")
sys.exit(metadata.version(name).split("+")[0] != version)
PY
}

[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch comes first, from pip, because only pip finds the CPU wheel on the course's disks; then
# uv installs the project and its extras within the lock (about 35 s from nothing, where pip
# takes about 110 s on 2 cores; 2 s when all is in place already, so it runs every time and a
# package changed by hand goes back to its locked version). It compiles the bytecode as pip does
# (--compile-bytecode): without it, where PYTHONDONTWRITEBYTECODE is set, every process would
# compile Transformers and DeepSpeed again (3 s more per import measured).
if ! has_gpu && ! installed "$torch_pin"; then
  "${pip[@]}" "$torch_pin"
fi
installed "$uv_pin" || "${pip[@]}" "$uv_pin"
"$venv/bin/uv" pip install --quiet --compile-bytecode --python "$venv/bin/python" \
  --constraint requirements.lock -e ".[$extras]"
check_gpu_torch "$venv/bin/python"

# The book's planner page (book/planner.md) runs the package's models in the browser with Pyodide's
# core runtime, from npm at this exact version, into .venv/node (not global); the book's build copies
# it into the site (book/_ext/planner.py).
pyodide_pin="314.0.8"
if [[ ",$extras," == *",book,"* ]]; then
  have="$(node -p "require('./$venv/node/node_modules/pyodide/package.json').version" 2>/dev/null || true)"
  if [[ "$have" != "$pyodide_pin" ]]; then
    command -v npm >/dev/null || { echo "setup: the book's planner page needs Node.js and npm (for Pyodide $pyodide_pin)" >&2; exit 1; }
    npm install --prefix "$venv/node" --no-audit --no-fund --loglevel=error "pyodide@$pyodide_pin"
  fi
fi
