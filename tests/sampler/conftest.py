"""Shared tiny models for the sampler tests (d_model 64, 2 layers)."""

import pytest
from flax import nnx

from areal_jax.models import ModelConfig, Transformer

TINY = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   d_ff=128)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
  import dataclasses
  return Transformer(dataclasses.replace(TINY, **overrides), nnx.Rngs(seed))


@pytest.fixture(scope="module")
def model():
  return tiny_model(0)


@pytest.fixture(scope="module")
def other_model():
  """Same shapes, different weights: the 'new version' in weight-swap tests."""
  return tiny_model(7)
