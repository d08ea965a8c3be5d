"""Decode attention as the model asks for it: ``decode_attention(q, k, v, pos, t, impl)`` runs the
implementation ``impl`` (``choice.ATTENTION``; None: ``choice.attention`` for the default backend).

Every form returns the same result (softmax attention of one query per row over cache positions
``0..pos_B[b]``, float32); they differ in what they read and how.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from areal_jax.kernels import choice, cpu_attention, pallas_attention, xla_attention


def decode_attention(q_BxKxGxD, k_RxTxKxD, v_RxTxKxD, pos_B, t: int, impl: str | None = None,
                     chunk: int = xla_attention.CHUNK, group: int = xla_attention.GROUP):
  """Pre-scaled queries ``[B, K, G, D]`` (rows ``[0, B)`` of a cache of R >= B rows) attending to
  positions ``0..pos_B[b]`` (``t``: static bound); float32 ``[B, K, G, D]``."""
  impl = impl or choice.attention(choice.platform_of(None))
  if impl == "cpu" and cpu_attention.usable(q_BxKxGxD, k_RxTxKxD):
    return cpu_attention.decode_attention(q_BxKxGxD, k_RxTxKxD, v_RxTxKxD, pos_B, t)
  if impl == "pallas_gpu" and pallas_attention.usable(t):
    return pallas_attention.decode_attention(q_BxKxGxD, k_RxTxKxD, v_RxTxKxD, pos_B, t,
                                             interpret=jax.default_backend() == "cpu")
  if impl in ("dense", "pallas_gpu"):
    return xla_attention.dense(q_BxKxGxD, k_RxTxKxD, v_RxTxKxD, pos_B, t)
  # "xla", and "cpu" where the kernel cannot take the call (a bfloat16 cache, split rows)
  return xla_attention.chunked(q_BxKxGxD.astype(jnp.float32), k_RxTxKxD, v_RxTxKxD, pos_B, t,
                               chunk, group)


def decode_attention_heads_major(q_BxKxGxD, k_RxKxTxD, v_RxKxTxD, pos_B, t: int,
                                 impl: str | None = None, chunk: int = xla_attention.CHUNK,
                                 group: int = xla_attention.GROUP):
  """``decode_attention`` over a heads-major cache ``[R, K, T, D]`` (the layers-in-a-scan decode's
  layout). The dense and Pallas forms read it in place; the CPU and chunked forms take
  ``[R, T, K, D]`` and get a transposed copy of the rows they read (CPU only: on GPU and TPU the
  choice is dense)."""
  impl = impl or choice.attention(choice.platform_of(None))
  if impl == "pallas_gpu" and pallas_attention.usable(t):
    return pallas_attention.decode_attention_heads_major(
        q_BxKxGxD, k_RxKxTxD, v_RxKxTxD, pos_B, t, interpret=jax.default_backend() == "cpu")
  if impl in ("dense", "pallas_gpu"):
    return xla_attention.dense_heads_major(q_BxKxGxD, k_RxKxTxD, v_RxKxTxD, pos_B, t)
  b = q_BxKxGxD.shape[0]
  k_BxTxKxD, v_BxTxKxD = (jnp.swapaxes(x[:b, :, :t], 1, 2) for x in (k_RxKxTxD, v_RxKxTxD))
  return decode_attention(q_BxKxGxD, k_BxTxKxD, v_BxTxKxD, pos_B, t, impl, chunk, group)
