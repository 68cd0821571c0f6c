"""handbook_lib.launch.recipe without a job: the command lines each node types (read back by the
CLI's own parser), the refusals before anything starts, how a node's outcome is shown, and which
GPUs each node gets. The real 2-node jobs, one each way, run once in chapter 8 (section "The
recipe, node by node"), whose outputs and assertions the notebook suite replays.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from handbook_lib.core.text import TERMINAL_WIDTH, wrap
from handbook_lib.face.cli import build_parser
from handbook_lib.launch.recipe import NodeRun, _last_said, _node_gpus, recipe_commands, run_recipe
from tests.conftest import processes_mentioning


def test_each_node_types_the_readme_command_with_its_own_node_rank(tmp_path):
    commands = recipe_commands("fsdp_train", 3, 2, {"steps": 3, "cpu_offload": True}, out=tmp_path / "d",
                               endpoint="10.0.0.1:29400", timeout_s=90)
    assert len(commands) == 3
    for k, cmd in enumerate(commands):
        assert cmd[:5] == ["python", "-m", "handbook_lib", "run", "fsdp_train"]
        assert shlex.split(shlex.join(cmd)) == cmd
        args = build_parser().parse_args(cmd[3:])  # what the CLI itself reads from it
        assert (args.name, args.nnodes, args.nproc, args.node_rank) == ("fsdp_train", 3, 2, k)
        assert (args.rdzv_endpoint, args.out, args.timeout, args.quiet) == ("10.0.0.1:29400",
                                                                              str(tmp_path / "d"), 90.0, True)
        assert args.overrides == ["steps=3", "cpu_offload=true"]
    # the nodes' commands differ only in --node-rank
    assert [[w for i, w in enumerate(c) if c[i - 1] != "--node-rank"] for c in commands] == \
        [[w for i, w in enumerate(commands[0]) if commands[0][i - 1] != "--node-rank"]] * 3


def test_a_folder_per_node_goes_to_each_node_in_order(tmp_path):
    folders = [tmp_path / "a b", tmp_path / "second"]  # a space survives the shell's quoting
    commands = recipe_commands("fault", 2, 1, {"mode": "none"}, out=folders)
    typed = [shlex.split(shlex.join(cmd)) for cmd in commands]
    assert [cmd[cmd.index("--out") + 1] for cmd in typed] == [str(f) for f in folders]
    assert [cmd[cmd.index("--set") + 1] for cmd in typed] == ["mode=none", "mode=none"]
    assert not any(f.exists() for f in folders)


@pytest.mark.parametrize("args, kwargs, words", [
    (("fault", 1, 1), {}, "nnodes must be an int >= 2 (the recipe is for several nodes), got 1"),
    (("fault", 2, 0), {}, "nproc must be an int >= 1, got 0"),
    (("fault", 2, 1.5), {}, "nproc must be an int >= 1, got 1.5"),
    (("nope", 2, 1), {}, "unknown run 'nope'; available runs: "),
    (("fault", 2, 1), {"timeout_s": 0}, "timeout_s must be a number of seconds > 0, got 0"),
    (("fault", 3, 1), {"out": ["x", "y"]}, "out must be one folder or 3 folders (one per node)"),
])
def test_bad_arguments_are_refused_in_one_line_before_anything_starts(args, kwargs, words, tmp_path):
    out = kwargs.pop("out", None) or tmp_path / "never"
    for call in (recipe_commands, run_recipe):
        with pytest.raises(ValueError) as info:
            call(*args, out=out, **kwargs)
        assert words in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "never").exists() and processes_mentioning(str(tmp_path)) == []


def test_the_last_line_joins_the_clis_wrapped_continuation():
    said = ("node 1: its ranks finished; rank 0 ran on another node (torchrun's rendezvous numbers the "
            "nodes), whose --out folder holds result.json")
    printed = wrap(said, TERMINAL_WIDTH, "  ", break_long_words=False)  # as the CLI prints it
    assert printed.count("\n") == 1
    assert _last_said("W0101 a warning\n\n" + printed + "\n\n") == said
    assert _last_said("checks table\nresult: /x/result.json\n") == "result: /x/result.json"
    assert _last_said("") == ""


def _node(tmp_path: Path, said: str) -> NodeRun:
    cmd = recipe_commands("fault", 2, 1, {"mode": "none"}, out=tmp_path / "node1",
                          endpoint="127.0.0.1:41234")[1]
    return NodeRun(1, tuple(cmd), 0, said, said + "\n", tmp_path / "node1", False, 7.31)


def test_describe_is_the_same_text_wherever_the_folder_and_port_are(tmp_path):
    said = (f"node 1: its ranks finished; rank 0 ran on another node (torchrun's rendezvous numbers "
            f"the nodes), whose --out folder holds result.json, not {tmp_path}/node1")
    text = _node(tmp_path, said).describe(tmp_path, width=72)
    assert str(tmp_path) not in text and "41234" not in text
    lines = text.splitlines()
    assert max(map(len, lines)) <= 72
    typed = next(i for i, line in enumerate(lines) if line.startswith("  exit"))
    command, said_lines = lines[:typed], lines[typed:]
    assert all(line.endswith(" \\") for line in command[:-1]) and not command[-1].endswith("\\")
    assert all(line.startswith("    ") for line in command[1:] + said_lines[1:])
    assert " ".join(line.removesuffix(" \\").strip() for line in command) == (
        "python -m handbook_lib run fault --nnodes 2 --nproc 1 --node-rank 1 "
        "--rdzv-endpoint 127.0.0.1:PORT --out node1 --quiet --timeout 120 --set mode=none")
    assert not any(line.endswith(("--out \\", "--rdzv-endpoint \\", "--set \\")) for line in command)
    assert said_lines[0].startswith("  exit 0: node 1: its ranks finished")
    assert " ".join(line.strip() for line in said_lines).endswith("holds result.json, not node1")
    assert "127.0.0.1:PORT" in _node(tmp_path, "x").describe()  # no root: paths stay absolute


def test_each_node_gets_its_own_gpus_or_none(monkeypatch):
    import torch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _node_gpus(2, 1) == [{}, {}]  # no CUDA: nothing to hide
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert _node_gpus(2, 2) == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    # 3 GPUs for 2 nodes x 2 ranks: the second node would get one, so both run on the CPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert _node_gpus(2, 2) == [{"CUDA_VISIBLE_DEVICES": ""}] * 2


def test_an_interrupted_recipe_leaves_no_process_behind(tmp_path, monkeypatch):
    """Ctrl-C while the nodes run (here, once a rank of theirs exists): every CLI, torchrun agent
    and rank the nodes started is stopped before the KeyboardInterrupt reaches the caller."""
    import time

    from handbook_lib.launch import recipe

    real_sleep, start, pressed = time.sleep, time.monotonic(), []

    def sleep_then_interrupt(seconds: float) -> None:  # time.sleep, everywhere: Ctrl-C once only
        real_sleep(seconds)
        ranks = [p for p in processes_mentioning(str(tmp_path)) if "handbook_lib.runs.fault" in p.cmdline()]
        if not pressed and (ranks or time.monotonic() - start > 60):
            pressed.append(time.monotonic() - start)
            raise KeyboardInterrupt

    monkeypatch.setattr(recipe.time, "sleep", sleep_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_recipe("fault", 2, 1, {"mode": "sleep", "sleep_s": 600}, out=tmp_path / "shared")
    assert pressed[0] < 60  # a rank had started: the processes were there to stop
    assert processes_mentioning(str(tmp_path)) == []
