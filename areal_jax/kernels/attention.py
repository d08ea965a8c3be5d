"""Decode attention as the model asks for it: ``decode_attention(q, k, v, pos, t, impl)`` runs the
implementation ``impl`` (``choice.ATTENTION``; None: ``choice.attention`` for the default backend);
``decode_attention_heads_major`` / ``decode_attention_stacked`` take the scanned decode's layouts.

Every form returns the same result (softmax attention of one query per row over cache positions
``0..pos_B[b]``, float32); they differ in what they read and how.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from areal_jax.kernels import (choice, cpu_attention, paged_attention, pallas_attention,
                               pallas_tpu_attention, xla_attention)


def decode_attention(q_BxKxGxD, k_RxTxKxD, v_RxTxKxD, pos_B, t: int, impl: str | None = None,
                     chunk: int = xla_attention.CHUNK, group: int = xla_attention.GROUP):
  """Pre-scaled queries ``[B, K, G, D]`` (rows ``[0, B)`` of a cache of R >= B rows) attending to
  positions ``0..pos_B[b]`` (``t``: static bound); float32 ``[B, K, G, D]``."""
  impl = impl or choice.attention(choice.platform_of(None))
  if impl == "cpu" and cpu_attention.usable(q_BxKxGxD, k_RxTxKxD):
    return cpu_attention.decode_attention(q_BxKxGxD, k_RxTxKxD, v_RxTxKxD, pos_B, t)
  if impl == "pallas_gpu" and pallas_attention.usable(t):
    return pallas_attention.decode_attention(q_BxKxGxD, k_RxTxKxD, v_RxTxKxD, pos_B, t,
                                             interpret=choice.interpret())
  if impl in ("dense", "pallas_gpu", "pallas_tpu"):  # the TPU kernel: stacked cache only
    return xla_attention.dense(q_BxKxGxD, k_RxTxKxD, v_RxTxKxD, pos_B, t,
                               choice.query_rows(k_RxTxKxD.dtype))
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
        q_BxKxGxD, k_RxKxTxD, v_RxKxTxD, pos_B, t, interpret=choice.interpret())
  if impl in ("dense", "pallas_gpu", "pallas_tpu"):  # the TPU kernel: stacked cache only
    return xla_attention.dense_heads_major(q_BxKxGxD, k_RxKxTxD, v_RxKxTxD, pos_B, t,
                                           choice.query_rows(k_RxKxTxD.dtype))
  b = q_BxKxGxD.shape[0]
  k_BxTxKxD, v_BxTxKxD = (jnp.swapaxes(x[:b, :, :t], 1, 2) for x in (k_RxKxTxD, v_RxKxTxD))
  return decode_attention(q_BxKxGxD, k_BxTxKxD, v_BxTxKxD, pos_B, t, impl, chunk, group)


def decode_attention_stacked(q_BxKxGxD, k_LxRxKxTxD, v_LxRxKxTxD, layer, pos_B, t: int,
                             impl: str | None = None, chunk: int = xla_attention.CHUNK,
                             group: int = xla_attention.GROUP, cache_axes=None):
  """``decode_attention`` of rows ``[0, B)`` over layer ``layer`` (traced: the scan's index) of
  the stacked heads-major cache ``[L, R, K, T, D]`` (logical axes ``cache_axes``). The Pallas
  kernels read the whole stack in place as pages (``stacked_pages``: the TPU kernel over a
  bfloat16 cache, the GPU paged kernel where the positions split into pages); every other form
  gets that layer's rows ``[0, B)`` and positions ``[0, t)`` (``decode_attention_heads_major``)."""
  impl = impl or choice.attention(choice.platform_of(None))
  b, kv, _, d = q_BxKxGxD.shape
  interpret = choice.interpret()
  if impl == "pallas_tpu" and pallas_tpu_attention.unusable(
      "scan", k_LxRxKxTxD.dtype, k_LxRxKxTxD.shape[3], d, compiled=not interpret) is None:
    return pallas_tpu_attention.decode_attention_stacked(
        q_BxKxGxD, k_LxRxKxTxD, v_LxRxKxTxD, layer, pos_B, cache_axes, interpret)
  if impl == "pallas_gpu" and pallas_attention.stacked_usable(k_LxRxKxTxD.shape[3]):
    return pallas_attention.decode_attention_stacked(
        q_BxKxGxD, k_LxRxKxTxD, v_LxRxKxTxD, layer, pos_B, cache_axes, interpret,
        choice.pallas_gpu_tuning(), t)
  k_BxKxTxD, v_BxKxTxD = (jax.lax.dynamic_slice(x, (layer, 0, 0, 0, 0), (1, b, kv, t, d))[0]
                          for x in (k_LxRxKxTxD, v_LxRxKxTxD))
  return decode_attention_heads_major(q_BxKxGxD, k_BxKxTxD, v_BxKxTxD, pos_B, t, impl, chunk,
                                      group)


def decode_attention_paged(q_BxKxGxD, k_KxLxMxPxD, v_KxLxMxPxD, layer, table_BxN, pos_B, t: int,
                           impl: str | None = None):
  """``decode_attention`` over the paged cache's pools (``paged_attention``): the Pallas kernels
  read the pages in place, every other form reads them gathered up to the bound ``t``."""
  impl = impl or choice.attention(choice.platform_of(None))
  return paged_attention.decode_attention_paged(q_BxKxGxD, k_KxLxMxPxD, v_KxLxMxPxD, layer,
                                                table_BxN, pos_B, t, impl,
                                                interpret=choice.interpret(),
                                                rows=choice.query_rows(k_KxLxMxPxD.dtype),
                                                tuning=choice.pallas_gpu_tuning())


def decode_step_paged(q_BxKxGxD, k_new_BxKxD, v_new_BxKxD, k_KxLxMxPxD, v_KxLxMxPxD, layer,
                      table_BxN, page_B, offset_B, pos_B, t: int, scale: float,
                      impl: str | None = None):
  """A layer's decode step over the paged cache's pools (``paged_attention.decode_step_paged``):
  the new keys and values written, then ``decode_attention_paged`` of the queries times
  ``scale``. ``(out, k_pool, v_pool)``."""
  impl = impl or choice.attention(choice.platform_of(None))
  return paged_attention.decode_step_paged(q_BxKxGxD, k_new_BxKxD, v_new_BxKxD, k_KxLxMxPxD,
                                           v_KxLxMxPxD, layer, table_BxN, page_B, offset_B,
                                           pos_B, t, impl, scale, interpret=choice.interpret(),
                                           rows=choice.query_rows(k_KxLxMxPxD.dtype),
                                           tuning=choice.pallas_gpu_tuning())


def one_kernel_step(impl: str | None, group: int, page: int, head_dim: int) -> bool:
  """Whether a paged decode step of ``group`` queries per K/V head (pages of ``page``, heads of
  ``head_dim``) runs as our one kernel, so it can take the projections before rope
  (``decode_step_rotating``)."""
  impl = impl or choice.attention(choice.platform_of(None))
  return paged_attention.one_kernel(impl, group, page, head_dim, choice.pallas_gpu_tuning())


def decode_step_rotating(qkv_BxKxSxD, cos_BxF, sin_BxF, k_KxLxMxPxD, v_KxLxMxPxD, layer,
                         table_BxN, page_B, offset_B, pos_B, t: int, scale: float):
  """``decode_step_paged`` from the fused projection before rope, rotated in our kernel (where
  ``one_kernel_step``; ``paged_attention.decode_step_rotating``)."""
  return paged_attention.decode_step_rotating(qkv_BxKxSxD, cos_BxF, sin_BxF, k_KxLxMxPxD,
                                              v_KxLxMxPxD, layer, table_BxN, page_B, offset_B,
                                              pos_B, t, scale, interpret=choice.interpret(),
                                              tuning=choice.pallas_gpu_tuning())
