# stripefs: `make demo` and `make test` work on a fresh Debian machine (root installs apt deps).
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
APT_PKGS := fuse3 libfuse3-dev pkg-config fio postgresql
DEMO_ROOT ?= /tmp/stripefs-demo

# LMCache 0.5.6 declares CUDA-only dependencies (cupy-cuda13x, nvtx, cufile): its wheel and
# the pure dependencies its storage-plugin interface imports go to a directory of their own,
# without pip's resolver, so the CPU torch stays; `make test-lmcache` then drives the plugin
# through LMCache's own classes (make test runs the same tests against stand-ins).
LMCACHE_SITE := .lmcache-site
LMCACHE_PKGS := lmcache==0.5.6 aiofile==3.12.3 aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 \
  cachetools==8.0.2 caio==0.12.10 certifi cffi==2.1.1 click==8.5.1 cryptography==50.0.2 frozenlist==1.8.0 \
  h11==0.16.0 hf_xet==1.8.0 httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0 llvmlite==0.50.0 \
  msgspec==0.23.0 multidict==7.2.1 numba==0.68.1 propcache==0.5.4 psutil==7.2.2 py_cpuinfo==9.0.0 \
  pycparser==3.12 pyyaml==6.0.4 pyzmq==27.3.0 regex==2026.11.19 requests==2.34.2 safetensors==0.8.0 \
  shellingham==1.5.4 tokenizers==0.23.3 transformers==5.25.0 truststore==0.10.5 typer==0.29.2 urllib3==2.8.0 \
  yarl==1.25.1

.PHONY: setup sysdeps demo test test-lmcache bench clean

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

test-lmcache: setup
	test -d $(LMCACHE_SITE) || $(BIN)/pip install -q --no-deps --target $(LMCACHE_SITE) $(LMCACHE_PKGS)
	PYTHONPATH=$(LMCACHE_SITE) $(BIN)/python -m pytest -q tests/kvcache/test_lmcache_plugin.py

bench: setup
	$(BIN)/python -m stripefs.bench.core_bench

clean:
	rm -rf $(VENV) $(LMCACHE_SITE) build *.egg-info
