"""The Learner on a mesh: 8 sharded devices == 1, the non-finite guard, the state round trip,
sampler-logprob PPO with a KL penalty and warmup, and no recompilation in steady state."""

import pathlib
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.learner import Learner

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from learner_helpers import actor, assert_trees_close, batch, mesh, model  # noqa: E402


@pytest.mark.slow
def test_sharded_8_devices_equals_1_and_non_finite_guard():
  groups, rewards = batch(1, groups=4, n=4)
  opts = actor(ppo_n_minibatches=2, seq_level_ratio=True, behav_imp_weight_level="sequence")
  one = Learner(model(), opts, mesh(1))
  eight = Learner(model(), opts, mesh(8, data=2, fsdp=2, tensor=2))
  assert_trees_close(eight.gradients(groups, rewards)[0], one.gradients(groups, rewards)[0])
  m1, m8 = one.train_step(groups, rewards), eight.train_step(groups, rewards)
  for k in ("loss", "grad_norm", "clip_frac", "entropy", "approx_kl"):
    np.testing.assert_allclose(m8[k], m1[k], rtol=1e-4, atol=1e-6, err_msg=k)
  # Adam divides by the gradient's own scale, so where a gradient is near zero its rounding
  # (summation order differs between layouts) can move a parameter by a fraction of lr (1e-3):
  # parameters agree to a tenth of one step.
  assert_trees_close(eight.params(), one.params(), rtol=1e-4, atol=1e-4)
  shardings = [x.sharding for x in jax.tree.leaves(eight.params())]
  assert all(len(s.device_set) == 8 for s in shardings)
  assert any(not s.is_fully_replicated for s in shardings)

  # A non-finite loss in minibatch 2 stops the step; the bad update is never applied.
  step_before = int(eight.state["step"])
  groups[3][1].logprobs[0] = float("nan")  # a broken behaviour logprob: the weight is NaN
  with pytest.raises(FloatingPointError, match=r"learner step 1 .*minibatch 2/2: non-finite"):
    eight.train_step(groups, rewards)
  assert eight.version == 1
  assert int(eight.state["step"]) == step_before + 1  # minibatch 1 (finite) was applied
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(jax.device_get(eight.params())))
  groups[3][1].logprobs[0] = -3.0
  eight.train_step(groups, rewards)
  assert eight.version == 2


@pytest.mark.slow
def test_flash_attention_on_8_devices_trains_as_the_dense_attention(monkeypatch):
  """``actor.attention``: the Pallas GPU flash kernel (interpret mode on these CPU devices, under
  ``shard_map`` over data, FSDP and tensor axes, the layers rematerialised) trains a step as the
  dense attention does: the same loss, gradients and updated parameters."""
  from areal_jax.kernels import causal_attention
  traced, attend = [], causal_attention.attend
  monkeypatch.setattr(causal_attention, "attend", lambda *a, **kw: traced.append(a[4]) or attend(
      *a, **kw))
  groups, rewards = batch(2, groups=2, n=4)
  dense, flash = (Learner(model(), actor(attention=a, remat="full"), mesh(8, data=2, fsdp=2,
                                                                          tensor=2))
                  for a in ("dense", "pallas_gpu"))
  assert_trees_close(flash.gradients(groups, rewards)[0], dense.gradients(groups, rewards)[0])
  m_d, m_f = dense.train_step(groups, rewards), flash.train_step(groups, rewards)
  for k in ("loss", "grad_norm", "entropy"):
    np.testing.assert_allclose(m_f[k], m_d[k], rtol=1e-4, atol=1e-6, err_msg=k)
  assert_trees_close(flash.params(), dense.params(), rtol=1e-4, atol=1e-4)
  assert traced and set(traced) == {"pallas_gpu"}  # (the kernel was traced, the dense form not)


def test_state_round_trip_options_and_no_recompilation():
  """Sampler logprobs as the old policy (no recompute), a KL penalty, warmup, two minibatches; the
  state round trip; and few compiled shapes over batches of varying lengths."""
  opts = actor(use_decoupled_loss=False, recompute_logprobs=False, ppo_n_minibatches=2,
               kl_coef=0.1, warmup_steps=2)
  learner = Learner(model(), opts, mesh(4), total_steps=10, max_seq_len=16)
  groups, rewards = batch(3)
  m = learner.train_step(groups, rewards)
  assert m["kl_loss"] < 1e-6 and m["updates"] == 2 and m["lr"] < 2e-4  # warmup from 0
  # old == behaviour logprobs: the update starts from ratio exp(logp - behav), far from 1.
  assert m["clip_frac"] > 0.1
  saved = jax.device_get(learner.state)
  m = learner.train_step(groups, rewards)
  assert m["kl_loss"] > 0 and 0 < m["lr"] < 1e-3
  assert int(learner.state["step"]) == 4 and learner.version == 2
  learner.load_state(saved)
  assert learner.version == 1 and int(learner.state["step"]) == 2
  assert_trees_close(learner.params(), saved["params"], rtol=0, atol=0)
  for x, s in zip(jax.tree.leaves(learner.state), jax.tree.leaves(learner.state_shardings)):
    assert x.sharding.is_equivalent_to(s, x.ndim)
  pure = nnx.to_pure_dict(nnx.state(model(), nnx.Param))
  assert jax.tree.structure(learner.params()) == jax.tree.structure(pure)
  for seed in range(4):  # steady state: same B, different lengths and prompts
    m = learner.train_step(*batch(10 + seed))
    assert m["row_len"] == 16
  assert learner._acc_fn._cache_size() <= 2
  assert learner._logp_fn._cache_size() <= 2
  assert learner._apply_fn._cache_size() == 1
