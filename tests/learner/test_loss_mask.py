"""Multi-turn trajectories in the learner: tokens with loss mask 0 are context only.

One learner serves all checks (compiles dominate the run time)."""

import dataclasses
import pathlib
import sys

import jax
import numpy as np
import pytest

from areal_jax.learner import Learner, advantages, packing

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from learner_helpers import Sample, V, actor, mesh, model, token_logps  # noqa: E402


def episode(rng, gid, index, turns):
  """A multi-turn trajectory: policy turns (mask 1) with environment tokens between (mask 0)."""
  prompt = rng.integers(0, V, 4).tolist()
  tokens, mask, versions = [], [], []
  for t, (n_policy, n_env) in enumerate(turns):
    tokens += rng.integers(0, V, n_policy + n_env).tolist()
    mask += [1] * n_policy + [0] * n_env
    versions += [t] * (n_policy + n_env)
  return Sample(gid, index, prompt, tokens, [0.0] * len(tokens), versions, "eos", loss_mask=mask)


def test_masked_loss_matches_numpy_on_policy_tokens_and_none_equals_all_ones():
  rng = np.random.default_rng(0)
  opts = actor(behav_imp_weight_cap=0.0)  # no cap: every policy token's weight counts
  learner = Learner(model(), opts, mesh(), temperature=0.9)
  group = [episode(rng, 0, 0, [(3, 5), (4, 6), (2, 0)]), episode(rng, 0, 1, [(5, 4), (3, 0)]),
           episode(rng, 0, 2, [(2, 7), (2, 0)])]
  rewards = [[1.0, 0.0, 0.5]]
  prox = token_logps(learner, group)
  for s, lp in zip(group, prox):  # behaviour = proximal + noise on policy tokens; env tokens 0.0
    s.logprobs = [p + 0.3 * rng.standard_normal() if m else 0.0 for p, m in zip(lp, s.loss_mask)]
  _, metrics = learner.gradients([group], rewards)

  # Reference (first minibatch: the proximal policy is the current one, so the PPO ratio is 1 and
  # each token's loss is -A; the behaviour weight is exp(prox - behav)).
  adv = advantages.group_advantages(np.asarray(rewards), opts)[0]
  num, den = 0.0, 0
  for s, a, lp in zip(group, adv, prox):
    for p, b, m in zip(lp, s.logprobs, s.loss_mask):
      if m:
        num += -a * np.exp(p - b)
        den += 1
  np.testing.assert_allclose(metrics["loss"], num / den, rtol=2e-5, atol=1e-6)
  w = [np.exp(p - b) for s, lp in zip(group, prox) for p, b, m in zip(lp, s.logprobs, s.loss_mask) if m]
  np.testing.assert_allclose(metrics["behav_weight_mean"], np.mean(w), rtol=2e-5)
  np.testing.assert_allclose(metrics["behav_weight_max"], np.max(w), rtol=2e-5)

  # The behaviour logprobs of environment tokens are never used: garbage there changes nothing.
  g_ref, _ = learner.gradients([group], rewards)
  garbage = [dataclasses.replace(s, logprobs=[b if m else -50.0 for b, m in
                                              zip(s.logprobs, s.loss_mask)]) for s in group]
  g_garbage, m_garbage = learner.gradients([garbage], rewards)
  assert m_garbage["loss"] == metrics["loss"]
  for x, y in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_garbage)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

  # Single-turn samples: no mask and an all-ones mask give bit-identical results.
  plain = [dataclasses.replace(s, loss_mask=None, logprobs=list(lp)) for s, lp in zip(group, prox)]
  ones = [dataclasses.replace(s, loss_mask=[1] * len(s.tokens)) for s in plain]
  (g0, m0), (g1, m1) = learner.gradients([plain], rewards), learner.gradients([ones], rewards)
  assert m0 == m1
  for x, y in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert learner.build_sequences([plain], rewards)[0][0].loss_mask is None


def test_pack_places_the_mask_on_scoring_positions_and_rejects_bad_masks():
  seq = packing.Seq([7, 8, 1, 2, 3, 4], 2, [-1.0, 0.0, 0.0, -2.0], 0.5, [1, 0, 0, 1])
  p = packing.pack([seq], 8)
  assert p.mask[0].tolist() == [0, 1, 0, 0, 1, 0, 0, 0]  # position t scores token t + 1
  assert p.adv[0, 1] == 0.5 and p.behav_logp[0, 4] == -2.0
  with pytest.raises(ValueError, match="loss mask of 3 for 4 tokens"):
    packing.pack([dataclasses.replace(seq, loss_mask=[1, 0, 1])], 8)
  learner_like = Learner.__new__(Learner)  # build_sequences only needs the version and opts
  learner_like._state = dict(version=np.int32(3))
  learner_like.opts = actor()
  bad = Sample(0, 0, [1], [2, 3], [0.0, 0.0], [0, 0], "eos", loss_mask=[1, 2])
  with pytest.raises(ValueError, match="values other than 0 and 1"):
    learner_like.build_sequences([[bad, bad]], [[1.0, 0.0]])
  short = dataclasses.replace(bad, loss_mask=[1])
  with pytest.raises(ValueError, match="loss mask of 1"):
    learner_like.build_sequences([[short, short]], [[1.0, 0.0]])
