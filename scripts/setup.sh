#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv and install everything.
#
#   scripts/setup.sh [EXTRAS]     # default extras: book,test,lab,frameworks
#
# On a machine without an NVIDIA GPU, the CPU build of torch is installed first (on the course's
# machines `pip install torch==2.13.0` finds a CPU wheel on disk), so the range in pyproject.toml
# is already satisfied and the installer does not fetch a multi-GB CUDA build. With a GPU, uv
# resolves torch from that range and gets the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-book,test,lab,frameworks}"
venv="${VENV:-.venv}"
stamp="$venv/.installed-$extras"

if [[ -f "$stamp" && "$stamp" -nt pyproject.toml ]]; then
  exit 0  # already set up for these extras and this pyproject.toml
fi
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# uv installs the project and its extras: it resolves the same versions as pip (the same
# `pip freeze`) in about 35 s where pip takes about 110 s on 2 cores. It compiles the bytecode
# as pip does (--compile-bytecode): without it, where PYTHONDONTWRITEBYTECODE is set, every
# process would compile Transformers and DeepSpeed again (3 s more per import measured).
# torch comes first, from pip, because only pip finds the CPU wheel on the course's disks.
if ! command -v nvidia-smi >/dev/null 2>&1; then
  "${pip[@]}" "torch==2.13.0" "uv>=0.5,<1"
else
  "${pip[@]}" "uv>=0.5,<1"
fi
"$venv/bin/uv" pip install --quiet --compile-bytecode --python "$venv/bin/python" -e ".[$extras]"
touch "$stamp"
