"""Advantages from per-sample rewards (REFERENCE section 4); host-side NumPy."""

from __future__ import annotations

import numpy as np


def group_advantages(rewards_GxN, opts) -> np.ndarray:
  """Scaled, biased rewards normalized within each group of ``N`` samples."""
  r = np.asarray(rewards_GxN, np.float64) * opts.reward_scaling + opts.reward_bias
  n = r.shape[1]
  mean = r.mean(axis=1, keepdims=True)
  if opts.adv_norm == "group":
    ddof = 1 if (opts.group_std_unbiased and n > 1) else 0
    return (r - mean) / (r.std(axis=1, ddof=ddof, keepdims=True) + opts.adv_eps)
  if opts.adv_norm == "group_mean":
    return r - mean
  if opts.adv_norm == "rloo":
    if n < 2:
      raise ValueError("adv_norm='rloo' needs at least 2 samples per group")
    return r - (r.sum(axis=1, keepdims=True) - r) / (n - 1)
  if opts.adv_norm == "none":
    return r
  raise ValueError(f"actor.adv_norm={opts.adv_norm!r} is not one of group, group_mean, rloo, none")


def batch_normalize(adv_S, lengths_S, eps: float) -> np.ndarray:
  """Token-weighted normalization over the batch (each sequence counts once per generated token)."""
  w = np.asarray(lengths_S, np.float64)
  mean = np.sum(w * adv_S) / w.sum()
  std = np.sqrt(np.sum(w * (adv_S - mean) ** 2) / w.sum())
  return (adv_S - mean) / (std + eps)
