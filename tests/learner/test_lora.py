"""The Learner with ``actor.lora``: only adapters train and are stored; the merged model is exact."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.learner import Learner
from areal_jax.models import lora

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from learner_helpers import actor, assert_trees_close, batch, mesh, model  # noqa: E402


def _lora_actor(**kw):
  opts = actor(**kw)
  opts.lora.rank, opts.lora.alpha, opts.lora.targets = 4, 8.0, ("q_proj", "v_proj", "down_proj")
  return opts


def test_only_adapters_train_and_merged_model_is_base_plus_scaled_product():
  m = model()
  base = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(m, nnx.Param)))
  learner = Learner(m, _lora_actor(lr=1e-2, ppo_n_minibatches=2), mesh(2), temperature=0.9)
  assert lora.is_adapters(learner.params())
  n_adapter = lora.num_params(learner.params())
  assert n_adapter == learner.num_params == 2 * (4 * (32 + 32) + 4 * (32 + 16) + 4 * (64 + 32))
  for _ in range(2):
    metrics = learner.train_step(*batch(0))
  assert np.isfinite(metrics["loss"]) and learner.version == 2
  # the optimizer state holds moments of the adapters only
  opt_leaves = [x for x in jax.tree.leaves(learner.state["opt"]) if np.ndim(x) > 0]
  assert sum(int(np.prod(x.shape)) for x in opt_leaves) == 2 * n_adapter
  # the base stays frozen (float32 compute: stored as is)
  for x, y in zip(jax.tree.leaves(learner.frozen), jax.tree.leaves(base)):
    np.testing.assert_array_equal(x, y)
  ad = jax.tree.map(np.asarray, learner.params())
  assert np.abs(ad["layers"][0]["attn"]["q"]["b"]).max() > 0  # trained away from zero
  merged = learner.merged_params()
  for i in base["layers"]:
    for mod, name in (("attn", "q"), ("attn", "v"), ("mlp", "down")):
      w = base["layers"][i][mod][name].astype(np.float64)
      a, b = (ad["layers"][i][mod][name][k].astype(np.float64) for k in "ab")
      np.testing.assert_allclose(merged["layers"][i][mod][name], np.float32(w + 2.0 * a @ b),
                                 rtol=0, atol=2e-7)
    np.testing.assert_array_equal(merged["layers"][i]["attn"]["k"], base["layers"][i]["attn"]["k"])


def test_bfloat16_base_is_stored_in_the_compute_dtype():
  learner = Learner(model(), _lora_actor(dtype="bfloat16"), mesh(), temperature=1.0)
  frozen = learner.frozen
  assert frozen["layers"][0]["mlp"]["gate"].dtype == jnp.bfloat16
  assert frozen["embed"].dtype == jnp.bfloat16
  assert frozen["final_norm"]["scale"].dtype == jnp.float32
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(learner.params()))
  metrics = learner.train_step(*batch(1))
  assert np.isfinite(metrics["loss"])


def test_a_base_already_in_the_compute_dtype_is_shared_not_copied():
  """What keeps a colocated LoRA run at one copy of the base (the runtime casts it at load)."""
  m = model()
  state = nnx.state(m, nnx.Param)
  nnx.replace_by_pure_dict(state, lora.frozen_base(nnx.to_pure_dict(state), "bfloat16"))
  nnx.update(m, state)
  learner = Learner(m, _lora_actor(dtype="bfloat16"), mesh(), temperature=1.0)
  gate = learner.frozen["layers"][1]["mlp"]["gate"]
  assert gate.dtype == jnp.bfloat16
  assert gate.unsafe_buffer_pointer() == m.layers[1].mlp.gate[...].unsafe_buffer_pointer()


def test_adapters_train_the_same_under_remat_scan_and_chunked_head():
  """LoRA with the memory settings of the big recipes (remat, scanned layers, LM head in chunks)
  computes the same adapter gradients as the plain forward."""
  groups, rewards = batch(0)
  g_ref, m_ref = Learner(model(), _lora_actor(), mesh()).gradients(groups, rewards)
  learner = Learner(model(), _lora_actor(remat="full", scan_layers=True, logits_chunk=16), mesh())
  g, m = learner.gradients(groups, rewards)
  assert lora.is_adapters(g)
  assert_trees_close(g, g_ref)
  for k in m_ref:
    np.testing.assert_allclose(m[k], m_ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
