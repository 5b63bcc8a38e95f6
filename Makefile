# stripefs: `make demo` and `make test` work on a fresh Debian machine (root installs apt deps).
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
APT_PKGS := fuse3 libfuse3-dev pkg-config fio postgresql
DEMO_ROOT ?= /tmp/stripefs-demo

.PHONY: setup sysdeps demo test bench clean

sysdeps:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then echo "installing:$$missing"; \
	    (apt-get install -y --no-install-recommends $$missing || (apt-get update && apt-get install -y --no-install-recommends $$missing)) >/dev/null; \
	  else echo "missing system packages:$$missing (run as root or install them)"; fi; \
	fi

$(STAMP): pyproject.toml
	$(MAKE) sysdeps
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
	# torch trap: a bare `torch` requirement pulls a multi-GB CUDA build; 2.13.0 is a CPU build on disk.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
	$(BIN)/pip install -q -e ".[fuse,torch,test,bench,postgres]" 2>&1 | grep -v "^WARNING: Location" || true
	$(BIN)/python -c "import stripefs.wire, stripefs.metadata, stripefs.storage, stripefs.fsclient, pyfuse3, torch, psycopg"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/python -m stripefs.demo --fresh --root $(DEMO_ROOT)

test: setup
	$(BIN)/python -m pytest -q --durations=25 tests

bench: setup
	$(BIN)/python -m stripefs.bench.core_bench

clean:
	rm -rf $(VENV) build *.egg-info
