"""The Learner: update direction, packed == padded, accumulation == full batch, bf16 compute,
and config errors (sharding, the non-finite guard and state are in test_sharded.py).

XLA compiles dominate the run time here, so each test builds as few learners as it can."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax import config as config_lib
from areal_jax.learner import Learner

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from learner_helpers import (Sample, actor, assert_trees_close, batch, mesh, model,  # noqa: E402
                             token_logps)


def test_advantage_sign_moves_logprob():
  """A positive advantage raises the logprob of the sampled tokens, a negative one lowers it.

  Standard PPO on recomputed logprobs (decoupled loss off)."""
  learner = Learner(model(), actor(use_decoupled_loss=False), mesh(), temperature=0.8)
  prompt = [1, 2, 3]
  good = Sample(0, 0, prompt, [4, 5, 6], [], [0] * 3, "eos")
  bad = Sample(0, 1, prompt, [7, 8], [], [0] * 2, "eos")
  good.logprobs, bad.logprobs = token_logps(learner, [good, bad])  # on-policy behaviour logprobs
  before = [sum(x) for x in token_logps(learner, [good, bad])]
  metrics = learner.train_step([[good, bad]], [[1.0, 0.0]])
  after = [sum(x) for x in token_logps(learner, [good, bad])]
  assert after[0] > before[0] + 1e-3 and after[1] < before[1] - 1e-3, (before, after)
  # On-policy: the recomputed proximal logprobs equal the sampler's, so every weight is 1.
  assert abs(metrics["behav_weight_max"] - 1.0) < 1e-4
  assert abs(metrics["behav_weight_mean"] - 1.0) < 1e-4
  assert learner.version == 1


# a clip-higher bound and a behaviour-weight cap that masks some of ``batch(0)``'s tokens
CAPPED = dict(eps_clip_high=0.28, behav_imp_weight_cap=1.2)


@pytest.fixture(scope="module")
def capped_learner():
  """(learner with ``CAPPED``, its gradients and metrics on ``batch(0)``), computed once for the
  module: the packed / padded test's learner, and the reference every remat / scan / chunked-head
  variant below is compared with."""
  groups, rewards = batch(0)
  learner = Learner(model(), actor(**CAPPED), mesh())
  return learner, *learner.gradients(groups, rewards)


@pytest.mark.slow
def test_packed_equals_padded_and_accumulated_equals_full(capped_learner):
  """Same gradient and metrics whether packed or one sequence per row, one micro-batch or many.

  ``pack_sequences`` and ``micro_batch_tokens`` only change the host-side layout, so one learner
  serves all three; a bfloat16-compute learner gives nearly the same loss."""
  groups, rewards = batch(0)
  learner, g_full, m_full = capped_learner
  opts = learner.opts
  stats = learner._prepare(groups, rewards)[1]
  assert stats["micro_batches"] == 1 and stats["padding_efficiency"] > 0.6
  assert m_full["cap_masked_frac"] > 0
  for kw in (dict(pack_sequences=False), dict(micro_batch_tokens=32)):
    opts.update({**dict(pack_sequences=True, micro_batch_tokens=4096), **kw})
    other = learner._prepare(groups, rewards)[1]
    if "pack_sequences" in kw:
      assert other["padding_efficiency"] < stats["padding_efficiency"] - 0.1
    else:
      assert other["micro_batches"] >= 4
    g, m = learner.gradients(groups, rewards)
    assert_trees_close(g, g_full)
    for k in m_full:
      np.testing.assert_allclose(m[k], m_full[k], rtol=1e-4, atol=1e-6, err_msg=k)
  # The first minibatch takes its proximal logprobs from the update's own forward; an explicit
  # recomputation gives the same gradient.
  opts.update(dict(pack_sequences=True, micro_batch_tokens=4096))
  (micro,), _ = learner._prepare(groups, rewards)
  b = dict(micro[0], old_logp=learner._logp_fn(learner.params(), micro[0])[0])
  acc = learner._acc_fn(learner.params(), learner._zeros_fn(), b, np.float32(micro[0]["mask"].sum()))
  assert_trees_close(acc["grads"], g_full)
  bf16 = Learner(model(), actor(**CAPPED, dtype="bfloat16"), mesh())
  g16, m16 = bf16.gradients(groups, rewards)
  np.testing.assert_allclose(m16["loss"], m_full["loss"], rtol=0.1, atol=0.02)
  np.testing.assert_allclose(m16["entropy"], m_full["entropy"], rtol=0.02)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(bf16.params()))  # master weights
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g16))


def test_config_errors():
  c = config_lib.base_config()
  c.actor.use_decoupled_loss, c.actor.recompute_logprobs = True, False
  with pytest.raises(ValueError, match="use_decoupled_loss=True requires"):
    config_lib.validate(c)
  with pytest.raises(ValueError, match="use_decoupled_loss=True requires"):
    Learner(model(), c.actor, mesh())
  learner = Learner(model(), actor(), mesh())
  groups, rewards = batch(5)
  with pytest.raises(ValueError, match="same number of samples"):
    learner.train_step([groups[0], groups[1][:2]], [rewards[0], rewards[1][:2]])
  with pytest.raises(ValueError, match="reward lists"):
    learner.train_step(groups, rewards[:2])
  with pytest.raises(ValueError, match="non-finite rewards"):
    learner.train_step(groups, [[float("inf")] * 4] * 4)


@pytest.mark.parametrize("remat,scan,chunk", [("full", True, 16), ("dots", False, 0),
                                              ("offload", True, 0), ("none", True, 7)])
@pytest.mark.slow
def test_remat_scan_and_chunked_head_change_no_gradient(capped_learner, remat, scan, chunk):
  """Rematerialisation, the scanned layers and the chunked LM head compute the same step (the
  ``CAPPED`` learner's: its plain layers and head are the module fixture's)."""
  groups, rewards = batch(0)
  _, g_ref, m_ref = capped_learner
  learner = Learner(model(), actor(remat=remat, scan_layers=scan, logits_chunk=chunk, **CAPPED),
                    mesh())
  g, m = learner.gradients(groups, rewards)
  assert_trees_close(g, g_ref)
  for k in m_ref:
    np.testing.assert_allclose(m[k], m_ref[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.fixture
def no_persistent_cache():
  """Compilations really happen: the session's persistent cache (tests/conftest.py) would serve
  this learner's programs, compiled by an earlier test or process, and count none."""
  from jax.experimental.compilation_cache import compilation_cache

  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  yield
  jax.config.update("jax_enable_compilation_cache", True)
  compilation_cache.reset_cache()


def test_compiles_are_counted_and_vanish_on_a_steady_workload(no_persistent_cache):
  learner = Learner(model(), actor(), mesh())
  first = learner.train_step(*batch(0))
  assert first["compiles"] > 0
  # Same batch size, other lengths: a known shape holds it, nothing compiles.
  assert [learner.train_step(*batch(seed))["compiles"] for seed in (1, 2, 3)] == [0, 0, 0]
