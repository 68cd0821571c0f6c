"""handbook_lib.face.cli: ``python -m handbook_lib`` commands and exit codes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from handbook_lib.face import main
from handbook_lib.models import estimate_accumulation_bytes, plan
from handbook_lib.runs import available_runs


def test_params_prints_the_breakdown(capsys):
    assert main(["params"]) == 0
    out = capsys.readouterr().out
    assert "total   9,868,560" in out and "embedding   2,560,000" in out


def test_bad_argument_exits_2_with_a_message(capsys):
    assert main(["params", "--set", "nhead=5"]) == 2
    assert "nhead=5 must divide d_model=256" in capsys.readouterr().err
    assert main(["run", "nope"]) == 2
    assert "available runs" in capsys.readouterr().err


def test_run_writes_result_json_single_rank(tmp_path, capsys):
    assert main(["run", "fault", "--nproc", "1", "--set", "mode=none", "--set", "fail_rank=0",
                 "--out", str(tmp_path), "--quiet"]) == 0
    data = json.loads((tmp_path / "result.json").read_text())
    # each rank's record: its measurements, and where it ran
    import socket
    assert data["world_size"] == 1 and data["ranks"] == [
        {"rank": 0, "all_reduce_sum": 1.0, "host": socket.gethostname(), "node_rank": 0, "local_rank": 0}]
    assert f"result: {tmp_path / 'result.json'}" in capsys.readouterr().out


def test_module_entry_point_lists_runs():
    done = subprocess.run([sys.executable, "-m", "handbook_lib", "runs"], capture_output=True, text=True, check=True)
    listed = [line.split()[0] for line in done.stdout.splitlines() if not line.startswith(" ")]  # not wrapped lines
    assert listed == available_runs()  # every run module, sorted
    assert {"checkpoint_resume", "comm_bench", "fault", "fsdp_train", "step_time"} <= set(listed)


def test_memory_command_text_and_json(capsys):
    assert main(["memory", "--params", "7e9", "--world-size", "8", "--strategy", "FULL_SHARD",
                 "--precision", "bf16-mixed", "--optimizer", "adamw"]) == 0
    out = capsys.readouterr().out
    assert "params   3,500,000,000" in out  # 4 bytes x 7e9 / 8 ranks
    assert "note: activations not included" in out
    assert main(["memory", "--params", "7e9", "--world-size", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # the peak is the optimizer step on a GPU: 16 bytes of state per parameter, plus foreach
    # AdamW's fp32 temporary of the rank's shard (4 bytes), all divided over 8 ranks
    assert data["components"]["params"] == 4 * 7_000_000_000 // 8 and data["peak"] == 20 * 7_000_000_000 // 8
    assert data["peak_phase"] == "optimizer_step"


def test_comm_command(capsys):
    assert main(["comm", "--params", "8e6", "--world-size", "4", "--strategy", "FULL_SHARD",
                 "--precision", "fp32", "--link", "nvlink4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # two all-gathers and one reduce-scatter of 8e6 fp32 values, each sending 3/4 of the buffer
    assert data["sent_bytes"] == 3 * (3 * 8_000_000 * 4 // 4)
    assert data["counts"] == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 0, "broadcast": 0}
    assert main(["comm", "--model", "70b", "--link", "nvlink4", "--gpu", "h100-80gb", "--tokens", "4096"]) == 0
    assert "compute-bound" in capsys.readouterr().out
    assert main(["comm", "--params", "1e6", "--link", "carrier-pigeon"]) == 2


def test_comm_counts_attention_with_a_sequence_length(capsys):
    """``--seq-len``: compute is 6PT plus 12·L·w·s per token, at the GPU's utilization for the
    model's width (Llama-2 70B: 80 layers, width 8,192; H100: 0.468·d/(d + 386))."""
    base = ["comm", "--model", "70b", "--world-size", "64", "--gpu", "h100-80gb", "--tokens", "4096", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)["compute_s"]
    assert main([*base, "--seq-len", "4096"]) == 0
    with_attention = json.loads(capsys.readouterr().out)["compute_s"]
    p, u = 68_976_648_192, 0.468 * 8192 / (8192 + 386)
    assert plain == pytest.approx(6 * p * 4096 / (989e12 * u))
    assert with_attention == pytest.approx((6 * p + 12 * 80 * 8192 * 4096) * 4096 / (989e12 * u))
    assert main(["comm", "--params", "7e9", "--gpu", "h100-80gb", "--tokens", "4096", "--seq-len", "4096"]) == 2
    assert capsys.readouterr().err.startswith("error: --seq-len needs a model's layers")
    assert main(["comm", "--model", "70b", "--seq-len", "4096"]) == 2
    assert "--seq-len needs them too" in capsys.readouterr().err


def test_plan_command_is_fast_and_explains(capsys):
    import time

    start = time.perf_counter()
    assert main(["plan", "--model", "llama2-13b", "--gpu", "a100-40gb", "--gpus", "8", "--seq-len", "4096"]) == 0
    assert time.perf_counter() - start < 1.0
    out = capsys.readouterr().out
    assert "- Recommended: FULL_SHARD + AC on 8 GPUs" in out and "activations decide" in out
    assert main(["plan", "--model", "llama2-7b", "--gpu", "h100-80gb", "--gpus", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # Compute-bound under both SHARD_GRAD_OP and FULL_SHARD: the tie goes to less communication.
    by_name = {o["name"]: o for o in data["options"]}
    assert by_name["SHARD_GRAD_OP"]["comm_s"] < by_name["FULL_SHARD"]["comm_s"]
    assert data["recommended"]["name"] == "SHARD_GRAD_OP" and len(data["options"]) == 7


def test_planning_commands_do_not_import_torch():
    code = "import sys, handbook_lib.face.cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_run_exits_1_on_a_failed_check_that_is_not_bytes(tmp_path, capsys):
    """Any check outside its tolerance fails the CLI, whatever its unit (here: a count)."""
    code = main(["run", "fault", "--nproc", "1", "--set", "mode=bad_check", "--set", "fail_rank=0",
                 "--out", str(tmp_path), "--quiet"])
    captured = capsys.readouterr()
    assert code == 1
    assert "1 of 1 checks are outside their tolerance" in captured.err
    assert "ranks_counted (rank 0): predicted 2, measured 1.0 ranks" in captured.err
    assert "ranks_counted" in captured.out  # the checks table is printed too
    assert "1 checks: 0 within tolerance, 1 outside (ok = NO)" in captured.out  # with a verdict
    assert (tmp_path / "result.json").exists()  # the result is kept for inspection


HF_CONFIGS = Path(__file__).parent / "data" / "hf_configs"
WIDE_OUTPUTS = [
    ["runs"],
    ["run", "--help"],
    ["memory", "--help"],
    ["plan", "--help"],
    ["params"],
    ["params", "--model", "llama2-70b"],
    ["memory"],
    ["memory", "--model", "13b", "--world-size", "16", "--micro-batch", "1", "--seq-len", "4096",
     "--activation-checkpointing"],
    ["memory", "--model", "13b", "--world-size", "16", "--micro-batch", "1", "--seq-len", "4096",
     "--activation-checkpointing", "selective"],
    ["memory", "--params", "7e9", "--strategy", "HYBRID_SHARD", "--shard-group-size", "4", "--cpu-offload"],
    ["comm", "--model", "70b", "--gpu", "h100-80gb", "--tokens", "4096"],
    ["comm", "--params", "7e9", "--world-size", "16", "--strategy", "HYBRID_SHARD", "--shard-group-size", "8"],
    ["plan", "--model", "gpt3-175b", "--gpu", "h100-80gb", "--gpus", "1"],
    ["plan", "--model", "llama2-70b", "--gpu", "h200-141gb", "--gpus", "16", "--seq-len", "4096"],
    ["plan", "--model", "llama2-13b", "--gpu", "a100-40gb", "--gpus", "8", "--seq-len", "4096"],
    ["params", "--hf-config", str(HF_CONFIGS / "qwen2-0.5b.json")],
    ["memory", "--hf-config", str(HF_CONFIGS / "mistral-nemo-12b.json"), "--micro-batch", "1", "--seq-len", "8192"],
    ["plan", "--hf-config", str(HF_CONFIGS / "llama3-8b.json"), "--gpu", "a100-40gb", "--gpus", "16"],
]


@pytest.mark.parametrize("argv", WIDE_OUTPUTS, ids=lambda a: "-".join(a[:3]))
def test_every_command_fits_100_columns(argv, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps --help to the terminal's width
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.strip()
    widest = max(out.splitlines(), key=len)
    assert len(widest) <= 100, widest


def test_runs_and_run_help_answer_fast_without_torch():
    import time

    code = ("import sys; from handbook_lib.face.cli import main; main(['runs']); main(['run', '--help'])\n"
            "print('torch imported:', 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.rstrip().endswith("torch imported: False")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "handbook_lib", "runs"], capture_output=True, check=True)
    assert time.perf_counter() - start < 1.0


def test_run_help_lists_the_runs_and_the_config_keys(capsys):
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    for name in available_runs():
        assert f"\n  {name} " in out
    for text in ("strategy: NONE | DDP | NO_SHARD", "precision: fp32 | bf16-mixed | fp16-mixed",
                 "api: fsdp2 | fsdp1", "steps=5", "num_layers=6", "variants=DDP,FULL_SHARD,SHARD_GRAD_OP",
                 "min_bytes=4096", "mode: raise | exit | hang | sleep | bad_check | kill_agent | none", "resume=False"):
        assert text in out, text
    # the shared keys by section, each key once
    lines = [line.strip() for line in out.splitlines()]
    assert "model: vocab_size=10000 d_model=256 nhead=4 dim_feedforward=1024 num_layers=6" in lines
    assert "data: batch_size=8 seq_len=64 steps=5 seed=0" in lines
    for section in ("layout: strategy=FULL_SHARD", "numerics: precision=fp32", "levers: activation_checkpointing=none"):
        assert any(line.startswith(section) for line in lines), section


def test_a_key_is_set_by_its_section_s_name_too(tmp_path):
    """--set data.steps=3 is --set steps=3; a key under the wrong section is refused by name."""
    from handbook_lib.launch.preflight import check_run_config

    assert check_run_config("fsdp_train", {"data.steps": "3", "model.num_layers": "2"}, 2).to_dict() == \
        check_run_config("fsdp_train", {"steps": "3", "num_layers": "2"}, 2).to_dict()
    with pytest.raises(ValueError, match="unknown config key.*'data.lr'"):
        check_run_config("fsdp_train", {"data.lr": "0.1"}, 2)


def test_params_of_a_preset(capsys):
    assert main(["params", "--model", "llama2-7b"]) == 0
    out = capsys.readouterr().out
    assert "model: Llama-2 7B, 6,738,415,616 parameters" in out
    assert "total  6,738,415,616" in out and "layers  6,476,267,520" in out
    from handbook_lib.models import DECODER_SHAPES

    for shape in DECODER_SHAPES.values():  # the breakdown adds up, for tied and untied heads alike
        assert sum(shape.param_breakdown().values()) == shape.num_params


def test_planning_commands_name_the_model_and_their_assumptions(capsys):
    assert main(["memory"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: the handbook's model, 9,868,560 parameters")
    assert "assumes: FULL_SHARD on 8 ranks, bf16-mixed, optimizer adamw; no activations" in out
    assert "(runs default to fp32: add --precision fp32" in out
    assert "peak = the step's largest phase; root_reduce = end of backward" in out
    assert main(["comm", "--model", "13b", "--world-size", "16", "--strategy", "HYBRID_SHARD",
                 "--shard-group-size", "8", "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: Llama-2 13B, 13,015,864,320 parameters (--model 13b)")
    assert "assumes: HYBRID_SHARD on 16 ranks (shard groups of 8), fp32, optimizer any" in out
    assert main(["plan", "--model", "llama2-7b", "--gpu", "h100-80gb", "--gpus", "8"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # lines are wrapped at 100 columns
    assert "assumes: 8 x NVIDIA H100 SXM 80GB (8 per node" in out and "optimizer adamw" in out
    assert "AC = activation checkpointing" in out


def test_plan_names_the_host_memory_offload_needs(capsys):
    from handbook_lib.models import estimate_memory, get_shape

    assert main(["plan", "--model", "gpt3-175b", "--gpu", "h100-80gb", "--gpus", "16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    chosen = data["recommended"]
    assert chosen["cpu_offload"] and chosen["gpus"] == 16
    host = estimate_memory(get_shape("gpt3-175b"), 16, "FULL_SHARD", "bf16-mixed", micro_batch=1, seq_len=2048,
                           activation_checkpointing=True, cpu_offload=True).host
    assert chosen["host_bytes"] == host == 16 * 174_604_259_328 // 16  # fp32 params, grads, Adam's 2 states
    assert chosen["host_node_bytes"] == 8 * host
    assert any(r.startswith(f"CPU offload needs {host / 1e9:.1f} GB of host RAM per GPU") for r in data["reasons"])
    assert main(["plan", "--model", "gpt3-175b", "--gpu", "h100-80gb", "--gpus", "1"]) == 0
    out = capsys.readouterr().out  # one GPU: 2.79 TB of host RAM, more than the node's 2 TiB
    assert "host/GPU" in out and "2.79 TB" in out and "host RAM" in out
    assert "not the host: 2793.7 GB of host RAM per node against 2199.0 GB" in " ".join(out.split())


def test_plan_sensitivity_shows_what_flips(capsys):
    args = ["plan", "--model", "gpt3-175b", "--gpu", "a100-80gb", "--gpus", "64", "--seq-len", "4096"]
    assert main([*args, "--sensitivity"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    rows = {line.split()[0] + " " + line.split()[3]: line for line in out.splitlines()
            if line.strip().startswith(("headroom", "capacity"))}
    assert "FLIPS" in rows["headroom 10"] and "FULL_SHARD + AC + offload" in rows["headroom 10"]
    assert "FLIPS" in rows["capacity 80"]
    # 79.25 GiB CUDA reports, less a training context and NCCL's ring over 8 nodes (16 channels of 20 MiB)
    usable = round(79.25 * 2**30) - 1_457_521_152 - 16 * 20 * 2**20
    reserved = next(o for o in plan("gpt3-175b", "a100-80gb", 64, seq_len=4096).options
                    if o.name == "FULL_SHARD + AC").peak_reserved_bytes
    left = 1 - reserved / usable  # 2.3 %
    assert f"where FULL_SHARD + AC flips: it fits up to {100 * left:.1f} % headroom" in out
    assert main([*args, "--sensitivity", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["assumption"] for r in data["sensitivity"]} >= {"headroom", "capacity", "allocator reserve",
                                                               "utilization", "network ports"}
    assert 0.02 < data["flip_points"]["headroom"] < 0.04


def test_memory_json_gives_the_reserved_peak(capsys):
    assert main(["memory", "--model", "7b", "--world-size", "8", "--precision", "bf16-mixed", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    two_mib = 2 * 2**20
    assert data["peak_reserved"] == -(-round(data["peak"] * 1.1) // two_mib) * two_mib
    assert data["reserve"]["fraction"] == 0.1 and "pytorch/pytorch#89457" in data["reserve"]["source"]


def test_memory_with_gradient_accumulation_holds_the_unsharded_gradients(capsys):
    """``--grad-accum K``: FULL_SHARD holds every parameter's fp32 gradient between micro-steps
    (4 bytes a parameter, the whole model, whatever the ranks); ``--sync-every-micro-step``
    reduces them each time, and memory is one micro-step's."""
    base = ["memory", "--model", "7b", "--world-size", "8", "--json"]
    runs = {}
    for extra in ([], ["--grad-accum", "4"], ["--grad-accum", "4", "--sync-every-micro-step"]):
        assert main([*base, *extra]) == 0
        runs[" ".join(extra)] = data = json.loads(capsys.readouterr().out)
        if extra:
            assert "4 micro-steps a step" in data["assumptions"]
    plain, held, synced = runs[""], runs["--grad-accum 4"], runs["--grad-accum 4 --sync-every-micro-step"]
    assert synced["phases"] == plain["phases"]
    # at the start of backward every parameter's fp32 gradient from the earlier micro-steps is held
    extra = held["phases"]["backward_start"] - plain["phases"]["backward_start"]
    assert extra == 4 * 6_738_415_616 == estimate_accumulation_bytes("7b", "FULL_SHARD", "bf16-mixed")
    assert held["peak"] > plain["peak"] and held["peak_phase"] == "layer_backward"
    assert main([*base, "--sync-every-micro-step"]) == 2
    assert capsys.readouterr().err.startswith("error: --sync-every-micro-step needs --grad-accum >= 2, got 1")
    assert main([*base, "--grad-accum", "0"]) == 2
    assert "--grad-accum" in capsys.readouterr().err


def test_memory_prices_the_optimizer_step_of_each_implementation(capsys):
    """``--optimizer-impl``: on a GPU torch's default is foreach, whose step holds one fp32 copy
    of every local parameter (4·P/N: 7B on 8 FULL_SHARD ranks, the handbook counts P/N rounded
    up); fused holds none, so the step's phase is gone; the assumptions say which was asked."""
    base = ["memory", "--params", "7e9", "--world-size", "8", "--json"]
    seen = {}
    for impl in ("default", "foreach", "fused"):
        assert main([*base, "--optimizer-impl", impl]) == 0
        seen[impl] = json.loads(capsys.readouterr().out)
    assert seen["default"]["phases"] == seen["foreach"]["phases"]
    assert seen["foreach"]["phases"]["optimizer_step"] == 16 * 7_000_000_000 // 8 + 4 * 7_000_000_000 // 8
    assert "optimizer_step" not in seen["fused"]["phases"]
    assert seen["fused"]["peak"] == 16 * 7_000_000_000 // 8
    assert "optimizer adamw (fused)" in seen["fused"]["assumptions"]
    assert "(default)" not in seen["default"]["assumptions"]


def test_bad_inputs_get_one_line_naming_the_flag(capsys):
    """A sample (the full table is tests/test_bad_inputs.py): the flag the user typed, not a key."""
    assert main(["memory", "--params", "inf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: argument --params: must be a whole number of parameters from 1 to 1e15 (e.g. 7e9)")
    assert main(["plan", "--model", "7b", "--gpu", "h100-80gb", "--gpus", "16", "--gpus-per-node", "3"]) == 2
    assert capsys.readouterr().err.startswith(
        "error: --gpus 16 is not a whole number of nodes of --gpus-per-node 3")
    assert main(["memory", "--shard-group-size", "3", "--strategy", "FULL_SHARD", "--world-size", "6"]) == 2
    assert "--shard-group-size applies to the HYBRID strategies" in capsys.readouterr().err
    assert main(["memory", "--params", "7e9", "--micro-batch", "1", "--seq-len", "4096"]) == 2
    assert "--params is only a count: use --model" in capsys.readouterr().err


def test_ctrl_c_during_a_run_is_one_line(monkeypatch, capsys):
    import handbook_lib.face.commands as commands
    from handbook_lib.face import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "torchrun", interrupted)
    assert main(["run", "fault", "--quiet"]) == 130
    assert capsys.readouterr().err == "error: run 'fault' interrupted; torchrun and its ranks were stopped\n"


@pytest.mark.parametrize("argv,fragment", [
    (["--nodes", "0", "--gpus-per-node", "4"], "argument --nodes: must be a whole number >= 1, got 0"),
    (["--nodes", "2", "--gpus-per-node", "0"], "argument --gpus-per-node: must be a whole number >= 1, got 0"),
    (["--nodes", "2", "--gpus-per-node", "4", "--time", "30min"], "--time expects HH:MM:SS or D-HH:MM:SS"),
    (["--nodes", "2", "--gpus-per-node", "4", "--set", "stepz=3"], "--set: unknown config key(s) 'stepz'"),
    (["--nodes", "3", "--gpus-per-node", "1"], "--nodes 3 x --gpus-per-node 1 = 3 ranks: batch_size=8"),
    (["--nodes", "2", "--gpus-per-node", "4", "--overwrite"], "--overwrite applies to --output FILE"),
])
def test_slurm_bad_input_exits_2_with_one_line(argv, fragment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["slurm", "fsdp_train", *argv]) == 2
    captured = capsys.readouterr()
    first, *rest = captured.err.splitlines()
    assert first.startswith("error: ") and fragment in first and captured.out == ""
    # one message: argparse's adds where to read more; a long one is wrapped, its lines indented
    assert rest == ["(see: python -m handbook_lib slurm --help)"] or all(line.startswith("  ") for line in rest)
    assert list(tmp_path.iterdir()) == []  # nothing written
    assert main(["slurm", "nope", "--nodes", "1", "--gpus-per-node", "1"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown run 'nope'; available runs: ")


def test_slurm_prints_or_writes_the_script_and_keeps_foreign_files(tmp_path, capsys):
    argv = ["slurm", "fsdp_train", "--nodes", "2", "--gpus-per-node", "4", "--set", "steps=20"]
    assert main(argv) == 0
    script = capsys.readouterr().out
    assert script.startswith("#!/bin/bash\n# Written by `python -m handbook_lib slurm`")
    assert "#SBATCH --nodes=2\n" in script and "--nproc-per-node 4 \\\n" in script and '"steps": 20,' in script
    target = tmp_path / "job.sbatch"
    assert main([*argv, "--output", str(target)]) == 0
    assert target.read_text() == script
    assert f"wrote {target}: fsdp_train on 2 x 4 GPUs = 8 ranks" in capsys.readouterr().out
    assert main([*argv, "--nodes", "1", "--output", str(target)]) == 2  # its own, but no --overwrite
    assert "add --overwrite" in capsys.readouterr().err and target.read_text() == script
    assert main([*argv, "--nodes", "1", "--output", str(target), "--overwrite"]) == 0
    assert "#SBATCH --nodes=1\n" in target.read_text()
    foreign = tmp_path / "train.sh"
    foreign.write_text("#!/bin/bash\nsrun my_own_job\n")
    assert main([*argv, "--output", str(foreign), "--overwrite"]) == 2
    assert "was not written by this tool" in capsys.readouterr().err
    assert foreign.read_text() == "#!/bin/bash\nsrun my_own_job\n"


def test_run_passes_the_node_flags_to_the_launcher(monkeypatch, capsys):
    # The 2-node launch itself runs for real in tests/test_launch_multinode.py; here, the flags.
    import handbook_lib.face.commands as commands
    from handbook_lib.face import main

    seen = {}

    def fake_torchrun(run, nproc, config, **kwargs):
        seen.update(run=run, nproc=nproc, **kwargs)
        return None  # what a node other than rank 0's gets back

    monkeypatch.setattr(commands, "torchrun", fake_torchrun)
    assert main(["run", "fault", "--nnodes", "3", "--nproc", "4", "--node-rank", "2",
                 "--rdzv-endpoint", "10.0.0.1:29500"]) == 0
    assert (seen["run"], seen["nproc"], seen["nnodes"], seen["node_rank"], seen["rdzv_endpoint"]) == \
        ("fault", 4, 3, 2, "10.0.0.1:29500")
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 100
    assert ("node 2: its ranks finished; rank 0 ran on another node (torchrun's rendezvous numbers the "
            "nodes), whose --out folder holds result.json") in " ".join(out.split())


def test_run_refuses_a_node_rank_without_its_rendezvous(capsys):
    assert main(["run", "fault", "--nnodes", "2", "--node-rank", "1"]) == 2
    err = capsys.readouterr().err
    assert "rdzv_endpoint must be 'host:port'" in err and len(err.strip().splitlines()) == 1


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    # `python -m handbook_lib plan ... | head -1`: no traceback, the shell's status for SIGPIPE
    proc = subprocess.Popen([sys.executable, "-m", "handbook_lib", "plan", "--model", "llama2-70b",
                             "--gpu", "h100-80gb", "--gpus", "32"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the command has printed anything: every print meets a closed pipe
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and "Traceback" not in err and err == ""


# --- numbers, resources and the poor list ---------------------------------------------------------

def test_a_flag_of_another_command_points_at_this_commands_help(capsys):
    assert main(["memory", "--link", "nvlink4"]) == 2  # comm's
    assert capsys.readouterr().err == ("error: unrecognized arguments: --link nvlink4\n"
                                       "(see: python -m handbook_lib memory --help)\n")


def test_sp_method_without_the_split_is_refused(capsys):
    plan = ["plan", "--model", "llama2-7b", "--gpu", "h100-80gb", "--gpus", "8"]
    assert main([*plan, "--sp-method", "ring"]) == 2
    assert capsys.readouterr().err == ("error: --sp-method ring applies to the sequence split: give --sp-size N "
                                       "(N >= 2) too, or leave\n  --sp-method out\n")
    assert main([*plan, "--sp-method", "ring", "--sp-size", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["axes"]["options"]


@pytest.mark.parametrize("argv, line", [
    (["run", "fault", "--nproc", "3.0"], "error: argument --nproc: must be a whole number >= 1, got '3.0'"),
    (["run", "fault", "--timeout", "1e-3x"], "error: argument --timeout: must be a finite number > 0, got '1e-3x' "
                                             "(seconds)"),
    (["run", "fault", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:99999"],
     "error: argument --rdzv-endpoint: must be HOST:PORT with a TCP port from 1 to 65535, got '127.0.0.1:99999'"),
    (["memory", "--world-size", ""], "error: argument --world-size: must be a whole number >= 1, got ''"),
    (["plan", "--model", "7b", "--gpu", "h100-80gb", "--gpus", "8", "--headroom", "x"],
     "error: argument --headroom: must be a number in [0, 1), got 'x' (a fraction, e.g. 0.1)"),
    (["run", "fault", "--set", "sleep_s=1e-3x"], "error: --set sleep_s=1e-3x: sleep_s takes a finite number"),
    (["run", "fault", "--set", "mode=none", "--set", "mode=raise"],
     "error: --set mode given twice (mode=none, mode=raise): give each key once"),
])
def test_every_number_is_refused_with_its_range_in_one_line(argv, line, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines()[0] == line


def test_a_run_larger_than_the_machine_is_refused_unless_forced(monkeypatch, capsys):
    import os

    import handbook_lib.launch.runner as runner

    started = []  # torchrun's checks run (once, in torchrun itself); nothing is started
    monkeypatch.setattr(runner, "_launch", lambda run, nproc, *args: started.append(nproc))
    too_many = 8 * len(os.sched_getaffinity(0)) + 1
    assert main(["run", "fault", "--quiet", "--nproc", str(too_many)]) == 2
    assert f"{too_many} ranks on this machine's" in capsys.readouterr().err and started == []
    assert main(["run", "comm_bench", "--quiet", "--set", "max_bytes=1000000000000000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the run needs ") and "--force-resources" in err and started == []
    assert main(["run", "fault", "--quiet", "--nproc", str(too_many), "--force-resources"]) == 0
    assert started == [too_many]


def test_an_escape_in_a_name_is_shown_not_obeyed(capsys):
    assert main(["run", "fsdp\n\x1b[2Jtrain"]) == 2
    assert main(["params", "--hf-config", "my\x1b[31mmodel\r.json"]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\r" not in err
    assert "'fsdp\\n\\x1b[2Jtrain'" in err and "my\\x1b[31mmodel\\r.json" in err


PURE = "import sys; sys.modules['psutil'] = None; sys.modules['torch'] = None; from handbook_lib.face import main; "


@pytest.mark.parametrize("argv", [["params", "--model", "llama2-7b"], ["runs"],
                                  ["plan", "--model", "llama2-7b", "--gpu", "h100-80gb", "--gpus", "8"],
                                  ["memory", "--model", "7b"], ["comm", "--model", "7b"]])
def test_the_pure_commands_need_neither_psutil_nor_torch(argv):
    done = subprocess.run([sys.executable, "-c", PURE + f"raise SystemExit(main({argv!r}))"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-500:]
    assert "Traceback" not in done.stderr


def test_plan_prices_accumulation_and_says_so(capsys):
    """``plan --grad-accum 4``: four micro-batches of compute a step, said in the assumptions;
    the JSON's compute is four times one micro-step's for every option."""
    base = ["plan", "--model", "llama2-7b", "--gpu", "h100-80gb", "--gpus", "8"]
    assert main([*base, "--grad-accum", "4"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "micro-batch 1 x 2048 tokens, 4 micro-steps a step, gradients reduced in the last" in text
    runs = []
    for extra in ([], ["--grad-accum", "4", "--sync-every-micro-step"]):
        assert main([*base, *extra, "--json"]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    for one, four in zip(runs[0]["options"], runs[1]["options"]):
        assert four["compute_s"] == pytest.approx(4 * one["compute_s"], rel=1e-12)


def test_memory_prices_deepspeeds_zero_stages_beside_deepspeeds_own_estimate(capsys):
    """``memory --strategy ZERO2``: DeepSpeed's layout as chapter 7 measures it (16-bit parameters
    whole, the fp32 master partition, the 16-bit gradients of the partition, Adam's moments), plus
    the fp32 gradient partition its step makes; DeepSpeed's own ``2P + 18P/N`` beside it."""
    p, n = 6_738_415_616, 8
    assert main(["memory", "--model", "llama2-7b", "--strategy", "ZERO2", "--world-size", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    part = p // n  # 6,738,415,616 is a multiple of 16: no padding
    assert data["parts"] == {"params": 2 * p, "master": 4 * part, "grads": 2 * part, "optimizer": 8 * part,
                             "optimizer_step": 4}
    # the step: the 16-bit gradients (2), flattened in 16 bits (2) and cast to fp32 (4) at once,
    # as the CPU runs measure it; DeepSpeed's own 18 bytes over N count the fp32 copy only
    assert data["step_bytes"] == (2 + 2 + 4) * part
    assert data["at_step"] - 4 - 4 * part == data["deepspeed_estimate"] == 2 * p + 18 * p // n
    assert main(["memory", "--model", "llama2-7b", "--strategy", "ZERO3", "--world-size", "8"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "at the optimizer step 16,846,039,044" in text and "15.69 GB" in text


def test_memory_of_a_zero_stage_with_a_micro_batch_prices_each_moment_of_the_step(capsys):
    """``--micro-batch``: the ZeRO-2 moments of Llama-2 7B on 8 GPUs, the gradient bucket as the
    flag sizes it (Accelerate's auto: hidden squared), and ZeRO-3's bucket held at rest."""
    base = ["memory", "--model", "llama2-7b", "--world-size", "8", "--micro-batch", "1", "--seq-len", "4096",
            "--json"]
    assert main([*base, "--strategy", "ZERO2", "--reduce-bucket-size", str(4096**2)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["phases"]) == {"forward_backward", "gradient_buckets", "optimizer_step"}
    assert data["buckets"] == 2 * 4096**2
    at_rest = sum(data["parts"].values()) - data["parts"]["grads"]  # freed after each step
    assert data["phases"]["gradient_buckets"] - at_rest == 2 * 4096**2 + (2 + 4) * 4096**2
    assert data["peak"] == max(data["phases"].values()) and data["peak_reserved"] > data["peak"]
    assert main([*base, "--strategy", "ZERO3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["buckets"] == 4 * 500_000_000 and "gradient_buckets" not in data["phases"]
    assert main([*base, "--strategy", "ZERO3", "--cpu-offload"]) == 2
    assert "--cpu-offload with --strategy ZERO3 and --micro-batch" in capsys.readouterr().err
    assert main([*base, "--reduce-bucket-size", "100"]) == 2
    assert "--reduce-bucket-size 100 sizes DeepSpeed's gradient buckets" in capsys.readouterr().err


def test_plan_prices_one_strategy_deepspeeds_stages_among_them(capsys):
    """``plan --strategy ZERO3``: ZeRO-3 with and without checkpointing, nothing else; too few GPUs
    and the fewest that fit are ZeRO-3's own."""
    base = ["plan", "--model", "llama2-70b", "--gpu", "h100-80gb", "--seq-len", "4096"]
    assert main([*base, "--gpus", "16", "--strategy", "ZERO3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = [o["name"] for o in data["options"]]
    assert names[:2] == ["ZERO3", "ZERO3 + AC"] and all(name.startswith("ZERO3") for name in names)
    assert data["recommended"]["name"] == "ZERO3 + AC on 32 GPUs"
    assert main([*base, "--gpus", "32", "--strategy", "ZERO2"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "ZERO2 alone priced, DeepSpeed's defaults (gradient buckets of 5e8 elements)" in text
    assert main([*base, "--gpus", "32", "--strategy", "ZERO3", "--tp-size", "2"]) == 2
    assert "--strategy ZERO3 prices one strategy alone" in capsys.readouterr().err


def test_memory_checkpoints_every_kth_layer(capsys):
    """``--ac-every 2``: half of Llama-2 7B's 32 layers keep everything they save instead of their
    2·s·b·h input. Per token, in bf16: two RMSNorms of 16·h (fp32 input, 1/RMS, two bf16 copies),
    Q, K, V and the output of 2·4h, the SwiGLU's four 2·11,008, the fp32 log-sum-exp of 32 heads."""
    base = ["memory", "--model", "llama2-7b", "--micro-batch", "1", "--seq-len", "2048",
            "--activation-checkpointing", "full", "--json"]
    runs = []
    for extra in ([], ["--ac-every", "2"]):
        assert main([*base, *extra]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert "layers 0, 2, 4, ..." in runs[1]["assumptions"]
    every, all_ = (r["phases"]["loss_backward"] for r in (runs[1], runs[0]))
    h, f = 4096, 11_008
    assert every - all_ == 16 * 2048 * (16 * h + 8 + 2 * 4 * h + 4 * 32 + 2 * 4 * f - 2 * h)


def test_memory_keeps_the_products_or_the_attention(capsys):
    """``--ac-save``: keeping the products only drops the attention's output and fp32 log-sum-exp
    from every layer, ``T·h·2 + 4·a·T``; keeping the attention only drops Q, K, V, O, gate, up and
    down, ``T·(4h + 2f + h)·2`` (Llama-2 7B: h 4,096, f 11,008, 32 heads, 32 layers)."""
    base = ["memory", "--model", "llama2-7b", "--micro-batch", "1", "--seq-len", "2048",
            "--activation-checkpointing", "selective", "--json"]
    runs = {}
    for save in ("matmul+attention", "matmul", "attention"):
        assert main([*base, "--ac-save", save]) == 0
        runs[save] = json.loads(capsys.readouterr().out)["phases"]["loss_backward"]
    t, h, f = 2048, 4096, 11_008
    assert runs["matmul+attention"] - runs["matmul"] == 32 * (t * h * 2 + 4 * 32 * t)
    assert runs["matmul+attention"] - runs["attention"] == 32 * t * (5 * h + 2 * f) * 2


def test_memory_keeps_every_second_matrix_product(capsys):
    """``--ac-matmul-every 2`` on Llama-2 7B: of Q, K, V, O, gate, up and down, K, O and up are
    recomputed instead of kept: (4,096 + 4,096 + 11,008) x 2 bytes a token, in 32 layers."""
    base = ["memory", "--model", "llama2-7b", "--micro-batch", "1", "--seq-len", "2048",
            "--activation-checkpointing", "selective", "--json"]
    runs = []
    for extra in ([], ["--ac-matmul-every", "2"]):
        assert main([*base, *extra]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert "one matrix product in 2 kept" in runs[1]["assumptions"]
    dropped = runs[0]["phases"]["loss_backward"] - runs[1]["phases"]["loss_backward"]  # every layer's saved
    assert dropped == 32 * 2048 * (4096 + 4096 + 11_008) * 2
