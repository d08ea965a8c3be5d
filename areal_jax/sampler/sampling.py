"""Token sampling with per-slot parameters: temperature, top-k, top-p, greedy, per-request seeds.

Every slot of a decode batch carries its own sampling parameters and its own PRNG key, so requests
with different settings share one compiled decode step.

Behaviour logprob: the logprob returned with a token is ``log softmax(logits / temperature)`` at that
token, the temperature-scaled distribution *before* top-k / top-p truncation. This is the quantity a
learner recomputes from its own forward at the same temperature (it does not need to know the
truncation). Greedy slots report the same quantity at the argmax token.

Randomness: the key of a step is ``fold_in(slot_key, position)``, so a sequence's draws depend only on
its request seed, its index in the group and the position, not on which slot it landed in or on what
else was batched with it. Sampling draws one uniform per slot and inverts the CDF (no Gumbel noise
over the vocabulary); top-k / top-p sort the vocabulary only when some slot asks for them: a runtime
``lax.cond``, or, where the caller knows it (``truncate``), a program with or without the sort (the
sampler's engine on GPU, ``kernels.choice.truncation_on_host``: XLA's GPU runtime reads a
conditional's predicate back to the host and waits for it, once a step).

Cost: the vocabulary is read twice per step in the common case: once for the maximum of every block
of ``_block(V)`` tokens, once for ``exp`` summed per block. The temperature is folded into both
passes (no scaled copy of the logits); the argmax is the first index of the maximum inside the first
block holding it, and the CDF is inverted in two levels (over the block sums, then inside the one
chosen block), so no full-vocabulary cumsum, argmax reduction or sort runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_NEG = -1e30


@jax.jit
def _fold_in(base_2, indices_N):
  base = jax.random.wrap_key_data(base_2)
  return jax.random.key_data(jax.vmap(lambda i: jax.random.fold_in(base, i))(indices_N))


def slot_keys(seed: int, n: int) -> jax.Array:
  """Raw uint32[n, 2] keys of samples ``0..n-1`` of a request seeded with ``seed``. Cheap on the
  host (it runs once per admitted request): one compiled call, n padded to a power of two."""
  base_2 = jax.random.key_data(jax.random.PRNGKey(seed))
  padded = 1 << max(n - 1, 0).bit_length()
  return _fold_in(base_2, np.arange(padded, dtype=np.int32))[:n]


def slot_key(seed: int, index: int) -> jax.Array:
  """Raw uint32[2] key for sample ``index`` of a request seeded with ``seed``."""
  base_2 = jax.random.key_data(jax.random.PRNGKey(seed))
  return _fold_in(base_2, np.asarray([index], np.int32))[0]


def scaled_log_probs(logits_SxV, temperature_S):
  """``log softmax(logits / temperature)`` in float32."""
  t = jnp.maximum(temperature_S.astype(jnp.float32), 1e-6)[:, None]
  return jax.nn.log_softmax(logits_SxV.astype(jnp.float32) / t, axis=-1)


def truncates(top_k_S, top_p_S, greedy_S):
  """Per slot: whether its parameters truncate the distribution it draws from (top-k or top-p,
  not greedy). NumPy or JAX arrays."""
  return ((top_k_S > 0) | (top_p_S < 1.0)) & ~greedy_S


def _truncation_floor(logp_SxV, top_k_S, top_p_S):
  """Per-slot logprob threshold: tokens below it are dropped by top-k / top-p (ties kept)."""
  v = logp_SxV.shape[-1]
  sorted_SxV = -jnp.sort(-logp_SxV, axis=-1)  # descending
  k = jnp.where(top_k_S > 0, jnp.minimum(top_k_S, v), v) - 1
  floor_k = jnp.take_along_axis(sorted_SxV, k[:, None], axis=-1)[:, 0]
  cum_SxV = jnp.cumsum(jnp.exp(sorted_SxV), axis=-1)
  # smallest prefix whose mass reaches top_p (the token that crosses p is kept)
  cut = jnp.sum(cum_SxV < top_p_S[:, None], axis=-1)
  cut = jnp.minimum(cut, v - 1)
  floor_p = jnp.take_along_axis(sorted_SxV, cut[:, None], axis=-1)[:, 0]
  floor_p = jnp.where(top_p_S >= 1.0, -jnp.inf, floor_p)
  return jnp.maximum(floor_k, floor_p)


def _block(v: int) -> int:
  """Tokens per block of the two-level CDF inversion: the largest divisor of ``v`` up to 256."""
  return max(b for b in range(1, min(v, 256) + 1) if v % b == 0)


def _uniform(key_Sx2, position_S):
  def one(key, pos):
    return jax.random.uniform(jax.random.fold_in(jax.random.wrap_key_data(key), pos))

  return jax.vmap(one)(key_Sx2, position_S)


def _in_block(blocks_SxNbxB, blk_S):
  """Row ``s`` of the result is block ``blk_S[s]`` of row ``s``."""
  return jnp.take_along_axis(blocks_SxNbxB, blk_S[:, None, None], axis=1)[:, 0]


def _masked_block(blocks_SxNbxB, blk_S):
  """``_in_block`` as a sum over the blocks of the one block kept per row (exact: the other
  terms are zeros)."""
  s, nb, _ = blocks_SxNbxB.shape
  hit_SxNbx1 = jax.lax.broadcasted_iota(jnp.int32, (s, nb, 1), 1) == blk_S[:, None, None]
  return jnp.sum(jnp.where(hit_SxNbx1, blocks_SxNbxB, 0.0), axis=1)


def _first(mask_SxN):
  """Index of the first true entry of every row (the row length if none)."""
  iota_SxN = jax.lax.broadcasted_iota(jnp.int32, mask_SxN.shape, 1)
  return jnp.min(jnp.where(mask_SxN, iota_SxN, mask_SxN.shape[1]), axis=-1)


def sample(logits_SxV, key_Sx2, position_S, temperature_S, top_k_S, top_p_S, greedy_S,
           select_by_mask: bool = False, truncate: bool | None = None):
  """Draws one token per slot; returns ``(token_S int32, logprob_S float32)``.

  ``truncate``: whether any slot truncates (top-k or top-p, not greedy), when the caller knows it
  (a program for each answer, no branch in it); None: decided in the program (``lax.cond``). Given
  as the program would find it, the tokens and logprobs are the same. True where no slot truncates
  keeps every token: the same draws up to the rounding of the kept mass's sums.

  ``select_by_mask``: each slot's block of the vocabulary (the argmax's, the drawn token's) is
  taken by a masked sum over the blocks (a read of the whole vocabulary) instead of a gather (the
  same values, so the same tokens and logprobs): what a TPU reads without relaying the logits out
  first (``kernels.choice.vocab_major_logits``)."""
  s, v = logits_SxV.shape
  bs = _block(v)
  nb = v // bs
  inv_t_S = 1.0 / jnp.maximum(temperature_S.astype(jnp.float32), 1e-6)
  l_SxNbxB = logits_SxV.astype(jnp.float32).reshape(s, nb, bs)
  # the barriers keep XLA's simplifier from turning the row totals below (max, sum) into second
  # reads of the whole vocabulary (64 x 49152: 3.5 -> 1.4 ms on CPU)
  bmax_SxNb = jax.lax.optimization_barrier(jnp.max(l_SxNbxB, axis=-1))  # pass 1
  lmax_S = jnp.max(bmax_SxNb, axis=-1)
  # the argmax (also the greedy token): the first maximum inside the first block that holds it
  in_block = _masked_block if select_by_mask else _in_block
  mblk_S = jnp.minimum(_first(bmax_SxNb == lmax_S[:, None]), nb - 1)
  argmax_S = mblk_S * bs + jnp.minimum(_first(in_block(l_SxNbxB, mblk_S) == lmax_S[:, None]), bs - 1)
  # e = exp(x - max x) with x = logits / temperature; max x = max logits / temperature
  e_SxNbxB = jnp.exp((l_SxNbxB - lmax_S[:, None, None]) * inv_t_S[:, None, None])
  sums_SxNb = jax.lax.optimization_barrier(jnp.sum(e_SxNbxB, axis=-1))  # pass 2
  lse_S = lmax_S * inv_t_S + jnp.log(jnp.sum(sums_SxNb, axis=-1))  # of x

  def truncated(logits_SxV, inv_t_S, lmax_S, lse_S, top_k_S, top_p_S):
    l_SxV = logits_SxV.astype(jnp.float32)
    x_SxV = l_SxV * inv_t_S[:, None]
    floor = _truncation_floor(x_SxV - lse_S[:, None], top_k_S, top_p_S) + lse_S
    # e computed as in pass 2 and level 2, so block masses and in-block CDFs round alike
    e_SxV = jnp.exp((l_SxV - lmax_S[:, None]) * inv_t_S[:, None])
    kept = jnp.where(x_SxV >= floor[:, None], e_SxV, 0.0)
    return floor, jnp.sum(kept.reshape(s, nb, bs), axis=-1)

  def whole(*_):
    return jnp.full((s,), -jnp.inf, jnp.float32), sums_SxNb

  args = (logits_SxV, inv_t_S, lmax_S, lse_S, top_k_S, top_p_S)
  if truncate is None:
    floor_S, kept_SxNb = jax.lax.cond(truncates(top_k_S, top_p_S, greedy_S).any(), truncated,
                                      whole, *args)
  else:
    floor_S, kept_SxNb = (truncated if truncate else whole)(*args)
  # level 1: the block holding the uniform's share of the kept mass
  cum_SxNb = jnp.cumsum(kept_SxNb, axis=-1)
  target_S = _uniform(key_Sx2, position_S) * cum_SxNb[:, -1]
  blk_S = jnp.minimum(jnp.sum(cum_SxNb <= target_S[:, None], axis=-1), nb - 1)
  below_S = jnp.take_along_axis(cum_SxNb - kept_SxNb, blk_S[:, None], axis=-1)[:, 0]
  # level 2: the token inside that block
  lb_SxB = in_block(l_SxNbxB, blk_S)
  xb_SxB = lb_SxB * inv_t_S[:, None]
  eb_SxB = jnp.where(xb_SxB >= floor_S[:, None], jnp.exp((lb_SxB - lmax_S[:, None]) * inv_t_S[:, None]), 0.0)
  j_S = jnp.minimum(jnp.sum(jnp.cumsum(eb_SxB, axis=-1) <= (target_S - below_S)[:, None], -1), bs - 1)
  # round-off can land on a dropped token (or an empty block): fall back to the argmax, always kept
  ok_S = jnp.take_along_axis(eb_SxB, j_S[:, None], axis=-1)[:, 0] > 0
  drawn_S = jnp.where(ok_S, blk_S * bs + j_S, argmax_S)
  token_S = jnp.where(greedy_S, argmax_S, drawn_S).astype(jnp.int32)
  l_S = jnp.take_along_axis(logits_SxV.astype(jnp.float32), token_S[:, None], axis=-1)[:, 0]
  return token_S, l_S * inv_t_S - lse_S
