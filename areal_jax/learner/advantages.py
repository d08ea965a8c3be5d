"""Advantages from per-sample rewards (GRPO and its variants). Host-side NumPy.

Every generated token of a sequence gets that sequence's advantage. Rewards are first scaled and
biased (``reward * reward_scaling + reward_bias``), then normalized within each group:
  * ``group``: GRPO, ``(r - mean) / (std + adv_eps)`` (unbiased std if ``group_std_unbiased``);
  * ``group_mean``: Dr.GRPO, ``r - mean``;
  * ``rloo``: leave-one-out, ``r - mean of the other samples``;
  * ``none``: the scaled reward itself.
Optionally the result is normalized again over the whole batch, weighting each sequence by its
number of generated tokens (``batch_adv_norm``).
"""

from __future__ import annotations

import numpy as np


def group_advantages(rewards_GxN, opts) -> np.ndarray:
  """``[G, N]`` advantages of ``G`` groups of ``N`` samples (``opts`` is the ``actor`` config)."""
  r = np.asarray(rewards_GxN, np.float64)
  if r.ndim != 2:
    raise ValueError(f"rewards must be [groups, samples], got shape {r.shape}")
  r = r * opts.reward_scaling + opts.reward_bias
  n = r.shape[1]
  mean = r.mean(axis=1, keepdims=True)
  if opts.adv_norm == "group":
    ddof = 1 if (opts.group_std_unbiased and n > 1) else 0
    return (r - mean) / (r.std(axis=1, ddof=ddof, keepdims=True) + opts.adv_eps)
  if opts.adv_norm == "group_mean":
    return r - mean
  if opts.adv_norm == "rloo":
    if n < 2:
      raise ValueError("actor.adv_norm='rloo' needs at least 2 samples per group")
    return r - (r.sum(axis=1, keepdims=True) - r) / (n - 1)
  if opts.adv_norm == "none":
    return r
  raise ValueError(f"actor.adv_norm={opts.adv_norm!r} is not one of group, group_mean, rloo, none")


def batch_normalize(adv_S, num_tokens_S, eps: float) -> np.ndarray:
  """Token-weighted normalization over the batch: mean 0, std 1 over all generated tokens."""
  adv = np.asarray(adv_S, np.float64)
  w = np.asarray(num_tokens_S, np.float64)
  if w.sum() <= 0:
    return adv
  mean = np.sum(w * adv) / w.sum()
  std = np.sqrt(np.sum(w * (adv - mean) ** 2) / w.sum())
  return (adv - mean) / (std + eps)


def uniform_groups(rewards_GxN) -> int:
  """Number of groups whose rewards are all equal (they carry no signal: every advantage is 0)."""
  r = np.asarray(rewards_GxN, np.float64)
  return int(np.sum(np.all(r == r[:, :1], axis=1)))


def sequence_advantages(rewards_GxN, num_tokens_GxN, opts) -> np.ndarray:
  """The flat ``[G * N]`` per-sequence advantages: group step, then the optional batch step."""
  adv = group_advantages(rewards_GxN, opts).reshape(-1)
  if opts.batch_adv_norm:
    adv = batch_normalize(adv, np.asarray(num_tokens_GxN).reshape(-1), opts.adv_eps)
  return adv
