"""Decode attention through the Pallas TPU kernel JAX ships
(``jax.experimental.pallas.ops.tpu.paged_attention``), reading the layers-in-a-scan decode's
stacked cache ``[L, R, K, T, D]`` in place.

The kernel takes a pool of pages ``[kv_heads, pages, page, D]`` and a page table per sequence.
The stacked cache is such a pool already, without a copy: viewed as ``[1, L*R*K*T/page, page, D]``
(one "KV head"), every (layer, row, K/V head) owns ``T/page`` consecutive pages, so a query row's
K/V head is one sequence of that pool whose page table is an offset and a range (computed on
device from the scanned layer's index), and its G query heads are the kernel's query heads.
The kernel reads each sequence only up to its length (``pos + 1``), in blocks of ``BLOCK``
positions, so the static kv bound does not matter (the engine keeps one: ``max_len``); no slice of
the cache is materialized (a slice passed to a custom call would be a copy of the layer's cache
at every step).

The kernel reads K/V as bfloat16 whatever their dtype (its loads cast to bfloat16: a float32 cache
would come back rounded, ~7e-3 off a float32 reference, found on CPU), so it is used only over a
bfloat16 cache (``unusable``). Its accumulation is float32: over the same bfloat16 cache it equals
the dense read to float32 rounding.

On a mesh the call runs per device under ``shard_map`` (rows over the data axis, K/V heads over
the tensor axis, as the cache is split); query rows ``[0, B)`` of a cache of R rows are padded to
R rows (length 1: one page read each). On a CPU device it runs in Pallas TPU interpret mode (tests).
Not run on a TPU by this project (no TPU was available): the TPU default stays the dense read.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
from jax.sharding import PartitionSpec as P

from areal_jax import sharding

MIN_PAGE, MAX_PAGE = 16, 128  # page sizes tried (powers of two) that divide the cache's positions
BLOCK = 512  # positions per kernel block (pages per compute block x page size, at most)


def page_size(max_len: int) -> int | None:
  """The largest power of two in ``[MIN_PAGE, MAX_PAGE]`` dividing ``max_len``, or None."""
  page = MAX_PAGE
  while page >= MIN_PAGE:
    if max_len % page == 0:
      return page
    page //= 2
  return None


def unusable(layers: str, cache_dtype, max_len: int) -> str | None:
  """Why an engine cannot run this kernel (None when it can)."""
  if layers != "scan":
    return "it reads the stacked cache of the layers in a scan: set decode_layers='scan'"
  if jnp.dtype(cache_dtype) != jnp.bfloat16:
    return (f"the kernel reads K/V as bfloat16 (a {jnp.dtype(cache_dtype).name} cache would be "
            "rounded): set cache_dtype='bfloat16' or a bfloat16 model")
  if page_size(max_len) is None:
    return f"max_len={max_len} must be a multiple of {MIN_PAGE} (the kernel's pages)"
  return None


def decode_attention_stacked(q_BxKxGxD, k_LxRxKxTxD, v_LxRxKxTxD, layer, pos_B, cache_axes,
                             interpret: bool = False):
  """Pre-scaled queries ``[B, K, G, D]`` of rows ``[0, B)`` against layer ``layer`` (traced) of
  the stacked cache, positions ``[0, pos_B[b]]``; float32 ``[B, K, G, D]``. ``cache_axes``: the
  stacked cache's logical axes (its sharding); ``interpret``: Pallas TPU interpret mode (CPU)."""
  b, r = q_BxKxGxD.shape[0], k_LxRxKxTxD.shape[1]
  # every row of the cache gets a query (padding rows read one position), so the rows split over
  # the data axis like the cache's
  q_RxKxGxD = jnp.pad(q_BxKxGxD.astype(jnp.float32), ((0, r - b), (0, 0), (0, 0), (0, 0)))
  pos_R = jnp.pad(pos_B, (0, r - b))
  attend = lambda q, k, v, i, pos: _attend(q, k, v, i, pos, interpret)
  ctx = sharding.current()
  if ctx is not None and ctx[0].size > 1:
    mesh, rules = ctx
    cache = sharding.spec(cache_axes, k_LxRxKxTxD.shape, mesh, rules)
    rows, heads = cache[1], cache[2]
    attend = jax.shard_map(attend, mesh=mesh, check_vma=False,
                           in_specs=(P(rows, heads), cache, cache, P(), P(rows)),
                           out_specs=P(rows, heads))
  out_RxKxGxD = attend(q_RxKxGxD, k_LxRxKxTxD, v_LxRxKxTxD, jnp.asarray(layer, jnp.int32),
                       pos_R.astype(jnp.int32))
  return out_RxKxGxD[:b]


def _attend(q_RxKxGxD, k_LxRxKxTxD, v_LxRxKxTxD, layer, pos_R, interpret: bool):
  """One device's part: its rows and K/V heads of the cache as one pool of pages."""
  r, kv, g, d = q_RxKxGxD.shape
  t = k_LxRxKxTxD.shape[3]
  page = page_size(t)
  n = t // page  # pages per (layer, row, K/V head)
  # sequence j = row * K + head of layer `layer` starts at page ((layer * R * K) + j) * n
  first_N = (layer * r * kv + jnp.arange(r * kv, dtype=jnp.int32)) * n
  pages_NxP = first_N[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
  pool = lambda x: x.reshape(1, -1, page, d)  # contiguous: a view, not a copy
  with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():
    out_NxGxD = paged_attention(
        q_RxKxGxD.reshape(r * kv, g, d), pool(k_LxRxKxTxD), pool(v_LxRxKxTxD),
        jnp.repeat(pos_R + 1, kv), pages_NxP,
        pages_per_compute_block=math.gcd(n, max(BLOCK // page, 1)))
  return out_NxGxD.reshape(r, kv, g, d).astype(jnp.float32)
