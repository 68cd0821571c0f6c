"""Which CPU kernels stored the notebooks' outputs, and which other kernels replay them.

The outputs stored in ``notebooks/*.ipynb`` must not depend on the CPU that made them: the last
float digits do (ATen's vector unit, oneDNN's ISA, MKL's code branch). ``make notebooks`` records
the kernels it ran with in each notebook's metadata (``handbook.cpu``); ``make test`` and
``make check-portable`` re-execute the notebooks with *other* kernels than those, on this same
machine, so that a digit the stored output depends on fails the comparison here rather than on
the next contributor's laptop.

    python scripts/cpu_variant.py --native     # JSON: the kernels this machine uses by default
    python scripts/cpu_variant.py --stored     # the ATen capability the notebooks were stored with
    python scripts/cpu_variant.py --other      # KEY=VALUE lines: kernels unlike the stored ones

The variables (all read by the installed torch 2.13, checked by measurement):

- ``ATEN_CPU_CAPABILITY`` (``default``, ``avx2``, ``avx512``): ATen's vectorized kernels;
- ``ONEDNN_MAX_CPU_ISA`` (e.g. ``AVX2``): oneDNN's, which must be lowered with ATen's or bf16
  attention fails on an AMX CPU ("pack_vnni2 is only supported when avx512 is supported");
- ``MKL_CBWR`` (``COMPATIBLE``): MKL's BLAS code branch. On an AMD CPU ``AVX2`` and ``AVX512``
  give the native result bit for bit (MKL already runs its AVX2 branch there); ``COMPATIBLE``
  changes the matmul results on every x86 CPU, so it is the one used.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"

_PROBE = "import torch; print(torch.backends.cpu.get_cpu_capability())"

_OTHER = {
    # stored with -> replayed with
    "AVX512": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "COMPATIBLE"},
    "AVX2": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "COMPATIBLE"},
    "DEFAULT": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "COMPATIBLE"},
}


def kernels(env: dict[str, str] | None = None) -> dict[str, str]:
    """The kernels torch runs with under ``env`` (default: this process's environment): ATen's
    capability as torch names it (e.g. ``AVX512``), read from a fresh interpreter, and the
    oneDNN and MKL variables (``native`` where unset)."""
    env = dict(os.environ if env is None else env)
    capability = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                                check=True, env=env).stdout.strip()
    return {"aten": capability, "onednn_max_cpu_isa": env.get("ONEDNN_MAX_CPU_ISA", "native"),
            "mkl_cbwr": env.get("MKL_CBWR", "native")}


def native() -> dict[str, str]:
    """The kernels a plain ``import torch`` picks on this machine, none of the variables set."""
    return kernels({k: v for k, v in os.environ.items() if k not in _OTHER["AVX512"]})


def stored() -> set[str]:
    """The ATen capabilities recorded in the notebooks' metadata (``UNKNOWN`` where none is)."""
    found = set()
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        meta = json.loads(path.read_text()).get("metadata", {})
        found.add(meta.get("handbook", {}).get("cpu", {}).get("aten", "UNKNOWN"))
    return found


def other() -> dict[str, str]:
    """Variables that replay the notebooks with kernels other than the ones that stored them.

    Raises:
        SystemExit: if the notebooks were stored with different kernels from one another, or
            with kernels this script does not know (re-run ``make notebooks``).
    """
    kinds = stored()
    if len(kinds) != 1 or next(iter(kinds)) not in _OTHER:
        raise SystemExit(f"notebooks were stored with CPU kernels {sorted(kinds)}; expected one of "
                         f"{', '.join(_OTHER)} for all: re-run `make notebooks`")
    return _OTHER[next(iter(kinds))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--native", action="store_true", help="print this machine's kernels (JSON)")
    what.add_argument("--stored", action="store_true", help="print the stored ATen capability")
    what.add_argument("--other", action="store_true", help="print KEY=VALUE lines for other kernels")
    args = parser.parse_args(argv)
    if args.native:
        print(json.dumps(native()))
    elif args.stored:
        print(" ".join(sorted(stored())))
    else:
        print("\n".join(f"{k}={v}" for k, v in other().items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
