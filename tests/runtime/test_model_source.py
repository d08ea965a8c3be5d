"""``runtime.model_source.load``: the run's model, its weights where every process wants them."""

import pathlib
import sys

import jax
import numpy as np
from flax import nnx

from areal_jax.runtime import model_source

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_trainer import tiny_config  # noqa: E402


def _params(model):
  return jax.tree.leaves(nnx.state(model, nnx.Param))


def test_without_lora_the_weights_wait_in_host_memory_and_still_compute():
  c = tiny_config(**{"model.dtype": "bfloat16"})
  model, tokenizer = model_source.load(c)
  leaves = _params(model)
  # nothing left on a device: the learner and the sampler place copies of their own
  assert leaves and all(isinstance(x, np.ndarray) and x.dtype == np.float32 for x in leaves)
  tokens = np.asarray([tokenizer.encode("1 + 1 =")])
  assert np.isfinite(np.asarray(model(tokens), np.float32)).all()


def test_with_lora_the_base_is_frozen_once_in_the_actor_dtype():
  c = tiny_config(**{"actor.lora.rank": 4, "actor.lora.alpha": 8.0, "actor.dtype": "bfloat16"})
  model, _ = model_source.load(c)
  leaves = _params(model)
  assert leaves and all(isinstance(x, jax.Array) for x in leaves)  # shared, on the device
  # every matrix in the compute dtype (norm scales stay float32)
  assert {x.dtype for x in leaves if x.ndim >= 2} == {np.dtype(jax.numpy.bfloat16)}
