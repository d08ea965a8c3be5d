"""``Transformer.extend`` with the layers in one ``lax.scan``: compile time flat in depth.

The model's parameters stay an ``nnx.List`` of ``Block``s; this module works on a *stacked view* of
them (``stack_layers``: every per-layer leaf stacked to ``[n_layers, ...]``, built once per weight
version by the caller) and a stacked KV cache (``init_cache``: ``{"k", "v"}`` each
``[n_layers, rows, kv_heads, max_len, head_dim]``, heads before positions). ``extend`` traces one
``Block`` and scans it over the layers, so the traced and compiled program has one layer body
whatever the depth (the unrolled ``Transformer.extend`` has one per layer). The cache rides in the
scan's carry and each layer scatters its new keys and values into it in place (the compiled
decode call holds no copy of the whole stacked cache); a layer then reads its rows up to the read
bound. Heads before positions: a decode step's attention is then a batched matmul over (row, head)
pairs the cache already holds contiguously, with no transposed copy of each layer's cache per
step (the per-layer ``[rows, T, kv_heads, D]`` layout costs one: XLA:CPU's optimized program
showed two per layer and step, keys and values).

``extend_unrolled`` runs the same over the model's own per-layer weights, the layers unrolled
(each layer's index static), for a stacked or paged cache without the scan.

Same results as ``Transformer.extend`` (same ops per layer); knows nothing of sampling or training.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax import sharding
from areal_jax.kernels import attention as attention_kernels
from areal_jax.kernels.paged_attention import POOL_AXES
from areal_jax.models.transformer import (Block, ModelConfig, Transformer, attention,
                                          decode_attention, decode_step_paged,
                                          decode_step_rotating, prefill_kernel_attention,
                                          rope_tables)

StackedCache = dict[str, jax.Array]  # {"k", "v"}: [n_layers, rows, Hkv, T, D]
# The cache writes below (and the paged cache's, ``kernels.paged_attention.decode_step_paged``)
# are scatters whose indices never repeat (a row's positions, or its page and offset: a group's
# shared pages are full ones, ``sampler.pages``), and say so
# (``unique_indices``): XLA:GPU then stores each element, where it otherwise updates it by a
# compare-and-swap loop on its 32-bit word (bfloat16; read off the PTX of a deviceless H100
# compile, bench/results/cpu-aot-h100-2026-11-28).
CACHE_AXES = (None, "cache_batch", "cache_heads", None, None)  # logical axes of the stacked cache


@dataclasses.dataclass(frozen=True)
class Graphs:
  """Static structure for ``extend``: the model without its layers (embedding, final norm, head)
  and one layer; ``group``: query heads per K/V head."""

  shell: Any
  block: Any
  group: int


def graphs(cfg: ModelConfig) -> Graphs:
  """Graph definitions of ``cfg``'s model without layers and of one ``Block`` (no weights made)."""
  shell = nnx.eval_shape(lambda: Transformer(dataclasses.replace(cfg, n_layers=0), nnx.Rngs(0)))
  block = nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(0)))
  return Graphs(nnx.graphdef(shell), nnx.graphdef(block), cfg.n_heads // cfg.n_kv_heads)


def stack_layers(params: dict) -> dict:
  """A pure parameter dict with ``params["layers"]`` (one dict per layer) replaced by one dict of
  ``[n_layers, ...]`` arrays."""
  layers = params["layers"]
  per_layer = [layers[i] for i in sorted(layers)] if isinstance(layers, dict) else list(layers)
  return {**params, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)}


def stacked_shardings(shardings: dict) -> dict:
  """``stack_layers``' shardings from the per-layer ones: layer 0's, unsplit over the new axis."""
  layers = shardings["layers"]
  first = layers[min(layers)] if isinstance(layers, dict) else layers[0]
  return {**shardings, "layers": jax.tree.map(
      lambda sh: jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(None, *sh.spec)),
      first)}


def cache_shape(cfg: ModelConfig, batch: int, max_len: int) -> tuple[int, ...]:
  """``[n_layers, rows, kv_heads, positions, head_dim]``: the stacked cache's keys (and values)."""
  return (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> StackedCache:
  """An empty stacked KV cache of ``batch`` rows and ``max_len`` positions."""
  shape = cache_shape(cfg, batch, max_len)
  dtype = dtype or cfg.compute_dtype
  return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def pool_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
  """``[kv_heads, n_layers, num_pages + 1, page_size, head_dim]``: a paged cache's keys (and
  values), the last page the trash page (``sampler/pages.py``)."""
  return (cfg.n_kv_heads, cfg.n_layers, num_pages + 1, page_size, cfg.head_dim)


def init_pool(cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any = None) -> StackedCache:
  """An empty paged KV cache: ``num_pages`` pages of ``page_size`` positions and the trash page."""
  shape = pool_shape(cfg, num_pages, page_size)
  dtype = dtype or cfg.compute_dtype
  return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def stack_cache(per_layer: list[dict]) -> StackedCache:
  """The stacked layout of a per-layer cache (``transformer.init_cache``'s ``[rows, T, Hkv, D]``
  per layer)."""
  return {n: jnp.stack([jnp.swapaxes(layer[n], 1, 2) for layer in per_layer]) for n in ("k", "v")}


def extend(graph: Graphs, params: dict, tokens_BxL, start_B, cache: StackedCache,
           kv_len: int | None = None, attention_impl: str | None = None, pages_BxN=None,
           writes_B=None, prefill_attention: str | None = None):
  """``Transformer.extend`` over stacked parameters (``stack_layers``) and a stacked cache: appends
  L tokens per row at ``start_B``; returns ``(logits_BxLxV, cache)``. The cache may have more rows
  than the tokens (rows from B on are left as they are).

  Paged (``pages_BxN``: each row's page table; decode steps only, L = 1, ``kv_len`` required):
  ``cache`` is a paged cache's pools (``init_pool``); a row writes its new K/V into its page of
  ``start_B`` where ``writes_B`` (default: every row), else into the trash page.
  ``prefill_attention``: as ``Transformer.extend``'s (a prefill's causal kernel)."""
  layers = functools.partial(_scan_layers, graph, params)
  return _extend(layers, tokens_BxL, start_B, cache, kv_len, attention_impl, pages_BxN, writes_B,
                 graph.group, prefill_attention)


def extend_unrolled(model: Transformer, tokens_BxL, start_B, cache: StackedCache,
                    kv_len: int | None = None, attention_impl: str | None = None, pages_BxN=None,
                    writes_B=None, prefill_attention: str | None = None):
  """``extend`` with ``model``'s own per-layer weights, the layers unrolled (one traced body per
  layer, each layer's index static), over the same stacked cache or paged cache's pools: a paged
  cache without the scan, whose slices of stacked weights a GPU or TPU compiler copies at every
  layer and step (``kernels.choice``)."""
  layers = functools.partial(_unrolled_layers, model)
  return _extend(layers, tokens_BxL, start_B, cache, kv_len, attention_impl, pages_BxN, writes_B,
                 model.cfg.n_heads // model.cfg.n_kv_heads, prefill_attention)


def _extend(run_layers, tokens_BxL, start_B, cache: StackedCache, kv_len, attention_impl,
            pages_BxN, writes_B, group: int, prefill_attention: str | None = None):
  """``extend``'s body; ``run_layers(tokens, positions, cache, n_layers, attend_layer)`` runs the
  model's layers (``_scan_layers`` or ``_unrolled_layers``)."""
  b, l = tokens_BxL.shape
  if pages_BxN is not None:
    if l != 1 or kv_len is None:
      raise ValueError("a paged cache takes decode steps (one token per row) with a kv bound")
    return _extend_paged(run_layers, tokens_BxL, start_B, cache, kv_len, attention_impl,
                         pages_BxN, writes_B, group)
  t = cache["k"].shape[3] if kv_len is None else kv_len
  positions_BxL = start_B[:, None] + jnp.arange(l, dtype=jnp.int32)[None, :]
  mask_BxLxT = jnp.arange(t)[None, None, :] <= positions_BxL[:, :, None]
  rows_Bx1 = jnp.arange(b)[:, None]

  def attend_layer(i, q, k, v, k_all, v_all):
    # new [B, L, Hkv, D] into [i, row, :, position, :] (the indexed axes lead the value); every
    # (row, position) once
    k_all, v_all = (sharding.constrain(full.at[i, rows_Bx1, :, positions_BxL].set(
        new.astype(full.dtype), unique_indices=True), CACHE_AXES)
                    for full, new in ((k_all, k), (v_all, v)))
    if l == 1:  # the decode attention reads layer i of the stack (the kernels' choice how)
      return decode_attention(q, k_all, v_all, start_B, t, impl=attention_impl, heads_major=True,
                              layer=i, cache_axes=CACHE_AXES), k_all, v_all
    if prefill_attention not in (None, "dense"):  # a prefill: the causal kernel
      return prefill_kernel_attention(q, k, v, k_all.dtype, prefill_attention), k_all, v_all
    # prefill and continuation chunks (once per group): this layer's rows [0, b) and positions
    # [0, t) in the prompt attention's layout
    kv, d = k.shape[2:]
    k_BxKxTxD, v_BxKxTxD = (jax.lax.dynamic_slice(x, (i, 0, 0, 0, 0), (1, b, kv, t, d))[0]
                            for x in (k_all, v_all))
    return attention(q, jnp.swapaxes(k_BxKxTxD, 1, 2), jnp.swapaxes(v_BxKxTxD, 1, 2),
                     mask_BxLxT), k_all, v_all

  return run_layers(tokens_BxL, positions_BxL, cache, cache["k"].shape[0], attend_layer)


def _extend_paged(run_layers, tokens_Bx1, start_B, pool: StackedCache, kv_len: int,
                  attention_impl, pages_BxN, writes_B, group: int):
  """``extend``'s decode step over a paged cache (see there)."""
  b = tokens_Bx1.shape[0]
  page_size, trash = pool["k"].shape[3], pool["k"].shape[2] - 1
  page_B = pages_BxN[jnp.arange(b), start_B // page_size]
  if writes_B is not None:
    page_B = jnp.where(writes_B, page_B, trash)
  offset_B = start_B % page_size

  def attend_layer(i, q, k, v, k_pool, v_pool):
    return decode_step_paged(q, k, v, k_pool, v_pool, i, pages_BxN, page_B, offset_B, start_B,
                             kv_len, attention_impl)

  d = pool["k"].shape[-1]
  if attention_kernels.one_kernel_step(attention_impl, group, page_size, d):
    # our kernel rotates the fused projection itself (where a block hands it over, ``Block``)
    attend_layer.rotates = lambda i, qkv, rope, k_pool, v_pool: decode_step_rotating(
        qkv, rope, k_pool, v_pool, i, pages_BxN, page_B, offset_B, start_B, kv_len)
  return run_layers(tokens_Bx1, start_B[:, None], pool, pool["k"].shape[1], attend_layer)


def _scan_layers(graph: Graphs, params: dict, tokens_BxL, positions_BxL, cache: StackedCache,
                 n_layers: int, attend_layer):
  """The model over stacked parameters with its layers in one ``lax.scan``, the cache's keys and
  values riding in the carry: ``attend_layer(i, q, k, v, k_all, v_all)`` writes layer ``i``'s new
  keys and values and attends, returning ``(out, k_all, v_all)`` (its ``rotates(i, qkv, rope,
  k_all, v_all)``, if it has one, the same from the fused projection before rope, ``Block``).
  Returns ``(logits, cache)``."""
  model = nnx.merge(graph.shell, {k: v for k, v in params.items() if k != "layers"})
  cfg = model.cfg  # n_layers is 0 there: the depth is the cache's
  rope_BxLxF = rope_tables(positions_BxL, cfg.head_dim, cfg.rope_theta)

  def layer(carry, xs):
    x, k_all, v_all = carry
    i, weights = xs
    written = {}
    attend = _layer_attend(attend_layer, i, k_all, v_all, written)
    x = nnx.merge(graph.block, weights)(x, rope_BxLxF, attend)
    return (x, written["k"], written["v"]), None

  x = model._embed(tokens_BxL)  # the model's own embedding and head
  (x, k_all, v_all), _ = jax.lax.scan(layer, (x, cache["k"], cache["v"]),
                                      (jnp.arange(n_layers), params["layers"]))
  return model._logits(x), {"k": k_all, "v": v_all}


def _unrolled_layers(model: Transformer, tokens_BxL, positions_BxL, cache: StackedCache,
                     n_layers: int, attend_layer):
  """``_scan_layers`` with ``model``'s per-layer weights: a Python loop over its layers, the
  layer index passed to ``attend_layer`` a Python int."""
  if len(model.layers) != n_layers:
    raise ValueError(f"the cache holds {n_layers} layers, the model {len(model.layers)}")
  rope_BxLxF = rope_tables(positions_BxL, model.cfg.head_dim, model.cfg.rope_theta)
  x, k_all, v_all = model._embed(tokens_BxL), cache["k"], cache["v"]
  for i, block in enumerate(model.layers):
    written = {}
    x = block(x, rope_BxLxF, _layer_attend(attend_layer, i, k_all, v_all, written))
    k_all, v_all = written["k"], written["v"]
  return model._logits(x), {"k": k_all, "v": v_all}


def _layer_attend(attend_layer, i, k_all, v_all, written: dict):
  """The ``attend`` layer ``i``'s ``Block`` gets: ``attend_layer`` (and its ``rotates``, where it
  has one) on that layer's index and cache; the cache it returns lands in ``written``."""
  def run(fn, *args):
    out, written["k"], written["v"] = fn(i, *args, k_all, v_all)
    return out

  attend = functools.partial(run, attend_layer)
  if hasattr(attend_layer, "rotates"):
    attend.rotates = functools.partial(run, attend_layer.rotates)
  return attend
