"""Compiling every program variant of a ``DecodeEngine`` up front (prefill buckets x rows, insert
rows per bucket, generate kv buckets x widths, moves), instead of at each variant's first use."""

from __future__ import annotations

import jax
import numpy as np


def warmup(engine, state):
  """Compiles every prefill, insert, generate and move variant of ``engine`` (no slot is armed
  afterwards); returns the state."""
  c, s = engine.config, engine.config.num_slots
  rows = sorted({engine.insert_rows(k) for k in range(1, s + 1)})
  prefixes = [engine.prefill(engine.params, np.zeros((b,), np.int32))
              for b in engine.prefill_buckets]
  for n in sorted({engine.prefill_rows(k) for k in range(2, c.max_prefill_batch + 1)} - {1}):
    for b in engine.prefill_buckets:
      engine.prefill_batch(engine.params, [np.zeros((b,), np.int32)] * n)
  # a paged cache: every write into the trash page
  trash = np.full((s, engine.pages_per_slot), c.kv_pages, np.int32) if engine.paged else None
  for prefix in prefixes + [None]:
    for n in rows:  # arms slots then deactivates them all below
      state = engine.insert(state, prefix, list(range(n)), token=[0] * n, pos=[0] * n,
                            end=[0] * n, keys=np.zeros((n, 2), np.uint32), temperature=1.0,
                            top_k=0, top_p=1.0, greedy=False, stop_ids=[],
                            pages=None if trash is None else trash[:n])
  for kv_len in engine.kv_buckets:
    for width in engine.width_buckets:
      state, out = engine.generate(engine.params, state, kv_len, width, pages=trash)
  for n in sorted({engine.insert_rows(k) for k in range(1, s // 2 + 1)}):  # moves of up to s/2
    k = min(n, s // 2)
    state = engine.move(state, list(range(k)), list(range(s - k, s)))
  state = engine.deactivate(state, list(range(s)))
  jax.block_until_ready(out)
  return state
