"""Shared tiny models for the sampler tests (d_model 64, 2 layers), and the full forward's
logprobs they compare the sampler's against."""

import contextlib

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import ModelConfig, Transformer

TINY = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   d_ff=128)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
  import dataclasses
  return Transformer(dataclasses.replace(TINY, **overrides), nnx.Rngs(seed))


@nnx.jit
def _log_softmax(model, tokens_1xL, temperature):
  return jax.nn.log_softmax(model(tokens_1xL)[0] / temperature, axis=-1)


def full_forward_logprobs(model, prompt, tokens, temperature: float = 1.0) -> np.ndarray:
  """What the model's full forward over ``prompt + tokens`` gives each of ``tokens`` at
  ``temperature``. The row is padded to a multiple of 64 tokens (causal: the padding after it
  changes nothing before it) and the forward jitted, so that a test's many sequences compile it
  once per model shape, not op by op at each length."""
  seq = list(prompt) + list(tokens)
  tokens_1xL = np.zeros((1, -(-len(seq) // 64) * 64), np.int32)
  tokens_1xL[0, :len(seq)] = seq
  logp_LxV = np.asarray(_log_softmax(model, tokens_1xL, np.float32(temperature)))
  return logp_LxV[np.arange(len(prompt) - 1, len(seq) - 1), np.asarray(tokens, np.int64)]


@contextlib.contextmanager
def compiles():
  """The list of the XLA compilations that run inside the block (one entry each)."""
  seen = []

  def listener(event, secs, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      seen.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture(scope="module")
def model():
  return tiny_model(0)


@pytest.fixture(scope="module")
def other_model():
  """Same shapes, different weights: the 'new version' in weight-swap tests."""
  return tiny_model(7)
