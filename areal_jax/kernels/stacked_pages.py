"""The layers-in-a-scan decode's stacked cache ``[L, R, K, T, D]`` as a pool of pages, for the
paged-attention kernels JAX ships (``pallas_tpu_attention``, ``pallas_attention``).

Those kernels take a pool ``[kv_heads, pages, page, D]`` and a page table per sequence. The
stacked cache is such a pool already, without a copy: viewed as ``[1, L*R*K*T/page, page, D]``
(one "KV head"), every (layer, row, K/V head) owns ``T/page`` consecutive pages, so a query row's
K/V head is one sequence of the pool whose page table is an offset and a range (computed on device
from the scanned layer's index), and its G query heads are the kernel's query heads. The kernels
read each sequence up to its length (``pos + 1``) only, so the static kv bound does not matter,
and no slice of the cache is materialized (a slice passed to a custom call is a copy of the
layer's cache at every step).

On a mesh the kernel runs per device under ``shard_map`` (rows over the data axis, K/V heads over
the tensor axis, as the cache is split); query rows ``[0, B)`` of a cache of R rows are padded to
R rows (length 1: one page read each).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from areal_jax import sharding

MIN_PAGE, MAX_PAGE = 16, 128  # page sizes tried (powers of two) that divide the cache's positions


def page_size(max_len: int) -> int | None:
  """The largest power of two in ``[MIN_PAGE, MAX_PAGE]`` dividing ``max_len``, or None."""
  page = MAX_PAGE
  while page >= MIN_PAGE:
    if max_len % page == 0:
      return page
    page //= 2
  return None


# kernel(q_NxGxD, k_pool, v_pool, lengths_N, pages_NxP, page) -> [N, G, D] for N sequences
Kernel = Callable[..., jax.Array]


def attend(kernel: Kernel, q_BxKxGxD, k_LxRxKxTxD, v_LxRxKxTxD, layer, pos_B, cache_axes):
  """Pre-scaled queries ``[B, K, G, D]`` of rows ``[0, B)`` against layer ``layer`` (traced) of
  the stacked cache, positions ``[0, pos_B[b]]``, through ``kernel``; float32 ``[B, K, G, D]``.
  ``cache_axes``: the stacked cache's logical axes (its sharding)."""
  b, r = q_BxKxGxD.shape[0], k_LxRxKxTxD.shape[1]
  # every row of the cache gets a query (padding rows read one position), so the rows split over
  # the data axis like the cache's
  q_RxKxGxD = jnp.pad(q_BxKxGxD, ((0, r - b), (0, 0), (0, 0), (0, 0)))
  pos_R = jnp.pad(pos_B, (0, r - b)).astype(jnp.int32)
  local = lambda q, k, v, i, pos: _local(kernel, q, k, v, i, pos)  # noqa: E731
  ctx = sharding.current()
  if ctx is not None and ctx[0].size > 1:
    mesh, rules = ctx
    cache = sharding.spec(cache_axes, k_LxRxKxTxD.shape, mesh, rules)
    rows, heads = cache[1], cache[2]
    local = jax.shard_map(local, mesh=mesh, check_vma=False,
                          in_specs=(P(rows, heads), cache, cache, P(), P(rows)),
                          out_specs=P(rows, heads))
  out_RxKxGxD = local(q_RxKxGxD, k_LxRxKxTxD, v_LxRxKxTxD, jnp.asarray(layer, jnp.int32), pos_R)
  return out_RxKxGxD[:b]


def _local(kernel: Kernel, q_RxKxGxD, k_LxRxKxTxD, v_LxRxKxTxD, layer, pos_R):
  """One device's part: its rows and K/V heads of the cache as one pool of pages."""
  r, kv, g, d = q_RxKxGxD.shape
  t = k_LxRxKxTxD.shape[3]
  page = page_size(t)
  n = t // page  # pages per (layer, row, K/V head)
  # sequence j = row * K + head of layer `layer` starts at page ((layer * R * K) + j) * n
  first_N = (layer * r * kv + jnp.arange(r * kv, dtype=jnp.int32)) * n
  pages_NxP = first_N[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
  pool = lambda x: x.reshape(1, -1, page, d)  # noqa: E731  (contiguous: a view, not a copy)
  out_NxGxD = kernel(q_RxKxGxD.reshape(r * kv, g, d), pool(k_LxRxKxTxD), pool(v_LxRxKxTxD),
                     jnp.repeat(pos_R + 1, kv), pages_NxP, page)
  return out_NxGxD.reshape(r, kv, g, d).astype(jnp.float32)
