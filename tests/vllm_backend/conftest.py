"""Fixtures of the vLLM backend tests (real vLLM on CPU via ``make test-vllm``; skipped without it)."""

import atexit
import importlib.util
import os
import pathlib
import shutil
import sys
import tempfile

import pytest
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import vllm_helpers  # noqa: E402

from areal_jax import models  # noqa: E402

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# vLLM's engines leave a file:// rendezvous file (vllm_dist_*) in the temporary directory at every
# start: a session with vLLM gets a temporary directory of its own (inherited by the xdist workers
# and the servers they start), removed at the end. A short name: Ray's socket paths are built
# under it.
if importlib.util.find_spec("vllm") and "AREAL_JAX_VLLM_TESTS_TMP" not in os.environ:
  os.environ["TMPDIR"] = os.environ["AREAL_JAX_VLLM_TESTS_TMP"] = tempfile.mkdtemp(prefix="avt")
  tempfile.tempdir = None  # (gettempdir reads TMPDIR again)
  atexit.register(shutil.rmtree, os.environ["TMPDIR"], ignore_errors=True)


def pytest_configure(config):
  config.addinivalue_line("markers", "vllm: needs vLLM (run with `make test-vllm`)")


# The longest modules, longest first: the SIGKILLed Ray worker's run, the shared server's module, the
# in-process run (their durations: bench/results/test-suite-vllm-order-2026-12-06-bb2a61b/); the
# rest keep their order.
LONGEST_FIRST = ("test_e2e_ray.py", "test_server.py", "test_e2e.py")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
  """``make test-vllm`` hands out whole modules (``--dist loadfile``) in this order
  (``--no-loadscope-reorder``): the longest start first, on both workers, and the short modules
  fill in beside them, so that no worker ends the session alone on the minute-long run."""
  here, rank = pathlib.Path(__file__).parent, {name: i for i, name in enumerate(LONGEST_FIRST)}
  # (this hook sees every item of the session: only this directory's modules move)
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)) if item.path.parent == here
             else len(rank))  # stable: otherwise as collected


@pytest.fixture(scope="session")
def tokenizer():
  return models.byte_tokenizer()


@pytest.fixture(scope="session")
def policies(tokenizer):
  """Two tiny models with different random weights (policy versions 0 and 1)."""
  cfg = vllm_helpers.tiny_hd32_config(tokenizer)
  return models.Transformer(cfg, nnx.Rngs(0)), models.Transformer(cfg, nnx.Rngs(1))
