"""The sampler's KV cache over decode slots, in the layouts the engine runs (``layout``):

  * ``ROWS``, per layer (the layers unrolled, ``Transformer.extend``): a list of ``{"k", "v"}`` of
    ``[slots, max_len, kv_heads, head_dim]``; a prefix is such a list of
    ``[1, bucket, kv_heads, head_dim]``;
  * ``HEADS``, per layer with heads before positions (the layers unrolled on GPU:
    ``Transformer.extend(heads_major=True)``; read by the dense and Pallas GPU attention without a
    transposed copy): ``[slots, kv_heads, max_len, head_dim]``, a prefix
    ``[1, kv_heads, bucket, head_dim]``;
  * ``STACKED`` (the layers in a scan, ``models/decode_scan``): one ``{"k", "v"}`` of
    ``[n_layers, slots, kv_heads, max_len, head_dim]`` (heads before positions: see
    ``decode_scan``); a prefix ``[n_layers, 1, kv_heads, bucket, head_dim]``.

Slots are sharded over the mesh's data axis and heads over its tensor axis. Pure functions for the
engine's jitted calls; a slot index equal to the slot count is dropped (padding rows).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from areal_jax.models import decode_scan
from areal_jax.models.transformer import (CACHE_AXES, CACHE_AXES_HEADS_MAJOR, ModelConfig,
                                          init_cache)

ROWS, HEADS, STACKED = "rows", "heads", "stacked"  # the layouts (see the module docstring)


def make(cfg: ModelConfig, slots: int, max_len: int, dtype: Any, layout: str):
  """An empty cache of ``slots`` rows."""
  if layout == STACKED:
    return decode_scan.init_cache(cfg, slots, max_len, dtype)
  return init_cache(cfg, slots, max_len, dtype, heads_major=layout == HEADS)


def shardings(named: Callable, cfg: ModelConfig, slots: int, max_len: int, layout: str,
              prefix: bool = False):
  """The cache's shardings (a prefix's with ``prefix``: one row, not split over slots);
  ``named(logical_axes, shape) -> NamedSharding``."""
  if layout == STACKED:
    axes = decode_scan.CACHE_AXES
    axes = axes[:1] + (None,) + axes[2:] if prefix else axes
    kv = named(axes, decode_scan.cache_shape(cfg, slots, max_len))
    return {"k": kv, "v": kv}
  kv, d = cfg.n_kv_heads, cfg.head_dim
  axes, shape = ((CACHE_AXES_HEADS_MAJOR, (slots, kv, max_len, d)) if layout == HEADS
                 else (CACHE_AXES, (slots, max_len, kv, d)))
  named_kv = named((None,) + axes[1:] if prefix else axes, shape)
  return [{"k": named_kv, "v": named_kv} for _ in range(cfg.n_layers)]


def row(cache, i: int, layout: str):
  """Row ``i`` of a cache as a prefix (one row, its own buffers)."""
  if layout == STACKED:
    return {name: x[:, i:i + 1] for name, x in cache.items()}
  return [{name: layer[name][i:i + 1] for name in ("k", "v")} for layer in cache]


def _positions_axis(layout: str) -> int:
  """The positions axis of a prefix's arrays."""
  return 3 if layout == STACKED else 2 if layout == HEADS else 1


def prefix_len(prefix, layout: str) -> int:
  """Positions a prefix holds (its prefill bucket)."""
  return (prefix["k"] if layout == STACKED else prefix[0]["k"]).shape[_positions_axis(layout)]


def prefix_head(prefix, n: int, layout: str):
  """Positions ``[0, n)`` of a prefix (or of a cache row taken as one), zeros past its own."""
  axis = _positions_axis(layout)

  def head(x):
    if n <= x.shape[axis]:
      return jax.lax.slice_in_dim(x, 0, n, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, pad)

  return jax.tree.map(head, prefix)


def write_prefix(cache, prefix, slots_N, bucket: int, layout: str):
  """``cache`` with ``prefix`` copied into positions ``[0, bucket)`` of each slot in ``slots_N``
  (distinct slots; padding entries index past the slots and are dropped). Told its indices are
  unique, XLA:GPU stores each element where it would loop a compare-and-swap
  (``models.decode_scan``)."""
  n = slots_N.shape[0]
  if layout == STACKED:
    return {name: cache[name].at[:, slots_N, :, :bucket].set(
        jnp.broadcast_to(pre, (pre.shape[0], n) + pre.shape[2:]), mode="drop",
        unique_indices=True) for name, pre in prefix.items()}
  positions = (slice(None), slice(None, bucket)) if layout == HEADS else (slice(None, bucket),)
  return [{name: layer[name].at[(slots_N,) + positions].set(
      jnp.broadcast_to(pre[name], (n,) + pre[name].shape[1:]), mode="drop", unique_indices=True)
      for name in ("k", "v")} for layer, pre in zip(cache, prefix)]


def write_prefix_pages(pool, prefix, pages_NxM, pos_N, bucket: int):
  """A paged cache's pools (``decode_scan.init_pool``) with positions ``[0, pos_N[n])`` of a
  stacked ``prefix`` written into the pages of row ``n``'s table ``pages_NxM`` (the rest of the
  bucket into the trash page). A group's rows may share pages: they get the same values. Told its
  indices are unique (they are but for those shared pages, written the same values, and the trash
  page, whose values no read uses), XLA:GPU stores each element where it would loop a
  compare-and-swap (``models.decode_scan``)."""
  page_size, trash = pool["k"].shape[3], pool["k"].shape[2] - 1
  positions_Q = jnp.arange(bucket)
  page_NxQ = jnp.where(positions_Q[None] < pos_N[:, None],
                       pages_NxM[:, positions_Q // page_size], trash)
  offset_Q = positions_Q % page_size
  n = pages_NxM.shape[0]
  out = {}
  for name, pre in prefix.items():  # pre [L, 1, K, Q, D] -> [K, L, N, Q, D]
    x = pool[name]
    value = jnp.broadcast_to(jnp.swapaxes(pre[:, 0], 0, 1)[:, :, None],
                             x.shape[:2] + (n, bucket, x.shape[-1]))
    out[name] = x.at[:, :, page_NxQ, offset_Q[None]].set(value.astype(x.dtype),
                                                        unique_indices=True)
  return out


def read_pages(pool, pages_M, max_len: int):
  """The stacked prefix row (``[L, 1, K, max_len, D]``) a slot's pages ``pages_M`` hold."""
  out = {}
  for name, x in pool.items():  # [K, L, M, P, D] -> [K, L, M * P, D] -> [L, 1, K, max_len, D]
    kv, n_layers, _, page, d = x.shape
    rows = x[:, :, pages_M].reshape(kv, n_layers, pages_M.shape[0] * page, d)[:, :, :max_len]
    out[name] = jnp.swapaxes(rows, 0, 1)[:, None]
  return out


def move(cache, src_N, dst_N, layout: str):
  """``cache`` with slots ``src_N`` copied to slots ``dst_N`` (rows whole)."""

  def moved(x, axis):
    at = (slice(None),) * axis
    got = x.at[at + (src_N,)].get(mode="fill", fill_value=0)
    return x.at[at + (dst_N,)].set(got, mode="drop")

  if layout == STACKED:
    return {name: moved(x, 1) for name, x in cache.items()}
  return [{name: moved(x, 0) for name, x in layer.items()} for layer in cache]
