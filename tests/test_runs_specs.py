"""handbook_lib.runs.specs: each run's config and checks, torch-free, in one home.

The launcher validates a config through :func:`handbook_lib.launch.preflight.check_run_config`,
once per launch, before anything starts: here in a fresh process, for every run's default config
and one bad config per run, with ``torch`` never imported.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import handbook_lib.runs as runs
from handbook_lib.core.run_spec import RunSpec
from handbook_lib.runs import available_runs, describe_runs, run_config_fields, run_spec
from handbook_lib.runs.specs import SPECS

RUNS_DIR = Path(runs.__file__).parent
ROOT = RUNS_DIR.parent.parent

BAD = {  # one config each run refuses, and a word of its one-line message
    "accelerate_fsdp": ({"strategy": "DDP"}, 2, "accelerate_fsdp runs api='fsdp2'"),
    "checkpoint_cost": ({"api": "fsdp1"}, 2, "checkpoint_cost supports api='fsdp2'"),
    "checkpoint_resume": ({}, 2, "checkpoint_resume needs ckpt_dir"),
    "clinic": ({}, 1, "clinic needs >= 2 ranks"),
    "comm_bench": ({}, 1, "comm_bench needs at least 2 ranks"),
    "deepspeed_zero": ({"strategy": "FULL_SHARD"}, 2, "deepspeed_zero runs strategy"),
    "fault": ({"fail_rank": 5}, 2, "fail_rank must be in [0, 2)"),
    "fsdp_train": ({"strategy": "NONE"}, 2, "one-process baseline"),
    "hf_weights": ({}, 2, "hf_weights needs save_dir"),
    "pipeline": ({"pp_size": 1}, 2, "the pipeline run needs pp_size >= 2"),
    "sequence_parallel": ({}, 2, "sequence_parallel needs sp_size >= 2"),
    "step_time": ({}, 1, "step_time compares DDP with FSDP"),
    "tensor_parallel": ({}, 2, "tensor_parallel needs tp_size >= 2"),
    "trace_step": ({"strategy": "DDP"}, 2, "trace_step runs api='fsdp2'"),
    "trainer_deepspeed": ({}, 1, "trainer_deepspeed needs trainer_dir"),
}


def _required(run: str, folder: Path) -> dict:
    """The keys a run's default config lacks to pass (a folder it writes into, the axis it splits;
    ``nproc``: its ranks, 2 unless given)."""
    return {"checkpoint_resume": {"ckpt_dir": str(folder / "ck")}, "hf_weights": {"save_dir": str(folder / "st")},
            "trainer_deepspeed": {"trainer_dir": str(folder / "t"), "nproc": 1},
            "sequence_parallel": {"sp_size": 2}, "tensor_parallel": {"tp_size": 2}}.get(run, {})


def test_every_run_module_has_a_spec_and_no_other():
    shared = ("entry", "axes_checks")  # every run's harness; the body of the two runs of chapter 9's axes
    modules = sorted(m.name for m in pkgutil.iter_modules([str(RUNS_DIR)])
                     if not m.ispkg and not m.name.startswith("_") and m.name not in shared)
    assert available_runs() == modules == sorted(SPECS)
    assert all(isinstance(s, RunSpec) and s.name == name for name, s in SPECS.items())
    assert set(BAD) == set(SPECS)


def test_the_registry_reads_the_specs_not_the_source():
    """runs/__init__ parses no source (no ast); what it says is the specs' data."""
    tree = ast.parse((RUNS_DIR / "__init__.py").read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "ast" not in imported
    assert describe_runs() == {name: spec.summary for name, spec in SPECS.items()}
    for name in available_runs():
        assert run_spec(name) is SPECS[name]
        assert run_config_fields(name).class_name == SPECS[name].config.__name__


def test_each_run_module_s_docstring_opens_with_its_spec_s_summary_and_imports_its_config():
    """One home: the run module defines no config class and no validate of its own; its CONFIG and
    validate are the spec's, and its first docstring line is the spec's summary."""
    for name, spec in SPECS.items():
        tree = ast.parse((RUNS_DIR / f"{name}.py").read_text(encoding="utf-8"))
        assert (ast.get_docstring(tree) or "").splitlines()[0] == spec.summary, name
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        assert not defined & {"CONFIG", "validate", spec.config.__name__}, name
        spec_imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == f"handbook_lib.runs.specs.{name}"]
        assert spec_imports and "CONFIG" in {a.name for a in spec_imports[0].names}, name


_CHILD = r"""
import json, sys, time
from handbook_lib.launch.preflight import check_run_config
from handbook_lib.runs import available_runs

required, bad = json.loads(sys.argv[1]), json.loads(sys.argv[2])
seconds, refused = {}, {}
for run in available_runs():
    extra = dict(required.get(run, {}))
    world = extra.pop("nproc", 2)
    start = time.perf_counter()
    check_run_config(run, extra, world)
    seconds[run] = time.perf_counter() - start
    config, world, _ = bad[run]
    try:
        check_run_config(run, config, world, label="bad")
    except ValueError as err:
        refused[run] = str(err)
print(json.dumps({"torch": "torch" in sys.modules, "seconds": seconds, "refused": refused}))
"""


def test_the_launcher_validates_every_run_without_torch(tmp_path):
    """In a fresh process: every run's default config passes the launcher's validation and one bad
    config per run is refused with its one-line message ('config 'bad': ...' in a batch), and
    torch is never imported."""
    required = {run: _required(run, tmp_path) for run in SPECS}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(required), json.dumps(BAD)], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=120)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["torch"] is False
    assert set(report["refused"]) == set(BAD)
    for run, (_, _, words) in BAD.items():
        message = report["refused"][run]
        assert message.startswith("config 'bad': ") and words in message and "\n" not in message, (run, message)
    assert max(report["seconds"].values()) < 0.5  # milliseconds each; torch's import alone is ~2 s
