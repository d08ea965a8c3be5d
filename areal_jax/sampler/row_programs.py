"""Programs over one KV row outside the decode slots: a row of ``length`` positions in the layout,
dtype and shardings of the prefix a prefill of that bucket returns (``DecodeEngine.prefill``), so
an insert takes it as it takes a prefill's. The chunked prefill (``chunked_prefill``) builds such a
row a chunk at a time, a continued turn (``continuation``) extends a kept one.

Compiled once per engine structure (kept with the engine's shared programs, ``engine._fns``) and
row length; an extend once more per chunk length (the tokens' shape). They close over static
structure only, never over an engine."""

from __future__ import annotations

import jax

from areal_jax import sharding
from areal_jax.sampler import slot_cache


def shardings(engine, length: int):
  """A row's shardings: a prefix's (one row, not split over slots)."""
  return slot_cache.shardings(engine._named, engine.model_cfg, 1, length, engine.cache_layout,
                              prefix=True)


def _programs(engine) -> dict:
  return engine._fns.setdefault("row_programs", {})


def empty(engine, length: int):
  """The compiled maker of an all-zero row of ``length`` positions (``fn()``)."""
  fns = _programs(engine)
  if ("empty", length) not in fns:
    cfg, dtype, layout = engine.model_cfg, engine._cache_dtype, engine.cache_layout
    fns["empty", length] = jax.jit(lambda: slot_cache.make(cfg, 1, length, dtype, layout),
                                   out_shardings=shardings(engine, length))
  return fns["empty", length]


def extend(engine, length: int):
  """The compiled ``fn(params, row, tokens_1xL, start_1) -> row``: the KV of ``L`` tokens fed
  at positions ``start_1[0]..`` (every earlier position of the row attended to) written into a
  row of ``length`` positions, which it donates. ``start + L`` must not pass ``length``."""
  fns = _programs(engine)
  if ("extend", length) not in fns:
    layers, mesh = engine.layers, engine.mesh

    def fn(params, row, tokens_1xL, start_1):
      with sharding.use(mesh):
        _, row = layers.extend(params)(tokens_1xL, start_1, row, kv_len=length)
      return row

    rows = shardings(engine, length)
    fns["extend", length] = jax.jit(fn, in_shardings=(engine.held_formats, rows, None, None),
                                    out_shardings=rows, donate_argnums=1,
                                    compiler_options=engine.compiler_options)
  return fns["extend", length]
