"""The LM head's token logprobs and entropy, computed in chunks of positions.

The logits of a micro-batch are its biggest activation (tokens x vocabulary in float32: 16k tokens
of Qwen2.5's 151,936-entry vocabulary are 9.3 GiB, before their gradient). ``token_logprobs`` cuts
each row into chunks of positions and runs the head over them in a ``lax.scan``: one chunk's logits
exist at a time, forward and backward (``jax.checkpoint`` per chunk: the backward recomputes a
chunk's logits from its hidden states instead of keeping them). The gradient is exact, the same
sums in another order; the weight's gradient accumulates over the chunks.
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
                   chunk_tokens: int = 0):
  """``(logp_BxL, entropy_BxL)`` of ``softmax(linear(hidden, w) / T)``, as
  ``loss.token_logprobs`` of the full logits (position t scores token t+1; the last position
  gets 0), with at most ``chunk_tokens`` tokens' logits at once (0: all)."""
  b, l, e = hidden_BxLxE.shape
  c = chunk_len(l, b, chunk_tokens)

  def head(h_BxCxE, next_BxC, w):
    logits = linear(h_BxCxE, w, transpose_w, out_dtype=jnp.float32)
    logits = sharding.constrain(logits, ("batch", "length", "act_vocab"))
    return loss_lib.logprob_entropy(logits, next_BxC, temperature)

  next_BxL = jnp.roll(tokens_BxL, -1, axis=1)
  if c == l:
    logp_BxL, entropy_BxL = head(hidden_BxLxE, next_BxL, w)
  else:
    n = l // c
    h_NxBxCxE = hidden_BxLxE.reshape(b, n, c, e).swapaxes(0, 1)
    next_NxBxC = next_BxL.reshape(b, n, c).swapaxes(0, 1)
    step = jax.checkpoint(head)
    _, (logp_NxBxC, ent_NxBxC) = jax.lax.scan(lambda _, xs: (None, step(*xs, w)), None,
                                              (h_NxBxCxE, next_NxBxC))
    logp_BxL = logp_NxBxC.swapaxes(0, 1).reshape(b, l)
    entropy_BxL = ent_NxBxC.swapaxes(0, 1).reshape(b, l)
  last = jnp.arange(l) == l - 1
  return jnp.where(last, 0.0, logp_BxL), jnp.where(last, 0.0, entropy_BxL)
