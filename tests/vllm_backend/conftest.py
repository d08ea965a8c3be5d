"""Fixtures of the vLLM backend tests (real vLLM on CPU via ``make test-vllm``; skipped without it)."""

import os
import pathlib
import sys

import pytest
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import vllm_helpers  # noqa: E402

from areal_jax import models  # noqa: E402

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_configure(config):
  config.addinivalue_line("markers", "vllm: needs vLLM (run with `make test-vllm`)")


@pytest.fixture(scope="session")
def tokenizer():
  return models.byte_tokenizer()


@pytest.fixture(scope="session")
def policies(tokenizer):
  """Two tiny models with different random weights (policy versions 0 and 1)."""
  cfg = vllm_helpers.tiny_hd32_config(tokenizer)
  return models.Transformer(cfg, nnx.Rngs(0)), models.Transformer(cfg, nnx.Rngs(1))
