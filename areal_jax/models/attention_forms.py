"""The attention forms a layer runs, and the rotary embedding its queries and keys take.

  * ``rope_tables`` / ``rope``: rotary angles once per forward, applied in the "rotate half"
    layout of Hugging Face Llama and Qwen.
  * Whole rows (training, prefill): ``attention`` (grouped-query, dense), ``causal_attention``
    (the same without the upper triangle, in query blocks), ``packed_mask`` (causal, inside a
    segment), ``row_attention`` (the form ``kernels.choice.causal_attention`` picks: dense, or a
    flash kernel over segment ids) and ``prefill_kernel_attention``.
  * One query per row (decode): ``decode_attention`` over a dense, heads-major, stacked or paged
    cache, ``decode_step_paged`` and ``decode_step_rotating`` (a step's write and read as the
    kernels package does them).
Which kernel runs is ``areal_jax.kernels.choice``'s decision; these functions only shape the
arguments and results around it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from areal_jax.kernels import attention as attention_kernels
from areal_jax.kernels import causal_attention as causal_kernels
from areal_jax.kernels import choice, xla_attention

def rope_tables(positions_BxL, head_dim: int, theta: float):
  """``(cos, sin)`` of the rotary angles, each ``[B, L, head_dim // 2]``, computed once per forward
  and shared by every layer.

  On CPU (``choice.rope_tables_materialized``): XLA fuses elementwise producers into their
  consumers, so left alone it re-evaluates ``cos`` and ``sin`` for every head inside every layer's
  q and k fusions (4.6 ms of a 64-slot SmolLM2 decode step on CPU; 0.5 ms with the tables read
  instead). An optimization barrier does not stop it (XLA:CPU removes barriers before fusion); a
  product with the identity does: the matmul's output is a buffer the layers read, exact at
  ``Precision.HIGHEST``. On GPU and TPU, where that product is a kernel of its own (a cuBLAS GEMM
  and two fusions around it in a GPU decode step) and re-evaluating the angles costs little, the
  tables are left to XLA: the same values."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles_BxLxF = positions_BxL[..., None].astype(jnp.float32) * inv_freq
  if not choice.rope_tables_materialized():
    return jnp.cos(angles_BxLxF), jnp.sin(angles_BxLxF)
  cs_BxLx2F = jnp.concatenate([jnp.cos(angles_BxLxF), jnp.sin(angles_BxLxF)], axis=-1)
  cs_BxLx2F = jnp.matmul(cs_BxLx2F, jnp.eye(head_dim, dtype=jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
  return cs_BxLx2F[..., : head_dim // 2], cs_BxLx2F[..., head_dim // 2 :]


def rope(x_BxLxHxD, tables):
  """Rotary embedding in the 'rotate half' layout used by Hugging Face Llama and Qwen2;
  ``tables`` from ``rope_tables``."""
  d = x_BxLxHxD.shape[-1]
  cos, sin = (t[:, :, None, :] for t in tables)
  x = x_BxLxHxD.astype(jnp.float32)
  x1, x2 = x[..., : d // 2], x[..., d // 2 :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxHxD.dtype)


def attention(q_BxLxHxD, k_BxTxKxD, v_BxTxKxD, mask_BxLxT):
  """Grouped-query attention; K/V heads are shared by H // K query heads without copying."""
  b, l, h, d = q_BxLxHxD.shape
  kv = k_BxTxKxD.shape[2]
  q = q_BxLxHxD.reshape(b, l, kv, h // kv, d)
  scores = jnp.einsum("blkgd,btkd->bkglt", q, k_BxTxKxD, preferred_element_type=jnp.float32)
  scores = scores * (d**-0.5)
  scores = jnp.where(mask_BxLxT[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BxTxKxD.dtype)
  out = jnp.einsum("bkglt,btkd->blkgd", probs, v_BxTxKxD)
  return out.reshape(b, l, h, d)


CAUSAL_BLOCK = 64  # query positions per block of ``causal_attention`` (at least)
CAUSAL_BLOCKS = 16  # at most this many blocks: longer rows get longer blocks


def causal_attention(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask_BxLxL, block: int | None = None):
  """``attention`` for a causal ``mask`` (query i never sees key j > i), without computing the
  upper triangle: queries are cut into blocks of ``block`` positions and block i attends only to
  keys ``[0, (i + 1) * block)``. That computes about half the scores of the dense form, in pieces
  small enough to stay in the CPU cache (a row of L positions costs (L / block + 1) / 2 query
  blocks' worth of dense work instead of L / block). The blocks are unrolled in the program, so
  rows longer than ``CAUSAL_BLOCKS`` blocks get longer blocks (a multiple of ``block``): at most
  ``CAUSAL_BLOCKS`` pieces, whatever the length (compile time stays flat in it; 16 blocks compute
  about 5% more scores than 64).
  Rows whose mask is all False (padding) get a uniform average over their block's keys, which
  differs from the dense form; their outputs are meaningless either way."""
  l, block = q_BxLxHxD.shape[1], block or CAUSAL_BLOCK
  block *= -(-l // (block * CAUSAL_BLOCKS))
  if l <= block:
    return attention(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask_BxLxL)
  outs = []
  for start in range(0, l, block):
    end = min(start + block, l)
    outs.append(attention(q_BxLxHxD[:, start:end], k_BxLxKxD[:, :end], v_BxLxKxD[:, :end],
                          mask_BxLxL[:, start:end, :end]))
  return jnp.concatenate(outs, axis=1)


def packed_mask(segment_ids_BxL, b: int, l: int):
  """``[B, L, L]`` attention mask of packed rows: causal, inside a segment, never to padding."""
  mask_BxLxL = jnp.broadcast_to(jnp.tril(jnp.ones((l, l), jnp.bool_)), (b, l, l))
  if segment_ids_BxL is not None:
    same = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
    mask_BxLxL = mask_BxLxL & same & (segment_ids_BxL[:, None, :] > 0)
  return mask_BxLxL


def row_attention(segment_ids_BxL, b: int, l: int, head_dim: int, impl: str = "auto"):
  """``(attend_with, seen)``: causal attention of whole rows of ``l`` positions from position 0
  (packed segments where ``segment_ids_BxL`` is given) as ``impl`` runs it
  (``kernels.choice.causal_attention``), where ``attend_with(seen)`` is a ``Block``'s
  ``attend(q, k, v)`` and ``seen`` what it reads besides them: ``"dense"``, ``causal_attention``
  over ``packed_mask``; a flash kernel on GPU and TPU (``kernels.causal_attention``) over the
  segment ids, with no ``L x L`` mask or scores. Padding positions' outputs differ between the
  forms (meaningless in both)."""
  impl, interpret = choice.causal_attention(impl, head_dim)
  if impl == "dense":
    return (lambda mask: lambda q, k, v: causal_attention(q, k, v, mask),
            packed_mask(segment_ids_BxL, b, l))
  return (lambda ids: lambda q, k, v: causal_kernels.attend(q, k, v, ids, impl, interpret),
          segment_ids_BxL)


def prefill_kernel_attention(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, cache_dtype, impl: str):
  """A prefill's attention (every row from position 0) over the chunk's own keys and values as
  the causal kernel ``impl`` (``kernels.causal_attention``), the keys and values in the cache's
  dtype, as the dense form reads them from the cache."""
  return causal_kernels.attend(q_BxLxHxD, k_BxLxKxD.astype(cache_dtype),
                               v_BxLxKxD.astype(cache_dtype), None, impl, choice.interpret_here())


DECODE_CHUNK = xla_attention.CHUNK  # cache positions per step of the "xla" decode attention loop
DECODE_GROUP = xla_attention.GROUP  # rows per group of that loop (rows sorted by position)


def decode_attention(q_Bx1xHxD, k_BxTxKxD, v_BxTxKxD, pos_B, kv_len: int | None = None,
                     chunk: int = DECODE_CHUNK, group: int = DECODE_GROUP, impl: str | None = None,
                     heads_major: bool = False, layer=None, cache_axes=None, pages=None):
  """One query per row (a decode step) attending to cache positions ``0..pos_B[b]`` (never beyond
  ``kv_len``); the cache may have more rows than the queries (rows ``[0, B)`` are read).
  ``heads_major``: the cache is ``[B, K, T, D]`` instead (the layers-in-a-scan decode's layout);
  with ``layer`` (traced) too, it is the whole stacked cache ``[L, R, K, T, D]`` (logical axes
  ``cache_axes``) and that layer is read. With ``pages`` (a page table ``[B, N]``), they are the
  paged cache's pools ``[K, L, M, P, D]`` (``kernels.paged_attention``) and ``kv_len`` is required.

  Which form runs is the kernels package's choice (``areal_jax.kernels.choice``): ``impl`` names
  one, None takes the default backend's (on CPU the C++ kernel, each row read only up to its own
  position; on GPU and TPU one dense read; ``chunk``/``group`` shape the ``"xla"`` form's loops).
  """
  b, _, h, d = q_Bx1xHxD.shape
  if pages is not None:
    kv = k_BxTxKxD.shape[0]
    q_BxKxGxD = q_Bx1xHxD.reshape(b, kv, h // kv, d).astype(jnp.float32) * (d**-0.5)
    out_BxKxGxD = attention_kernels.decode_attention_paged(
        q_BxKxGxD, k_BxTxKxD, v_BxTxKxD, layer, pages, pos_B, kv_len, impl)
    return out_BxKxGxD.reshape(b, 1, h, d).astype(v_BxTxKxD.dtype)
  kv, t_axis = (k_BxTxKxD.shape[-3], -2) if heads_major else (k_BxTxKxD.shape[2], 1)
  t = k_BxTxKxD.shape[t_axis] if kv_len is None else min(kv_len, k_BxTxKxD.shape[t_axis])
  q_BxKxGxD = q_Bx1xHxD.reshape(b, kv, h // kv, d).astype(jnp.float32) * (d**-0.5)
  if layer is not None:
    out_BxKxGxD = attention_kernels.decode_attention_stacked(
        q_BxKxGxD, k_BxTxKxD, v_BxTxKxD, layer, pos_B, t, impl, chunk, group, cache_axes)
    return out_BxKxGxD.reshape(b, 1, h, d).astype(v_BxTxKxD.dtype)
  attend = (attention_kernels.decode_attention_heads_major if heads_major
            else attention_kernels.decode_attention)
  out_BxKxGxD = attend(q_BxKxGxD, k_BxTxKxD, v_BxTxKxD, pos_B, t, impl, chunk, group)
  return out_BxKxGxD.reshape(b, 1, h, d).astype(v_BxTxKxD.dtype)


def decode_step_paged(q_Bx1xHxD, k_Bx1xKxD, v_Bx1xKxD, k_pool, v_pool, layer, pages_BxN,
                      page_B, offset_B, pos_B, kv_len: int, impl: str | None = None):
  """A decode step of layer ``layer`` over the paged cache's pools ``[K, L, M, P, D]``
  (``kernels.paged_attention``): row ``b``'s new key and value written at page ``page_B[b]``,
  offset ``offset_B[b]``, then ``decode_attention`` over its pages (``pages_BxN``). The kernels
  package decides whether that is one kernel. Returns ``(out_Bx1xHxD, k_pool, v_pool)``."""
  b, _, h, d = q_Bx1xHxD.shape
  kv = k_pool.shape[0]
  out_BxKxGxD, k_pool, v_pool = attention_kernels.decode_step_paged(
      q_Bx1xHxD.reshape(b, kv, h // kv, d), k_Bx1xKxD[:, 0], v_Bx1xKxD[:, 0], k_pool, v_pool,
      layer, pages_BxN, page_B, offset_B, pos_B, kv_len, d**-0.5, impl)
  return out_BxKxGxD.reshape(b, 1, h, d).astype(v_pool.dtype), k_pool, v_pool  # as cached


def decode_step_rotating(qkv_Bx1xKxSxD, rope_BxLxF, k_pool, v_pool, layer, pages_BxN, page_B,
                         offset_B, pos_B, kv_len: int):
  """``decode_step_paged`` from the fused projection before rope (``Attention.fused_qkv``), the
  kernels' one kernel rotating it (only where ``kernels.attention.one_kernel_step``)."""
  b, _, kv, s, d = qkv_Bx1xKxSxD.shape
  cos_BxF, sin_BxF = (t[:, 0] for t in rope_BxLxF)
  out_BxKxGxD, k_pool, v_pool = attention_kernels.decode_step_rotating(
      qkv_Bx1xKxSxD[:, 0], cos_BxF, sin_BxF, k_pool, v_pool, layer, pages_BxN, page_B, offset_B,
      pos_B, kv_len, d**-0.5)
  return out_BxKxGxD.reshape(b, 1, kv * (s - 2), d).astype(v_pool.dtype), k_pool, v_pool
