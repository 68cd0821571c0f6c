"""handbook_lib.launch.slurm: the sbatch script for a multi-node run.

The script is read as text (its #SBATCH lines), checked by ``bash -n``, and run by bash with
stand-ins for ``scontrol``, ``srun`` and ``python`` (no Slurm here, nor in CI), so the test
sees the exact argv torchrun would get on each node after the shell has expanded it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from handbook_lib.launch import (
    MARKER,
    SHEBANG,
    SlurmJob,
    build_job,
    is_own_script,
    parse_time,
    render_sbatch,
    write_script,
)

BASH = shutil.which("bash")
SBATCH = shutil.which("sbatch")
needs_bash = pytest.mark.skipif(BASH is None, reason="bash is not installed")

# The variables Slurm documents as set in a batch script's environment: the "OUTPUT ENVIRONMENT
# VARIABLES" section of the sbatch(1) man page (Slurm 22.05, Debian's slurm-client; the same
# names at https://slurm.schedmd.com/sbatch.html#SECTION_OUTPUT-ENVIRONMENT-VARIABLES).
# SLURM_*_HET_GROUP_# (heterogeneous jobs) is left out.
SBATCH_OUTPUT_ENV = frozenset("""
SLURM_ARRAY_JOB_ID SLURM_ARRAY_TASK_COUNT SLURM_ARRAY_TASK_ID SLURM_ARRAY_TASK_MAX SLURM_ARRAY_TASK_MIN
SLURM_ARRAY_TASK_STEP SLURM_CLUSTER_NAME SLURM_CPUS_ON_NODE SLURM_CPUS_PER_GPU SLURM_CPUS_PER_TASK
SLURM_CONTAINER SLURM_DIST_PLANESIZE SLURM_DISTRIBUTION SLURM_EXPORT_ENV SLURM_GPU_BIND SLURM_GPU_FREQ
SLURM_GPUS SLURM_GPUS_ON_NODE SLURM_GPUS_PER_NODE SLURM_GPUS_PER_SOCKET SLURM_GPUS_PER_TASK SLURM_GTIDS
SLURM_HET_SIZE SLURM_JOB_ACCOUNT SLURM_JOB_GPUS SLURM_JOB_ID SLURM_JOB_CPUS_PER_NODE SLURM_JOB_DEPENDENCY
SLURM_JOB_NAME SLURM_JOB_NODELIST SLURM_JOB_NUM_NODES SLURM_JOB_PARTITION SLURM_JOB_QOS
SLURM_JOB_RESERVATION SLURM_JOBID SLURM_LOCALID SLURM_MEM_PER_CPU SLURM_MEM_PER_GPU SLURM_MEM_PER_NODE
SLURM_NNODES SLURM_NODE_ALIASES SLURM_NODEID SLURM_NODELIST SLURM_NPROCS SLURM_NTASKS
SLURM_NTASKS_PER_CORE SLURM_NTASKS_PER_GPU SLURM_NTASKS_PER_NODE SLURM_NTASKS_PER_SOCKET
SLURM_OVERCOMMIT SLURM_PRIO_PROCESS SLURM_PROCID SLURM_PROFILE SLURM_RESTART_COUNT SLURM_SHARDS_ON_NODE
SLURM_SUBMIT_DIR SLURM_SUBMIT_HOST SLURM_TASK_PID SLURM_TASKS_PER_NODE SLURM_THREADS_PER_CORE
SLURM_TOPOLOGY_ADDR SLURM_TOPOLOGY_ADDR_PATTERN SLURMD_NODENAME
""".split())
# And those srun(1) documents for each task it starts (same man page section, srun's): the names a
# script may read inside a task, e.g. in ``srun bash -c '... $SLURM_NODEID ...'``.
SRUN_OUTPUT_ENV = frozenset("""
SLURM_CLUSTER_NAME SLURM_CPU_BIND_LIST SLURM_CPU_BIND_TYPE SLURM_CPU_BIND_VERBOSE SLURM_CPU_FREQ_REQ
SLURM_CPUS_ON_NODE SLURM_CPUS_PER_TASK SLURM_DISTRIBUTION SLURM_GPUS_ON_NODE SLURM_GTIDS SLURM_HET_SIZE
SLURM_JOB_ACCOUNT SLURM_JOB_CPUS_PER_NODE SLURM_JOB_DEPENDENCY SLURM_JOB_GPUS SLURM_JOB_ID SLURM_JOB_NAME
SLURM_JOB_NODELIST SLURM_JOB_NODES SLURM_JOB_PARTITION SLURM_JOB_QOS SLURM_JOB_RESERVATION SLURM_JOBID
SLURM_LAUNCH_NODE_IPADDR SLURM_LOCALID SLURM_MEM_BIND_LIST SLURM_MEM_BIND_PREFER SLURM_MEM_BIND_SORT
SLURM_MEM_BIND_TYPE SLURM_MEM_BIND_VERBOSE SLURM_NODE_ALIASES SLURM_NODEID SLURM_NPROCS SLURM_NTASKS
SLURM_OVERCOMMIT SLURM_PRIO_PROCESS SLURM_PROCID SLURM_SRUN_COMM_HOST SLURM_SRUN_COMM_PORT SLURM_CONTAINER
SLURM_SHARDS_ON_NODE SLURM_STEP_GPUS SLURM_STEP_ID SLURM_STEP_LAUNCHER_PORT SLURM_STEP_NODELIST
SLURM_STEP_NUM_NODES SLURM_STEP_NUM_TASKS SLURM_STEP_TASKS_PER_NODE SLURM_STEPID SLURM_SUBMIT_DIR
SLURM_SUBMIT_HOST SLURM_TASK_PID SLURM_TASKS_PER_NODE SLURM_TOPOLOGY_ADDR SLURM_TOPOLOGY_ADDR_PATTERN
SLURM_UMASK SLURMD_NODENAME
""".split())

# (nodes, GPUs per node, the global batch: fsdp_train needs it divisible by the ranks)
SHAPES = [(1, 1, 8), (2, 4, 8), (16, 8, 128)]


@pytest.fixture(scope="module")
def jobs() -> dict[int, SlurmJob]:
    """One validated fsdp_train job per shape, keyed by its node count (imports torch once)."""
    return {n: build_job("fsdp_train", n, g, {"steps": "3", "batch_size": str(b)}) for n, g, b in SHAPES}


def sbatch_options(script: str) -> dict[str, str]:
    """The script's ``#SBATCH --key=value`` lines as a dict."""
    pairs = [line.removeprefix("#SBATCH --").split("=", 1) for line in script.splitlines()
             if line.startswith("#SBATCH") and "=" in line]
    return dict(pairs)


def fake_cluster(tmp_path: Path, nodes: int) -> dict[str, str]:
    """Environment for running a script under bash as if sbatch had started it: stand-ins for
    scontrol (prints ``nodes`` host names, one write each, as scontrol does past its buffer:
    a reader that stops early makes it fail, as it would on a large job), srun (runs its command once per node with that node's
    SLURM_NODEID/SLURM_PROCID, logging its own options) and python (logs its argv per node)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    stubs = {
        "scontrol": (f'echo "$*" > "{log}/scontrol"\n'
                     f'for i in $(seq 1 {nodes}); do printf "gpu%03d\\n" "$i"; [ "$i" != 1 ] || sleep 0.1; done'),
        "srun": (f'opts=(); while [[ "$1" == -* ]]; do opts+=("$1"); shift; done\n'
                 f'printf "%s\\n" "${{opts[@]}}" > "{log}/srun"\n'
                 f'for ((i = 0; i < {nodes}; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" || exit; done'),
        "python": f'printf "%s\\n" "$@" > "{log}/node$SLURM_NODEID.argv"',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\nset -euo pipefail\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": f"gpu[001-{nodes:03d}]", "SLURM_NNODES": str(nodes), "SLURM_NODEID": "0",
            "HOME": str(tmp_path)}


@pytest.mark.parametrize("nodes,gpus,batch", SHAPES)
def test_sbatch_lines_request_one_task_per_node(jobs, nodes, gpus, batch):
    script = render_sbatch(jobs[nodes])
    assert script.startswith(f"{SHEBANG}\n{MARKER}\n")
    assert sbatch_options(script) == {
        "job-name": "handbook-fsdp_train", "nodes": str(nodes), "ntasks-per-node": "1",
        "gpus-per-node": str(gpus), "cpus-per-task": str(4 * gpus), "mem": "0", "time": "00:30:00",
        "output": "%x-%j.out",
    }
    assert "#SBATCH --exclusive" in script.splitlines()  # whole nodes (a flag without a value)
    # sbatch reads #SBATCH lines only before the first command: all of them come before `set`
    lines = script.splitlines()
    assert max(i for i, line in enumerate(lines) if line.startswith("#SBATCH")) < lines.index("set -euo pipefail")
    assert f"{nodes * gpus} ranks" in script
    assert all(len(line) <= 86 for line in lines)  # the book's column: chapter 8 prints it


def test_partition_account_and_names_when_given():
    job = SlurmJob("fault", 2, 8, time="1-12:00:00", partition="gpu,gpu-long", account="proj_42",
                   job_name="try.1", log="logs/%x-%j.out", cpus_per_task=96, port=29601)
    options = sbatch_options(render_sbatch(job))
    assert {k: options[k] for k in ("partition", "account", "job-name", "time", "output", "cpus-per-task")} == {
        "partition": "gpu,gpu-long", "account": "proj_42", "job-name": "try.1", "time": "1-12:00:00",
        "output": "logs/%x-%j.out", "cpus-per-task": "96"}
    assert "MASTER_PORT=29601\n" in render_sbatch(job)


@needs_bash
@pytest.mark.parametrize("nodes,gpus,batch", SHAPES)
def test_bash_accepts_the_script(jobs, tmp_path, nodes, gpus, batch):
    path = tmp_path / "job.sbatch"
    path.write_text(render_sbatch(jobs[nodes]))
    done = subprocess.run([BASH, "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@needs_bash
@pytest.mark.parametrize("nodes,gpus,batch", SHAPES)
def test_each_node_starts_torchrun_with_the_job_shape(jobs, tmp_path, nodes, gpus, batch):
    out = "my runs/it's $HOME"  # a space, a quote and a dollar: all must reach torchrun as written
    job = dataclasses.replace(jobs[nodes], out_dir=out)
    (tmp_path / "job.sbatch").write_text(render_sbatch(job))
    env = fake_cluster(tmp_path, nodes)
    done = subprocess.run([BASH, "job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    log = tmp_path / "log"
    assert (log / "scontrol").read_text().split() == ["show", "hostnames", f"gpu[001-{nodes:03d}]"]
    assert (log / "srun").read_text().split() == ["--ntasks-per-node=1", f"--cpus-per-task={4 * gpus}",
                                                  "--label", "--kill-on-bad-exit=1"]
    expected = ["-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(gpus),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"gpu001:{29500 + 4242 % 1000}",
                "--rdzv-id", "4242", "--max-restarts", "0", "--tee", "3", "--log-dir", f"{out}/logs",
                "-m", "handbook_lib.runs.fsdp_train",
                "--config", f"{out}/config.json", "--out", out]
    for node in range(nodes):
        assert (log / f"node{node}.argv").read_text().splitlines() == expected
    assert sorted(p.name for p in log.glob("node*.argv")) == sorted(f"node{i}.argv" for i in range(nodes))
    config = json.loads((tmp_path / out / "config.json").read_text())
    assert config == job.config and config["steps"] == 3 and config["batch_size"] == batch
    assert f"result: {out}/result.json" in done.stdout


@needs_bash
def test_default_out_dir_is_per_job_and_a_kept_result_is_refused(tmp_path):
    script = render_sbatch(SlurmJob("fault", 2, 1))
    (tmp_path / "job.sbatch").write_text(script)
    env = fake_cluster(tmp_path, 2)
    done = subprocess.run([BASH, "job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "log" / "node1.argv").read_text().splitlines()[-1] == "runs/fault-4242"
    assert json.loads((tmp_path / "runs/fault-4242/config.json").read_text()) == {}  # the run's defaults
    (tmp_path / "runs/fault-4242/result.json").write_text("{}")
    (tmp_path / "log" / "srun").unlink()
    again = subprocess.run([BASH, "job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "already holds a result.json" in again.stderr
    assert not (tmp_path / "log" / "srun").exists()  # refused before srun


@needs_bash
def test_outside_slurm_the_script_stops_with_a_message(tmp_path):
    (tmp_path / "job.sbatch").write_text(render_sbatch(SlurmJob("fault", 1, 1)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run([BASH, "job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "run this script with sbatch, not bash" in done.stderr
    assert list(tmp_path.iterdir()) == [tmp_path / "job.sbatch"]


@pytest.mark.skipif(SBATCH is None, reason="Slurm's sbatch is not installed (CI has no Slurm)")
@pytest.mark.parametrize("nodes,gpus,batch", SHAPES)
def test_sbatch_parses_every_option(jobs, tmp_path, nodes, gpus, batch):
    """sbatch reads the #SBATCH lines before it contacts the controller, and refuses an unknown
    option or a bad value with exit status 255; with no controller (port 9: nothing listens) a
    well-formed script gets as far as "Unable to contact slurm controller"."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=check\nSlurmctldHost=localhost\nSlurmctldPort=9\nAuthType=auth/none\n"
                    "CredType=cred/none\nGresTypes=gpu\nMessageTimeout=1\nNodeName=localhost CPUs=1\n"
                    "PartitionName=p Nodes=localhost\n")  # MessageTimeout: give up on the controller in 1 s
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_"))}
    script = render_sbatch(jobs[nodes])

    def test_only(text: str) -> subprocess.CompletedProcess:
        (tmp_path / "job.sbatch").write_text(text)
        return subprocess.run([SBATCH, "--test-only", "job.sbatch"], cwd=tmp_path, env={**env, "SLURM_CONF": str(conf)},
                              capture_output=True, text=True, timeout=60)

    bad = test_only(script.replace("#SBATCH --time=00:30:00", "#SBATCH --time=half-an-hour"))
    assert bad.returncode == 255 and "time" in bad.stderr, bad.stderr  # the check can fail here
    done = test_only(script)
    assert done.returncode != 255 and "Unable to contact slurm controller" in done.stderr, done.stderr


@pytest.mark.parametrize("nodes,gpus,batch", SHAPES)
def test_every_slurm_variable_is_documented(jobs, nodes, gpus, batch):
    script = render_sbatch(jobs[nodes])
    used = set(re.findall(r"\$\{?(SLURM\w*)", script))
    assert {"SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES"} <= used
    # every variable is expanded by the batch script's own shell (none inside an srun task)
    assert used <= SBATCH_OUTPUT_ENV, used - SBATCH_OUTPUT_ENV
    assert SBATCH_OUTPUT_ENV | SRUN_OUTPUT_ENV >= used


def test_every_option_and_command_has_a_comment_above():
    lines = render_sbatch(SlurmJob("fault", 2, 4, partition="p", account="a")).splitlines()
    starts = ("#SBATCH", "set ", ": ", "MASTER_ADDR=", "MASTER_PORT=", "OUT_DIR=", "export ", "if ", "cat ", "srun ")
    # an export may follow another one, the comment above the first explaining both
    explained = [line for i, line in enumerate(lines) if line.startswith(starts)
                 and (lines[i - 1].startswith("# ") or lines[i - 1].startswith("export ") and line.startswith("export "))]
    assert explained == [line for line in lines if line.startswith(starts)]
    assert len(explained) == 23  # 11 #SBATCH lines, 12 commands


def test_parse_time():
    assert parse_time("00:30:00") == 1800
    assert parse_time("48:00:00") == 48 * 3600
    assert parse_time("1-12:00:01") == 36 * 3600 + 1
    for bad in ("30", "1:30", "00:60:00", "00:00:60", "1-24:00:00", "00:00:00", "", "1h"):
        with pytest.raises(ValueError, match="--time"):
            parse_time(bad)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(nodes=0), "--nodes must be a whole number >= 1, got 0"),
    (dict(gpus_per_node=0), "--gpus-per-node must be a whole number >= 1, got 0"),
    (dict(nodes=True), "--nodes"),
    (dict(run="nope"), "unknown run 'nope'; available runs:"),
    (dict(time="90"), "--time expects HH:MM:SS"),
    (dict(port=80), "--port must be a whole number from 1024 to 65535"),
    (dict(partition="gpu long"), "--partition 'gpu long': accepted characters"),
    (dict(account="a;b"), "--account"),
    (dict(job_name="my job"), "--job-name"),
    (dict(log="$HOME/x.out"), "sbatch expands no $VARIABLES"),
    (dict(out_dir="a\nb"), "--out must be a folder path on one line"),
])
def test_bad_job_refused_with_one_line(kwargs, fragment):
    spec = {"run": "fault", "nodes": 2, "gpus_per_node": 4, **kwargs}
    with pytest.raises(ValueError) as err:
        SlurmJob(**spec)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_build_job_checks_the_config_with_the_run():
    with pytest.raises(ValueError, match=r"^--set: unknown config key\(s\) 'stepz' \(did you mean 'steps'\?\)"):
        build_job("fsdp_train", 2, 4, {"stepz": "3"})
    with pytest.raises(ValueError, match=r"^--set steps=many: steps takes a whole number >= 1$"):
        build_job("fsdp_train", 2, 4, {"steps": "many"})
    with pytest.raises(ValueError, match=r"^--nodes 3 x --gpus-per-node 1 = 3 ranks: batch_size=8 must be divisible"):
        build_job("fsdp_train", 3, 1)
    with pytest.raises(ValueError, match="comm_bench needs at least 2 ranks"):  # the run's own validate()
        build_job("comm_bench", 1, 1)
    assert build_job("comm_bench", 1, 2).world_size == 2


def test_write_script_never_replaces_a_foreign_file(tmp_path):
    text = render_sbatch(SlurmJob("fault", 1, 1))
    path = write_script(tmp_path / "job.sbatch", text)
    assert path.read_text() == text and is_own_script(path)
    with pytest.raises(ValueError, match="exists .*add --overwrite"):
        write_script(path, "changed")
    write_script(path, text.replace("fault", "fault "), overwrite=True)
    assert "fault " in path.read_text()
    foreign = tmp_path / "mine.sh"
    foreign.write_text("#!/bin/bash\necho precious\n")
    with pytest.raises(ValueError, match="not written by this tool"):
        write_script(foreign, text, overwrite=True)
    assert foreign.read_text() == "#!/bin/bash\necho precious\n"
    (tmp_path / "link.sbatch").symlink_to(path)
    with pytest.raises(ValueError, match="not a plain file"):
        write_script(tmp_path / "link.sbatch", text, overwrite=True)
    with pytest.raises(ValueError, match="does not exist"):
        write_script(tmp_path / "no" / "job.sbatch", text)


@needs_bash
def test_the_port_follows_the_job_id_unless_one_is_given(tmp_path):
    """Two jobs sharing a first node get different rendezvous ports: bash computes them from the
    job id at run time; an explicit port is kept as it is."""
    def endpoint(job: SlurmJob, job_id: str) -> str:
        (tmp_path / "job.sbatch").write_text(render_sbatch(job))
        env = {**fake_cluster(tmp_path / job_id, 1), "SLURM_JOB_ID": job_id}
        done = subprocess.run([BASH, "job.sbatch"], check=False, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        argv = (tmp_path / job_id / "log" / "node0.argv").read_text().splitlines()
        return argv[argv.index("--rdzv-endpoint") + 1]

    for job_id in ("4242", "4243", "1999"):
        (tmp_path / job_id).mkdir()
    derived = SlurmJob("fault", 1, 1)
    assert [endpoint(derived, i) for i in ("4242", "4243")] == ["gpu001:29742", "gpu001:29743"]
    assert endpoint(SlurmJob("fault", 1, 1, port=31000), "1999") == "gpu001:31000"
    assert "MASTER_PORT=$((29500 + SLURM_JOB_ID % 1000))\n" in render_sbatch(derived)


def test_the_script_sets_nccl_reporting_and_says_how_to_debug():
    script = render_sbatch(SlurmJob("fault", 2, 8))
    exported = dict(pair.split("=", 1) for line in script.splitlines() if line.startswith("export ")
                    for pair in line.removeprefix("export ").split())
    assert exported == {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NCCL_DEBUG": "WARN",
                        "HANDBOOK_COLLECTIVE_TIMEOUT_S": "600", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    comments = "\n".join(line for line in script.splitlines() if line.startswith("#"))
    for advice in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "TORCH_DISTRIBUTED_DEBUG=DETAIL", "py-spy dump",
                   "--requeue", "--signal=USR1@120", "resume_if_present=true", "module load",
                   "flight_recorder.fr_trace"):
        assert advice in comments, advice


def test_the_timeout_variable_is_the_one_the_runtime_reads():
    from handbook_lib.core.protocol import COLLECTIVE_TIMEOUT_ENV

    runtime = (Path(__file__).parents[1] / "handbook_lib/runtime/distributed.py").read_text()
    assert "os.environ.get(COLLECTIVE_TIMEOUT_ENV" in runtime
    assert f"export {COLLECTIVE_TIMEOUT_ENV}=600 " in render_sbatch(SlurmJob("fault", 1, 1))


def test_c10d_numbers_the_nodes_by_their_sorted_descriptors():
    """What the script's comment says about --rdzv-backend c10d, read from the installed torch: on
    completion the rendezvous ranks its participants by sorting their node descriptors (host,
    pid, local id), whatever order they joined in."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    assert "sorted(state.participants)" in inspect.getsource(dr._DistributedRendezvousOpExecutor
                                                             ._mark_rendezvous_complete)
    joined = [dr._NodeDesc("gpu007", 10, 0), dr._NodeDesc("gpu002", 99, 0), dr._NodeDesc("gpu002", 12, 0)]
    assert sorted(joined) == [joined[2], joined[1], joined[0]]
    words = " ".join(render_sbatch(SlurmJob("fault", 2, 1)).replace("#", " ").split())
    assert "numbers them in the sorted order of their (host name, pid) descriptors" in words


def test_every_run_s_script_fits_the_book_s_column_and_keeps_its_header():
    from handbook_lib.runs import available_runs

    for run in available_runs():
        for nodes, gpus in ((1, 1), (16, 8)):
            script = render_sbatch(SlurmJob(run, nodes, gpus, partition="gpu", account="proj"))
            assert max(map(len, script.splitlines())) <= 86, run
            assert script.splitlines()[:2] == [SHEBANG, MARKER]
    # the reflowed comments keep every word of the table of torchrun's flags, in order
    script = render_sbatch(SlurmJob("fault", 2, 8))
    flags = [line.split()[1] for line in script.splitlines() if line.startswith("#   -")]
    assert flags == ["--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id",
                     "--max-restarts", "--tee", "-m"]


def _fake_slurm(tmp_path, srun_body: str) -> dict[str, str]:
    """PATH with a fake ``scontrol`` (it records requeues) and a fake ``srun`` running
    ``srun_body`` with ``$out`` the run's folder (the script's last argument)."""
    import os
    import stat

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "scontrol": '#!/bin/bash\nif [ "$1" = requeue ]; then echo "requeue $2" >> "$REQUEUED"; '
                    'else echo node01; fi\n',
        "srun": '#!/bin/bash\nout="${@: -1}"\n' + srun_body + "\n",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NNODES": "2", "REQUEUED": str(tmp_path / "requeued")}


PREEMPTED_RANKS = ('mkdir -p "$out/ranks"; for r in 0 1; do printf \'{\\n  "rank": %s,\\n  "status": '
                   '"preempted"\\n}\\n\' $r > "$out/ranks/rank$r.json"; done; exit 1')


@pytest.mark.parametrize("body, requeued, code", [
    (PREEMPTED_RANKS, "requeue 4242\n", 0),        # ranks stopped saved: the job queues itself again
    ("exit 0", None, 0),                           # finished: no requeue
    ("exit 3", None, 3),                           # failed: no requeue, srun's status
])
def test_a_preemptible_script_requeues_itself_only_when_the_ranks_stopped_saved(tmp_path, body, requeued, code):
    """Issue 26: the script asks for SIGUSR1 ahead of the limit and requeues on a preemption."""
    import subprocess

    job = build_job("checkpoint_resume", 2, 1, {"ckpt_dir": "/shared/ck", "save_every": 10})
    assert job.config["resume"] is True and job.config["resume_if_present"] is True
    script = render_sbatch(job)
    assert "#SBATCH --signal=USR1@120\n" in script and "#SBATCH --requeue\n" in script
    assert "export TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1\n" in script
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    # a stale state of an earlier start must not count: the script removes it before srun
    stale = tmp_path / "work" / "runs" / "checkpoint_resume-4242" / "ranks"
    stale.mkdir(parents=True)
    (stale / "rank0.json").write_text('{"status": "preempted"}')
    done = subprocess.run(["bash", str(path)], cwd=tmp_path / "work", env=_fake_slurm(tmp_path, body),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    recorded = (tmp_path / "requeued").read_text() if (tmp_path / "requeued").exists() else None
    assert recorded == requeued
    assert ("requeueing job 4242" in done.stdout) == (requeued is not None)


def test_a_run_that_cannot_resume_gets_no_signal_or_requeue():
    script = render_sbatch(build_job("fault", 2, 1, {"mode": "none"}))
    assert "--signal=USR1" not in script.replace("# latest; --signal=USR1@120", "")
    assert "#SBATCH --requeue" not in script and "scontrol requeue" not in script


def test_an_output_that_cannot_be_written_is_one_line(capsys):
    """A folder nobody may create files in (``/proc``): one line naming --output, no traceback."""
    with pytest.raises(ValueError, match=r"^--output /proc/handbook\.sbatch: cannot be written \(No such file or "
                                         r"directory\); choose a path in a folder you can write to$"):
        write_script("/proc/handbook.sbatch", "#!/bin/bash\n")
    from handbook_lib.face import main

    assert main(["slurm", "fsdp_train", "--nodes", "1", "--gpus-per-node", "1", "--output", "/proc/x.sbatch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --output /proc/x.sbatch: cannot be written") and "Traceback" not in err
