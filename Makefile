# Two commands a new user needs:
#   make demo   set up a venv and run the main job (the throughput benchmark)
#   make test   set up a venv and run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor
# Test processes (pytest-xdist): 2 took the suite from 19 to 12 minutes on 2 cores (a
# test spends most of its time in Dynamo's and Inductor's single-threaded Python);
# 0 runs it in this one process.
TEST_WORKERS ?= 2

.PHONY: setup demo test bench-latency clean

$(VENV)/.installed: Makefile setup.py pyproject.toml $(wildcard csrc/*.cpp) $(wildcard csrc/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned: plain `torch` would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q ninja pytest pytest-xdist transformers tqdm
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/sizebackend bench

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15 tests

bench-latency: setup
	$(PY) benchmarks/bench_latency.py

clean:
	rm -rf build *.egg-info dynamo_sizebackend/_C*.so .cache
