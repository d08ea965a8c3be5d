"""Decode attention in plain XLA ops: one query per row attending to cache positions ``0..pos_B[b]``.

Queries come pre-scaled (``q * head_dim**-0.5``) as ``[B, K, G, D]`` (K/V heads x queries per K/V
head); outputs are float32 ``[B, K, G, D]``. The cache may have more rows than the queries: rows
``[0, B)`` are read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from areal_jax import sharding

CHUNK = 32  # cache positions per step of the chunked loop
GROUP = 16  # rows per group of the chunked loop (rows sorted by position)


def _dense(q_BxKxGxD, k, v, pos_B, t: int, kv: str, rows: int = 1):
  """Masked softmax attention of one query per row over keys/values laid out as ``kv`` (einsum
  letters: b row, t position, k head, d feature), positions ``[0, t)``; each head's group of
  queries padded with zero queries to a multiple of ``rows`` for the matmuls, their rows dropped
  (``choice.query_rows``)."""
  g, pad = q_BxKxGxD.shape[2], -q_BxKxGxD.shape[2] % rows
  if pad:
    q_BxKxGxD = jnp.pad(q_BxKxGxD, ((0, 0), (0, 0), (0, pad), (0, 0)))
  s_BxKxGxT = jnp.einsum(f"bkgd,{kv}->bkgt", q_BxKxGxD.astype(k.dtype), k,
                         preferred_element_type=jnp.float32)
  valid_BxT = jnp.arange(t)[None, :] <= pos_B[:, None]
  s_BxKxGxT = jnp.where(valid_BxT[:, None, None], s_BxKxGxT, -jnp.inf)
  p_BxKxGxT = jax.nn.softmax(s_BxKxGxT, axis=-1)
  out_BxKxGxD = jnp.einsum(f"bkgt,{kv}->bkgd", p_BxKxGxT.astype(v.dtype), v,
                           preferred_element_type=jnp.float32)
  return out_BxKxGxD[:, :, :g] if pad else out_BxKxGxD


def dense(q_BxKxGxD, k_RxTxKxD, v_RxTxKxD, pos_B, t: int, rows: int = 1):
  """One read of cache positions ``[0, t)`` of every row, masked past each row's position: no loop
  and no gather, what XLA on GPU and TPU turns into a few fused, bandwidth-bound passes (``rows``:
  ``_dense``)."""
  b = q_BxKxGxD.shape[0]
  return _dense(q_BxKxGxD, k_RxTxKxD[:b, :t], v_RxTxKxD[:b, :t], pos_B, t, "btkd", rows)


def dense_heads_major(q_BxKxGxD, k_RxKxTxD, v_RxKxTxD, pos_B, t: int, rows: int = 1):
  """``dense`` over a heads-major cache ``[R, K, T, D]`` (the scanned decode's layout): the two
  einsums' batch dimensions (row, head) lead and are contiguous in the cache, so they can run as
  one strided batched matmul each, with no transposing copy of the cache (the ``[R, T, K, D]``
  layout needs one per layer and step: seen in XLA:CPU's optimized program)."""
  b = q_BxKxGxD.shape[0]
  return _dense(q_BxKxGxD, k_RxKxTxD[:b, :, :t], v_RxKxTxD[:b, :, :t], pos_B, t, "bktd", rows)


def dense_pages(q_BxKxGxD, k_KxBxTxD, v_KxBxTxD, pos_B, t: int, rows: int = 1):
  """``dense`` over rows gathered from a paged cache, heads first (``paged_attention``)."""
  return _dense(q_BxKxGxD, k_KxBxTxD, v_KxBxTxD, pos_B, t, "kbtd", rows)


def chunked(q_BxKxGxD, k_RxTxKxD, v_RxTxKxD, pos_B, t: int, chunk: int = CHUNK,
            group: int = GROUP):
  """Online softmax over chunks of ``chunk`` positions in a ``fori_loop`` whose trip count is
  dynamic: only the chunks up to the furthest row's position are read (never beyond ``t``),
  straight from the cache buffer, without the copy a static ``cache[:, :t]`` slice costs on XLA:CPU.

  Rows are sorted by position and cut into groups of ``group``, each with its own loop, so short
  rows stop at their own last chunk instead of the batch's furthest one (continuous batching mixes
  new and old sequences: about 3x less attention time on a long-tailed mix). Chosen at run time,
  when it skips at least a quarter of the chunks, and only when the rows are not split over devices
  (a row gather across devices would move the cache)."""
  b = q_BxKxGxD.shape[0]
  c = min(chunk, t)
  attend = functools.partial(_rows, k_RxTxKxD=k_RxTxKxD, v_RxTxKxD=v_RxTxKxD, t=t, c=c)
  if b <= group or sharding.num_shards("cache_batch", b) > 1:
    return attend(q_BxKxGxD, None, pos_B)
  order_B = jnp.argsort(pos_B)

  def grouped(q_BxKxGxD):
    outs = [attend(q_BxKxGxD[rows_N], rows_N, pos_B[rows_N])
            for rows_N in (order_B[i:i + group] for i in range(0, b, group))]
    return jnp.zeros_like(q_BxKxGxD).at[order_B].set(jnp.concatenate(outs))

  # groups pay off when they skip at least a quarter of the chunks (not when all rows are alike)
  chunks_GxN = jnp.pad((jnp.minimum(pos_B[order_B], t - 1) + c) // c, (0, -b % group))
  chunks_GxN = chunks_GxN.reshape(-1, group)  # per group of sorted rows (padded with zeros)
  need, flat = jnp.sum(jnp.max(chunks_GxN, axis=1)), chunks_GxN.shape[0] * jnp.max(chunks_GxN)
  return jax.lax.cond(4 * need <= 3 * flat, grouped,
                      lambda q_BxKxGxD: attend(q_BxKxGxD, None, pos_B), q_BxKxGxD)


def _rows(q_NxKxGxD, rows_N, pos_N, k_RxTxKxD, v_RxTxKxD, t: int, c: int):
  """``chunked`` attention of cache rows ``rows_N`` (None: rows ``[0, N)``)."""
  n, kv, g, d = q_NxKxGxD.shape
  n_chunks = (jnp.minimum(jnp.max(pos_N), t - 1) + c) // c

  def read(cache, begin):
    if rows_N is None:
      return jax.lax.dynamic_slice(cache, (0, begin, 0, 0), (n, c, kv, d)).astype(jnp.float32)
    return cache[rows_N[:, None], begin + jnp.arange(c)[None, :]].astype(jnp.float32)

  def body(i, carry):
    m_NxKxG, l_NxKxG, acc_NxKxGxD = carry
    # when c does not divide t the last chunk overlaps its predecessor: positions < i * c are masked
    begin = jnp.minimum(i * c, t - c)
    k_NxCxKxD, v_NxCxKxD = read(k_RxTxKxD, begin), read(v_RxTxKxD, begin)
    positions_C = begin + jnp.arange(c)
    valid_NxC = (positions_C[None] <= pos_N[:, None]) & (positions_C[None] >= i * c)
    s_NxKxGxC = jnp.einsum("nkgd,nckd->nkgc", q_NxKxGxD, k_NxCxKxD)
    s_NxKxGxC = jnp.where(valid_NxC[:, None, None], s_NxKxGxC, -jnp.inf)
    m_new = jnp.maximum(m_NxKxG, jnp.max(s_NxKxGxC, axis=-1))  # finite: position 0 is in chunk 0
    alpha = jnp.exp(m_NxKxG - m_new)
    p_NxKxGxC = jnp.exp(s_NxKxGxC - m_new[..., None])
    l_NxKxG = l_NxKxG * alpha + jnp.sum(p_NxKxGxC, axis=-1)
    pv = jnp.einsum("nkgc,nckd->nkgd", p_NxKxGxC, v_NxCxKxD)
    return m_new, l_NxKxG, acc_NxKxGxD * alpha[..., None] + pv

  init = (jnp.full((n, kv, g), -jnp.inf, jnp.float32), jnp.zeros((n, kv, g), jnp.float32),
          jnp.zeros((n, kv, g, d), jnp.float32))
  _, l_NxKxG, acc_NxKxGxD = jax.lax.fori_loop(0, n_chunks, body, init)
  return acc_NxKxGxD / l_NxKxG[..., None]
