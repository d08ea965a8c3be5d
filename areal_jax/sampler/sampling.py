"""Token sampling with per-slot parameters: temperature, top-k, top-p, greedy, per-request seeds.

Every slot of a decode batch carries its own sampling parameters and its own PRNG key, so requests
with different settings share one compiled decode step.

Behaviour logprob: the logprob returned with a token is ``log softmax(logits / temperature)`` at that
token, the temperature-scaled distribution *before* top-k / top-p truncation. This is the quantity a
learner recomputes from its own forward at the same temperature (it does not need to know the
truncation). Greedy slots report the same quantity at the argmax token.

Randomness: the key of a step is ``fold_in(slot_key, position)``, so a sequence's draws depend only on
its request seed, its index in the group and the position, not on which slot it landed in or on what
else was batched with it. Sampling draws one uniform per slot and inverts the CDF (``O(V)``, no
Gumbel noise over the vocabulary); top-k / top-p sort the vocabulary only when some slot asks for
them (a runtime ``lax.cond``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30


def slot_key(seed: int, index: int) -> jax.Array:
  """Raw uint32[2] key for sample ``index`` of a request seeded with ``seed``."""
  return jax.random.key_data(jax.random.fold_in(jax.random.PRNGKey(seed), index))


def slot_keys(seed: int, n: int) -> jax.Array:
  """Raw uint32[n, 2] keys of samples ``0..n-1`` of a request seeded with ``seed``."""
  base = jax.random.PRNGKey(seed)
  return jax.random.key_data(jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(n)))


def scaled_log_probs(logits_SxV, temperature_S):
  """``log softmax(logits / temperature)`` in float32."""
  t = jnp.maximum(temperature_S.astype(jnp.float32), 1e-6)[:, None]
  return jax.nn.log_softmax(logits_SxV.astype(jnp.float32) / t, axis=-1)


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


def sample(logits_SxV, key_Sx2, position_S, temperature_S, top_k_S, top_p_S, greedy_S):
  """Draws one token per slot; returns ``(token_S int32, logprob_S float32)``."""
  logp_SxV = scaled_log_probs(logits_SxV, temperature_S)
  truncate = jnp.any(((top_k_S > 0) | (top_p_S < 1.0)) & ~greedy_S)
  floor_S = jax.lax.cond(
      truncate, _truncation_floor,
      lambda lp, k, p: jnp.full(lp.shape[:1], -jnp.inf, lp.dtype),
      logp_SxV, top_k_S, top_p_S)
  kept_SxV = jnp.where(logp_SxV >= floor_S[:, None], logp_SxV, _NEG)
  probs_SxV = jnp.exp(kept_SxV - jnp.max(kept_SxV, axis=-1, keepdims=True))
  cdf_SxV = jnp.cumsum(probs_SxV, axis=-1)

  def uniform(key, pos):
    return jax.random.uniform(jax.random.fold_in(jax.random.wrap_key_data(key), pos))

  u_S = jax.vmap(uniform)(key_Sx2, position_S) * cdf_SxV[:, -1]
  drawn_S = jnp.sum(cdf_SxV <= u_S[:, None], axis=-1)
  # guard the edge u == total and round-off: never pick a dropped token
  drawn_S = jnp.minimum(drawn_S, logp_SxV.shape[-1] - 1)
  drawn_ok = jnp.take_along_axis(kept_SxV, drawn_S[:, None], axis=-1)[:, 0] > _NEG / 2
  drawn_S = jnp.where(drawn_ok, drawn_S, jnp.argmax(kept_SxV, axis=-1))
  token_S = jnp.where(greedy_S, jnp.argmax(logits_SxV, axis=-1), drawn_S).astype(jnp.int32)
  logprob_S = jnp.take_along_axis(logp_SxV, token_S[:, None], axis=-1)[:, 0]
  return token_S, logprob_S
