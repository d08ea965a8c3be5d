"""Decode attention over the sampler's paged KV cache (``sampler/pages.py``): K and V each a pool
``[K, L, M, P, D]`` (K/V heads, layers, pages with the trash page last, positions in a page,
features) and a page table ``[B, N]`` per query row (page ids of positions ``[0, N*P)``).

  * ``"pallas_tpu"``: ``jax.experimental.pallas.ops.tpu.paged_attention`` reads the pool in place
    (a bfloat16 pool: the kernel loads K/V as bfloat16; on a TPU a head size that is a multiple of
    128);
  * ``"pallas_gpu"``: ``jax.experimental.pallas.ops.gpu.paged_attention`` reads it in place;
  * every other form gathers each row's pages up to the kv bound ``t`` into a dense
    ``[K, B, T, D]`` block and reads it as the dense form does (a copy of the rows' K/V at every
    layer and step: the price of paging without a kernel).

``decode_step_paged`` is a layer's whole decode step over the pools: the step's keys and values
written into their pages (one scatter each, in place), then ``decode_attention_paged``; or, with
``PagedTuning.writes`` on GPU, both in one kernel of our own (``pallas_paged_step``).

The pool viewed as ``[K, L*M, P, D]`` is the kernels' page layout; layer ``i``'s pages are
``i * M + table``. On a mesh the kernels run per device under ``shard_map`` over the K/V heads (the
pool's split; the sampler's paged cache is not split over slots).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from areal_jax import sharding
from areal_jax.kernels import (pallas_attention, pallas_paged_step, pallas_tpu_attention,
                               xla_attention)

POOL_AXES = ("cache_heads", None, None, None, None)  # logical axes of a pool


def decode_attention_paged(q_BxKxGxD, k_KxLxMxPxD, v_KxLxMxPxD, layer, table_BxN, pos_B, t: int,
                           impl: str, interpret: bool = False, rows: int = 1,
                           tuning: pallas_attention.PagedTuning = pallas_attention.PagedTuning()):
  """Pre-scaled queries ``[B, K, G, D]`` attending to their rows' positions ``0..pos_B[b]`` (``t``:
  static bound) of layer ``layer`` (traced); float32 ``[B, K, G, D]`` (``rows``: the dense read's
  padding of the query groups, ``xla_attention._dense``; ``tuning``: how the Pallas GPU kernel
  is launched, ``choice.pallas_gpu_tuning``)."""
  b, kv, g, d = q_BxKxGxD.shape
  _, n_layers, m, page, _ = k_KxLxMxPxD.shape
  pages_BxN = layer * m + table_BxN  # page ids in the [K, L*M, P, D] view
  flat = lambda x: x.reshape(x.shape[0], n_layers * m, page, d)  # noqa: E731  (a view)
  if impl == "pallas_tpu" and pallas_tpu_attention.unreadable(
      k_KxLxMxPxD.dtype, d, compiled=not interpret) is None:
    kernel = functools.partial(pallas_tpu_attention.kernel, interpret=interpret)
    q_dtype = jnp.float32
  elif impl == "pallas_gpu":
    kernel = functools.partial(pallas_attention.paged, interpret=interpret, tuning=tuning,
                               bound=t)
    q_dtype = k_KxLxMxPxD.dtype
  else:  # gather the rows' pages up to the bound, then the dense read
    n = min(-(-t // page), table_BxN.shape[1])
    k_KxBxTxD, v_KxBxTxD = (flat(x)[:, pages_BxN[:, :n]].reshape(x.shape[0], b, n * page, d)
                            for x in (k_KxLxMxPxD, v_KxLxMxPxD))
    return xla_attention.dense_pages(q_BxKxGxD, k_KxBxTxD, v_KxBxTxD, pos_B, n * page, rows)

  def local(q_BxKxGxD, k_pool, v_pool, pages_BxN, pos_B):
    kl = k_pool.shape[0]  # this device's K/V heads
    out_BxHxD = kernel(q_BxKxGxD.reshape(b, kl * g, d).astype(q_dtype), flat(k_pool),
                       flat(v_pool), (pos_B + 1).astype(jnp.int32), pages_BxN.astype(jnp.int32),
                       page)
    return out_BxHxD.reshape(b, kl, g, d).astype(jnp.float32)

  ctx = sharding.current()
  if ctx is not None and ctx[0].size > 1:
    mesh, rules = ctx
    pool = sharding.spec(POOL_AXES, k_KxLxMxPxD.shape, mesh, rules)
    local = jax.shard_map(local, mesh=mesh, check_vma=False,
                          in_specs=(P(None, pool[0]), pool, pool, P(), P()),
                          out_specs=P(None, pool[0]))
  return local(q_BxKxGxD, k_KxLxMxPxD, v_KxLxMxPxD, pages_BxN, pos_B)


def decode_step_paged(q_BxKxGxD, k_new_BxKxD, v_new_BxKxD, k_KxLxMxPxD, v_KxLxMxPxD, layer,
                      table_BxN, page_B, offset_B, pos_B, t: int, impl: str, scale: float,
                      interpret: bool = False, rows: int = 1,
                      tuning: pallas_attention.PagedTuning = pallas_attention.PagedTuning()):
  """Layer ``layer``'s decode step over the pools: row ``b``'s new key and value ``[B, K, D]``
  written at page ``page_B[b]`` (of the layer's ``M``; the trash page for a row that writes
  nothing), offset ``offset_B[b]``, then ``decode_attention_paged``'s attention of the queries
  ``[B, K, G, D]`` times ``scale`` over positions ``0..pos_B[b]``. Returns
  ``(out, k_pool, v_pool)``, ``out`` ``[B, K, G, D]`` float32 (from ``pallas_paged_step``: the
  queries' dtype)."""
  _, _, g, d = q_BxKxGxD.shape
  if not one_kernel(impl, g, k_KxLxMxPxD.shape[3], d, tuning):
    # new [B, Hkv, D] into [:, layer, page, offset, :] (the indexed axes' [B] lands after Hkv);
    # unique but in the trash page, which rows that do not write share and no read uses (see
    # models/decode_scan on unique_indices)
    k_pool, v_pool = (sharding.constrain(pool.at[:, layer, page_B, offset_B].set(
        jnp.swapaxes(new, 0, 1).astype(pool.dtype), unique_indices=True), POOL_AXES)
                      for pool, new in ((k_KxLxMxPxD, k_new_BxKxD), (v_KxLxMxPxD, v_new_BxKxD)))
    out_BxKxGxD = decode_attention_paged(q_BxKxGxD.astype(jnp.float32) * scale, k_pool, v_pool,
                                         layer, table_BxN, pos_B, t, impl, interpret, rows, tuning)
    return out_BxKxGxD, k_pool, v_pool
  # one array for the kernel: XLA computes it in one fusion from the projections' output
  qkv_BxKxSxD = jnp.concatenate([q_BxKxGxD, k_new_BxKxD[:, :, None].astype(q_BxKxGxD.dtype),
                                 v_new_BxKxD[:, :, None].astype(q_BxKxGxD.dtype)], axis=2)
  return _step_kernel(qkv_BxKxSxD, None, k_KxLxMxPxD, v_KxLxMxPxD, layer, table_BxN, page_B,
                      offset_B, pos_B, t, scale, interpret, tuning)


def one_kernel(impl: str, group: int, page: int, head_dim: int,
               tuning: pallas_attention.PagedTuning) -> bool:
  """Whether a layer's paged decode step is our one kernel (``pallas_paged_step``: ``pallas_gpu``
  launched with ``writes``, at a shape it takes); ``decode_step_rotating`` needs it."""
  return impl == "pallas_gpu" and tuning.writes and pallas_paged_step.usable(group, page, head_dim)


def decode_step_rotating(qkv_BxKxSxD, cos_BxF, sin_BxF, k_KxLxMxPxD, v_KxLxMxPxD, layer,
                         table_BxN, page_B, offset_B, pos_B, t: int, scale: float,
                         interpret: bool = False,
                         tuning: pallas_attention.PagedTuning = pallas_attention.PagedTuning()):
  """``decode_step_paged`` through our kernel (only where ``one_kernel``) from a layer's fused
  projection before rope: per row and K/V head its ``G`` queries, key and value
  ``[B, K, G + 2, D]``, rotated in the kernel by the rows' rope tables ``[B, D/2]``."""
  return _step_kernel(qkv_BxKxSxD, (cos_BxF, sin_BxF), k_KxLxMxPxD, v_KxLxMxPxD, layer,
                      table_BxN, page_B, offset_B, pos_B, t, scale, interpret, tuning)


def _step_kernel(qkv_BxKxSxD, rope, k_KxLxMxPxD, v_KxLxMxPxD, layer, table_BxN, page_B,
                 offset_B, pos_B, t: int, scale: float, interpret: bool,
                 tuning: pallas_attention.PagedTuning):
  """``pallas_paged_step.step`` over the pools (per device under ``shard_map`` over the K/V heads
  on a mesh); ``rope``: None or the rows' ``(cos, sin)``."""
  _, n_layers, m, page, d = k_KxLxMxPxD.shape
  base = jnp.reshape(layer * m, (1,)).astype(jnp.int32)  # the layer's first page

  def local(qkv_BxKxSxD, k_pool, v_pool, base, table_BxN, pos_B, page_B, offset_B, rope):
    flat = lambda x: x.reshape(x.shape[0], n_layers * m, page, d)  # noqa: E731  (a view)
    out, k_pool_, v_pool_ = pallas_paged_step.step(
        qkv_BxKxSxD, flat(k_pool), flat(v_pool), base, table_BxN, pos_B, page_B, offset_B, t,
        tuning.warps, tuning.stages, interpret, scale, rope, tuning.parts, tuning.dot,
        tuning.block_pages)
    return out, k_pool_.reshape(k_pool.shape), v_pool_.reshape(v_pool.shape)

  ctx = sharding.current()
  if ctx is not None and ctx[0].size > 1:
    mesh, rules = ctx
    pool = sharding.spec(POOL_AXES, k_KxLxMxPxD.shape, mesh, rules)
    heads = P(None, pool[0])
    local = jax.shard_map(local, mesh=mesh, check_vma=False,
                          in_specs=(heads, pool, pool, P(), P(), P(), P(), P(), P()),
                          out_specs=(heads, pool, pool))
  return local(qkv_BxKxSxD, k_KxLxMxPxD, v_KxLxMxPxD, base, table_BxN, pos_B, page_B, offset_B,
               rope)
