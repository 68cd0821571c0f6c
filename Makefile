# The FSDP Handbook: the two commands of the README, and a few helpers.
#   make book        set up, then build the HTML book (offline) into _build/html
#   make test        set up, then run the whole test suite (unit, distributed, notebooks, book)
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: book test notebooks lab setup clean

setup:
	scripts/setup.sh book,test,lab

book:
	scripts/setup.sh book
	$(VENV)/bin/jupyter-book build . -n -W --keep-going
	@echo "open _build/html/index.html"

test: setup
	$(PY) -m pytest tests notebooks --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg

notebooks: setup  ## re-execute every notebook and store its outputs
	$(PY) scripts/execute_notebooks.py

lab: setup
	$(VENV)/bin/jupyter lab --ip 127.0.0.1 $(if $(filter 0,$(shell id -u)),--allow-root) notebooks

clean:
	rm -rf _build .pytest_cache
