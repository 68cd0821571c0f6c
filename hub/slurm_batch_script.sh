#!/bin/bash
# One learner's JupyterLab as a Slurm job, for a hub on a cluster (hub/jupyterhub_config_slurm.py).
# batchspawner's SlurmSpawner renders this template with Jinja: each name in double braces is its trait
# req_<name> (req_ngpus -> ngpus, the profile's GPUs), and cmd starts jupyterhub-singleuser.
#SBATCH --job-name=fsdp-handbook-{{username}}
#SBATCH --output={{homedir}}/jupyterhub_slurmspawner_%j.log
#SBATCH --chdir={{homedir}}
#SBATCH --export={{keepvars}}
#SBATCH --get-user-env=L
#SBATCH --nodes=1
#SBATCH --ntasks=1
{% if partition %}#SBATCH --partition={{partition}}
{% endif %}{% if account %}#SBATCH --account={{account}}
{% endif %}{% if runtime %}#SBATCH --time={{runtime}}
{% endif %}{% if memory %}#SBATCH --mem={{memory}}
{% endif %}{% if nprocs %}#SBATCH --cpus-per-task={{nprocs}}
{% endif %}{% if ngpus %}#SBATCH --gres=gpu:{{ngpus}}
{% endif %}{% if options %}#SBATCH {{options}}
{% endif %}
# The course's environment (environment.yml, with the hub extra) first on PATH.
{{prologue}}
set -euo pipefail
trap 'echo "SIGTERM received: the server stops"' TERM

# Every chapter sees the job's GPUs (Slurm sets CUDA_VISIBLE_DEVICES) and starts one rank per GPU
# from a cell (handbook_lib.launch.ranks_for); NCCL's intra-node buffers live in /dev/shm.
echo "fsdp-handbook: job ${SLURM_JOB_ID:-?} on $(hostname), GPUs ${CUDA_VISIBLE_DEVICES:-none}"
df -h /dev/shm || true

{% if srun %}{{srun}} {% endif %}{{cmd}}
echo "jupyterhub-singleuser ended gracefully"
{{epilogue}}
