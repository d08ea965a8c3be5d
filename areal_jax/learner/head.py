"""The LM head's token logprobs and entropy, computed in chunks of positions.

The logits of a micro-batch are its biggest activation (tokens x vocabulary in float32: 16k tokens
of Qwen2.5's 151,936-entry vocabulary are 9.3 GiB, before their gradient). ``token_logprobs`` cuts
each row into chunks of positions and runs the head over them in a ``lax.scan``: one chunk's logits
exist at a time, forward and backward (``jax.checkpoint`` per chunk: the backward recomputes a
chunk's logits from its hidden states instead of keeping them). The gradient is exact, the same
sums in another order; the weight's gradient accumulates over the chunks. Where the rows' positions
are split over devices (the mesh's ``context`` axis), each chunk takes the same positions from every
device's block, so no chunk moves positions between devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from areal_jax import sharding
from areal_jax.learner import loss as loss_lib
from areal_jax.models.transformer import linear


def chunk_len(row_len: int, rows: int, chunk_tokens: int) -> int:
  """Positions per row in one chunk: the largest divisor of ``row_len`` with at most
  ``chunk_tokens`` tokens over the ``rows`` rows (at least 1); ``row_len`` when ``chunk_tokens``
  is 0 (no chunking)."""
  if chunk_tokens <= 0:
    return row_len
  target = max(1, chunk_tokens // max(rows, 1))
  return max(d for d in range(1, min(target, row_len) + 1) if row_len % d == 0)


def token_logprobs(hidden_BxLxE, w, transpose_w: bool, tokens_BxL, temperature: float,
                   chunk_tokens: int = 0, ids_BxLxK=None):
  """``(logp_BxL, entropy_BxL)`` of ``softmax(linear(hidden, w) / T)``, as
  ``loss.token_logprobs`` of the full logits (position t scores token t+1; the last position
  gets 0), with at most ``chunk_tokens`` tokens' logits at once (0: all). With ``ids_BxLxK``,
  a third output: the logprobs of those tokens at each position (``[B, L, K]``, distill.py)."""
  b, l, e = hidden_BxLxE.shape
  s = sharding.num_shards("length", l)  # blocks of each row on devices of their own
  c = chunk_len(l // s, b * s, chunk_tokens)

  def head(h_BxCxE, next_BxC, w, *ids_BxCxK):
    h_BxCxE = sharding.constrain(h_BxCxE, ("batch", "length", "act_embed"))
    logits = linear(h_BxCxE, w, transpose_w, out_dtype=jnp.float32)
    logits = sharding.constrain(logits, ("batch", "length", "act_vocab"))
    out = loss_lib.logprob_entropy(logits, next_BxC, temperature)
    if ids_BxCxK:  # given tokens' logprobs too (one more pass over the vocabulary)
      z = logits / temperature
      lse = jax.nn.logsumexp(z, axis=-1, keepdims=True)
      out = (*out, jnp.take_along_axis(z, ids_BxCxK[0], axis=-1) - lse)
    return out

  next_BxL = jnp.roll(tokens_BxL, -1, axis=1)
  ids = () if ids_BxLxK is None else (ids_BxLxK,)
  if c * s == l:
    logp_BxL, entropy_BxL, *ids_logp = head(hidden_BxLxE, next_BxL, w, *ids)
  else:
    # chunk k holds positions [k c, (k + 1) c) of each of the row's s blocks
    n = l // s // c
    split = lambda x: jnp.moveaxis(x.reshape((b, s, n, c) + x.shape[2:]), 2, 0).reshape(
        (n, b, s * c) + x.shape[2:])  # noqa: E731
    merge = lambda x: jnp.moveaxis(x.reshape(n, b, s, c), 0, 2).reshape(b, l)  # noqa: E731
    step = jax.checkpoint(head)
    _, (logp_NxBxC, ent_NxBxC, *ids_logp) = jax.lax.scan(
        lambda _, xs: (None, step(xs[0], xs[1], w, *xs[2:])), None,
        (split(hidden_BxLxE), split(next_BxL), *map(split, ids)))
    logp_BxL, entropy_BxL = merge(logp_NxBxC), merge(ent_NxBxC)
    ids_logp = [jnp.moveaxis(x.reshape((n, b, s, c) + x.shape[3:]), 0, 2).reshape(
        (b, l) + x.shape[3:]) for x in ids_logp]
  last = jnp.arange(l) == l - 1
  return (jnp.where(last, 0.0, logp_BxL), jnp.where(last, 0.0, entropy_BxL),
          *(jnp.where(last[:, None], 0.0, x) for x in ids_logp))
