"""A JupyterHub for the FSDP Handbook on a Slurm cluster: batchspawner behind wrapspawner.

    pip install "jupyterhub>=5.2,<6" batchspawner wrapspawner     # where the hub runs
    jupyterhub -f hub/jupyterhub_config_slurm.py

A learner picks 1, 2, 4 or 8 GPUs (wrapspawner's ProfilesSpawner); their server then runs as a
Slurm job on one node with that many (batchspawner's SlurmSpawner, ``req_ngpus`` ->
``#SBATCH --gres=gpu:N`` in ``hub/slurm_batch_script.sh``). Every chapter then sees N GPUs and
runs on them, as on a Kubernetes hub (``hub/config.yaml``). Set the names below for your site;
the compute nodes need the course's environment (``environment.yml`` and the ``hub`` extra, for
nbgitpuller and jupyterhub-singleuser) at ``ENVIRONMENT``.
"""

from pathlib import Path

c = get_config()  # noqa: F821 - JupyterHub's config loader provides it

PARTITION = "gpu"  # the partition of the GPU nodes
ACCOUNT = ""  # the account jobs are charged to, if the site needs one
RUNTIME = "4:00:00"  # how long a learner's server may run
ENVIRONMENT = "/opt/conda/envs/fsdp-handbook"  # conda env created from environment.yml
GPU_PROFILES = {1: (8, "64G"), 2: (16, "128G"), 4: (32, "256G"), 8: (64, "512G")}
"""GPUs per server -> (CPU cores, memory): the same sizes as hub/config.yaml's profiles."""


def profile(gpus: int, cpus: int, memory: str) -> tuple[str, str, str, dict[str, str]]:
    """One of ProfilesSpawner's profiles: (what the learner reads, key, spawner, its traits)."""
    shown = f"{gpus} GPU{'s' if gpus > 1 else ''}, {cpus} CPU cores, {memory}, {RUNTIME}"
    traits = {"req_ngpus": str(gpus), "req_nprocs": str(cpus), "req_memory": memory,
              "req_runtime": RUNTIME, "req_partition": PARTITION, "req_account": ACCOUNT}
    return shown, f"gpu-{gpus}", "batchspawner.SlurmSpawner", traits


c.JupyterHub.spawner_class = "wrapspawner.ProfilesSpawner"
c.ProfilesSpawner.profiles = [profile(gpus, *size) for gpus, size in GPU_PROFILES.items()]
c.SlurmSpawner.batch_script = Path(__file__).with_name("slurm_batch_script.sh").read_text()
c.SlurmSpawner.req_prologue = f'export PATH="{ENVIRONMENT}/bin:$PATH"'  # its python, jupyterhub-singleuser
c.SlurmSpawner.start_timeout = 600  # a job may wait in the queue
c.Spawner.default_url = "/lab"
c.Spawner.environment = {"HANDBOOK_DEVICE": "auto"}  # learners may set cpu or gpu (chapter 8)
c.JupyterHub.shutdown_on_logout = True  # logging out ends the job and frees its GPUs
