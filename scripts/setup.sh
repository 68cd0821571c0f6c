#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv and install everything.
#
#   scripts/setup.sh [EXTRAS]     # default extras: book,test,lab,frameworks
#
# On a machine without an NVIDIA GPU (no /dev/nvidia0, no nvidia-smi), the CPU build of torch is installed first (on the course's
# machines `pip install torch==2.13.0` finds a CPU wheel on disk), so the range in pyproject.toml
# is already satisfied and the installer does not fetch a multi-GB CUDA build. With a GPU, uv
# resolves torch from that range and gets the CUDA build; setup then checks that torch can use
# the GPU, and says in one line what to do when it cannot (a CPU build kept, a driver too old).

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
stamp="$venv/.installed-$extras"

if [[ -f "$stamp" && "$stamp" -nt pyproject.toml ]]; then
  check_gpu_torch "$venv/bin/python"
  exit 0  # already set up for these extras and this pyproject.toml
fi
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# uv installs the project and its extras: it resolves the same versions as pip (the same
# `pip freeze`) in about 35 s where pip takes about 110 s on 2 cores. It compiles the bytecode
# as pip does (--compile-bytecode): without it, where PYTHONDONTWRITEBYTECODE is set, every
# process would compile Transformers and DeepSpeed again (3 s more per import measured).
# torch comes first, from pip, because only pip finds the CPU wheel on the course's disks.
if ! has_gpu; then
  "${pip[@]}" "torch==2.13.0" "uv>=0.5,<1"
else
  "${pip[@]}" "uv>=0.5,<1"
fi
"$venv/bin/uv" pip install --quiet --compile-bytecode --python "$venv/bin/python" -e ".[$extras]"
touch "$stamp"
check_gpu_torch "$venv/bin/python"
