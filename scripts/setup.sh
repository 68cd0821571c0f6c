#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv and install everything.
#
#   scripts/setup.sh [EXTRAS]     # default extras: book,test,lab,frameworks
#
# On a machine without an NVIDIA GPU, the CPU build of torch is installed first (on the course's
# machines `pip install torch==2.13.0` finds a CPU wheel on disk), so the range in pyproject.toml
# is already satisfied and pip does not fetch a multi-GB CUDA build. With a GPU, pip resolves
# torch from that range and gets the CUDA build.
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
if ! command -v nvidia-smi >/dev/null 2>&1; then
  "${pip[@]}" "torch==2.13.0"
fi
"${pip[@]}" -e ".[$extras]"
touch "$stamp"
