"""Group advantages (GRPO, Dr.GRPO, RLOO, none), reward scaling and batch normalization."""

import ml_collections
import numpy as np
import pytest

from areal_jax.learner import advantages as adv_lib


def opts(**kw):
  base = dict(adv_norm="group", group_std_unbiased=True, adv_eps=1e-5, batch_adv_norm=False,
              reward_scaling=1.0, reward_bias=0.0)
  base.update(kw)
  return ml_collections.ConfigDict(base)


R = np.array([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])


def test_grpo_unbiased_std():
  a = adv_lib.group_advantages(R, opts())
  for g in range(3):
    r = R[g]
    want = (r - r.mean()) / (np.sqrt(np.sum((r - r.mean()) ** 2) / 3) + 1e-5)
    np.testing.assert_allclose(a[g], want)
  np.testing.assert_allclose(a[2], 0.0)  # a uniform group carries no signal


def test_grpo_biased_std_and_eps():
  a = adv_lib.group_advantages(R, opts(group_std_unbiased=False, adv_eps=0.1))
  np.testing.assert_allclose(a[0], (R[0] - 0.5) / (0.5 + 0.1))


def test_dr_grpo_rloo_none():
  np.testing.assert_allclose(adv_lib.group_advantages(R, opts(adv_norm="group_mean"))[1],
                             [-0.25, -0.25, -0.25, 0.75])
  rloo = adv_lib.group_advantages(R, opts(adv_norm="rloo"))
  np.testing.assert_allclose(rloo[1], [-1 / 3, -1 / 3, -1 / 3, 1.0])
  np.testing.assert_allclose(rloo[0], [2 / 3, -2 / 3, -2 / 3, 2 / 3])
  np.testing.assert_allclose(adv_lib.group_advantages(R, opts(adv_norm="none")), R)


def test_reward_scaling_and_bias():
  o = opts(adv_norm="none", reward_scaling=10.0, reward_bias=-0.5)
  np.testing.assert_allclose(adv_lib.group_advantages(R, o), R * 10 - 0.5)
  # GRPO is invariant to scaling and bias (up to eps).
  a = adv_lib.group_advantages(R[:2], opts(reward_scaling=10.0, reward_bias=-0.5, adv_eps=0.0))
  np.testing.assert_allclose(a, adv_lib.group_advantages(R[:2], opts(adv_eps=0.0)))


def test_batch_normalization_is_token_weighted():
  adv = np.array([1.0, -1.0, 0.5])
  n = np.array([3, 1, 0])
  got = adv_lib.batch_normalize(adv, n, 0.0)
  tokens = np.repeat(adv, n)
  np.testing.assert_allclose(got, (adv - tokens.mean()) / tokens.std())
  o = opts(adv_norm="group_mean", batch_adv_norm=True, adv_eps=0.0)
  lengths = np.array([[3, 1, 2, 2], [1, 1, 5, 1], [2, 2, 2, 2]])
  seq = adv_lib.sequence_advantages(R, lengths, o)
  per_token = np.repeat(seq, lengths.reshape(-1))
  assert abs(per_token.mean()) < 1e-9 and abs(per_token.std() - 1) < 1e-9


def test_uniform_groups_and_errors():
  assert adv_lib.uniform_groups(R) == 1
  with pytest.raises(ValueError, match="rloo"):
    adv_lib.group_advantages([[1.0]], opts(adv_norm="rloo"))
  with pytest.raises(ValueError, match="adv_norm"):
    adv_lib.group_advantages(R, opts(adv_norm="zscore"))
  with pytest.raises(ValueError, match="groups, samples"):
    adv_lib.group_advantages([1.0, 2.0], opts())
