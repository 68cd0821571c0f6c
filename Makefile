# The FSDP Handbook: the two commands of the README, and a few helpers.
#   make book            set up, then build the HTML book (offline) into _build/html
#   make test            set up, then run the whole test suite (ruff, mypy, unit, distributed, notebooks, book),
#                        on CPU kernels other than those the notebooks' outputs were stored with
#   make lock            resolve pyproject.toml's ranges again (the newest releases within them) into
#                        requirements.lock, which every set-up installs from (scripts/lock.py)
#   make check-latest    the newest releases within the ranges in a separate environment (.venv-latest):
#                        which package moved beyond the lock, and which framework test or notebook broke
#                        (scripts/check_latest.py)
#   make check-portable  only the notebooks, re-executed on those other kernels and compared
#   make check-book      build the book, then open every page in headless Chromium and check what
#                        a reader sees (scripts/check_book.py): no console error, no request off
#                        127.0.0.1, images and maths rendered, nothing wider than the column,
#                        glossary definitions on hover
#   make check-hub       a chapter through a real JupyterHub on 127.0.0.1, as a learner in headless
#                        Chromium: the book's launch button, nbgitpuller, Run All, 0 errors, log out,
#                        nothing left running (scripts/check_hub.py; about 2 min)
#   make book-hub HUB_URL=https://hub.example.org REPO_URL=https://github.com/ORG/REPO [BRANCH=main]
#                        the book for a hub, a JupyterHub launch button on every chapter (hub/build_book.py)
#   make gpu-smoke       on one CUDA GPU, each CUDA-only path once; prints every failed check and writes
#                        results/gpu/smoke-<gpu-name-slug>.json (scripts/gpu_smoke.py; < 10 min; exits 2 without a GPU)
#   make gpu-check       on a CUDA machine, run the experiments on every visible GPU (NCCL) and write
#                        results/gpu/<gpu-name-slug>.json (scripts/gpu_check.py; < 10 min; exits 2 without a GPU)
#                        (both: GPU_PY=python3 uses that Python's CUDA torch, without set-up)
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python

NBVAL := --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg
# Replay on other CPU kernels (ATen, oneDNN, MKL) than the stored outputs were made with, so that
# an output whose digits depend on the CPU fails here, not on the next machine.
# scripts/cpu_variant.py picks them from the notebooks' metadata; it fails if that is missing.
OTHER_CPU = kernels="$$($(PY) scripts/cpu_variant.py --other)"; \
	echo "CPU kernels for this run: $$(echo $$kernels) (notebooks stored with $$($(PY) scripts/cpu_variant.py --stored))"; \
	env $$kernels

.PHONY: book test lock check-latest check-portable check-book check-hub book-hub gpu-smoke gpu-check notebooks lab setup clean

setup:
	scripts/setup.sh book,test,lab,frameworks

book:
	scripts/setup.sh book
	$(VENV)/bin/jupyter-book build . -n -W --keep-going
	@echo "open _build/html/index.html"

# Two workers, one test file each at a time (--dist loadfile keeps a file's module-scoped runs
# together): the torchrun jobs wait on their ranks' startup as much as they compute.
# JupyterLab (the lab extra) is for reading, not testing: the suite installs without it.
# The suite is calibrated on CPU ranks: on a GPU machine it still runs them on the CPU (no GPU
# visible); the GPU checks are make gpu-smoke and make gpu-check. Two workers, their notebook
# kernels and their ranks share 2 cores: OMP_WAIT_POLICY=PASSIVE makes a waiting OpenMP thread
# sleep instead of spinning on a core another process needs (same threads, same results).
# Notebooks first: the longest files (chapters 5 and 6) start early and short test files fill
# the end, instead of one worker running a long chapter alone at the end.
test:
	scripts/setup.sh book,test,frameworks
	$(OTHER_CPU) CUDA_VISIBLE_DEVICES= OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -n 2 --dist loadfile notebooks tests $(NBVAL)

# TORCH=VERSION moves torch's pin (default: the lock's). Without network: one line, the lock kept.
lock:
	python3 scripts/lock.py write $(if $(TORCH),--torch $(TORCH))

check-latest:
	python3 scripts/check_latest.py

check-portable: setup
	$(OTHER_CPU) $(PY) -m pytest notebooks $(NBVAL)

# Chromium and its driver, for the checks that open pages headless: apt-get as root, else one
# line saying how ($@: the target that needs them).
NEED_CHROMIUM = if ! command -v chromedriver >/dev/null || ! command -v chromium >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get install -y chromium chromium-driver \
	      || { apt-get update && apt-get install -y chromium chromium-driver; }; \
	  else \
	    echo "$@ needs Chromium and its driver: sudo apt-get install chromium chromium-driver"; exit 1; \
	  fi; \
	fi

# --all: Sphinx copies _static only when some page is out of date, and a CSS change is not one.
check-book:
	scripts/setup.sh book,browser
	@$(NEED_CHROMIUM)
	$(VENV)/bin/jupyter-book build . --all -n -W --keep-going
	$(PY) scripts/check_book.py _build/html

# JupyterHub and nbgitpuller from PyPI (the hub extra), configurable-http-proxy from npm into
# .venv/node (not global), Chromium as for check-book. CHECK_HUB_ARGS: e.g. --chapter, --repo-url.
check-hub:
	scripts/setup.sh book,test,lab,hub,browser
	@$(NEED_CHROMIUM)
	@if [ ! -x $(VENV)/node/node_modules/.bin/configurable-http-proxy ]; then \
	  command -v npm >/dev/null || { echo "check-hub needs Node.js >= 20 and npm (for configurable-http-proxy)"; exit 1; }; \
	  npm install --prefix $(VENV)/node --no-audit --no-fund --loglevel=error "configurable-http-proxy@^5"; \
	fi
	$(PY) scripts/check_hub.py $(CHECK_HUB_ARGS)

BRANCH ?= main
book-hub:
	@if [ -z "$(HUB_URL)" ] || [ -z "$(REPO_URL)" ]; then \
	  echo "usage: make book-hub HUB_URL=https://hub.example.org REPO_URL=https://github.com/ORG/REPO [BRANCH=main]"; \
	  exit 2; \
	fi
	scripts/setup.sh book
	$(PY) hub/build_book.py --hub-url "$(HUB_URL)" --repo-url "$(REPO_URL)" --branch "$(BRANCH)"

# Memory peaks against the model, the FSDP/DDP step-time ratio, MFU of a ~1B model in bf16 and the
# largest micro-batch, on CUDA + NCCL; the script keeps to a 540 s budget (--budget-s).
# GPU_PY=python3: on a GPU machine whose own Python already has a CUDA build of torch and no
# package index to set up from (a cluster image), run the scripts with it instead; the result
# set records its torch version.
GPU_PY ?=
gpu-check:
	$(if $(GPU_PY),,scripts/setup.sh test)
	$(or $(GPU_PY),$(PY)) scripts/gpu_check.py

# The CUDA-only paths, once each, on one GPU (trainer_deepspeed needs the frameworks extra).
# (With GPU_PY, DeepSpeed and pydantic must already be importable for trainer_deepspeed.)
gpu-smoke:
	$(if $(GPU_PY),,scripts/setup.sh test,frameworks)
	$(or $(GPU_PY),$(PY)) scripts/gpu_smoke.py

notebooks: setup  ## re-execute every notebook (native CPU kernels) and store its outputs
	$(PY) scripts/execute_notebooks.py

lab: setup
	$(VENV)/bin/jupyter lab --ip 127.0.0.1 $(if $(filter 0,$(shell id -u)),--allow-root) notebooks

clean:
	rm -rf _build .pytest_cache .mypy_cache .ruff_cache
