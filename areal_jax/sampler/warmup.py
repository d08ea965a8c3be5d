"""Compiling every program variant of a ``DecodeEngine`` up front (prefill buckets x rows, insert
rows per bucket, generate kv buckets x widths, and where the engine picks a program by whether the
slots truncate, ``truncation_on_host``, both of each; moves), instead of at each variant's first
use.

Each variant compiles at its first call (the call returns once it is compiled and dispatched), so
``progress(done, total, what)`` after each call tells how far the compiling is: on a GPU, XLA's
matmul autotuning can take minutes for one decode program (measured on an H200 at the
Qwen2.5-1.5B shape), and a warm-up of dozens of variants should not be silent that long."""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

Progress = Callable[[int, int, str], None]  # (programs done, programs in all, the last one)


def _variants(engine):
  """Insert rows, prefill batch rows (beyond one) and move rows that ``warmup`` compiles."""
  c, s = engine.config, engine.config.num_slots
  rows = sorted({engine.insert_rows(k) for k in range(1, s + 1)})
  batches = sorted({engine.prefill_rows(k) for k in range(2, c.max_prefill_batch + 1)} - {1})
  moves = sorted({engine.insert_rows(k) for k in range(1, s // 2 + 1)})  # moves of up to s/2
  return rows, batches, moves


def count(engine) -> int:
  """Programs ``warmup`` compiles for ``engine`` (the ``total`` it reports)."""
  rows, batches, moves = _variants(engine)
  buckets = len(engine.prefill_buckets)
  generates = len(engine.kv_buckets) * len(engine.width_buckets) * _truncations(engine)
  return buckets * (1 + len(batches)) + (buckets + 1) * len(rows) + generates + len(moves)


def _truncations(engine) -> int:
  """Generate programs per (kv bucket, width): 2 where the engine picks one by whether the
  slots truncate (top-k / top-p) on the host, else 1."""
  return 2 if engine.truncation_on_host else 1


def warmup(engine, state, progress: Progress | None = None):
  """Compiles every prefill, insert, generate and move variant of ``engine`` (no slot is armed
  afterwards), calling ``progress`` after each; returns the state."""
  c, s = engine.config, engine.config.num_slots
  buckets = engine.prefill_buckets
  rows, batches, moves = _variants(engine)
  total, done = count(engine), 0

  def tick(what: str) -> None:
    nonlocal done
    done += 1
    if progress is not None:
      progress(done, total, what)

  prefixes = []
  for b in buckets:
    prefixes.append(engine.prefill(engine.params, np.zeros((b,), np.int32)))
    tick(f"prefill {b}")
  for n in batches:
    for b in buckets:
      engine.prefill_batch(engine.params, [np.zeros((b,), np.int32)] * n)
      tick(f"prefill {n} x {b}")
  # a paged cache: every write into the trash page
  trash = np.full((s, engine.pages_per_slot), c.kv_pages, np.int32) if engine.paged else None
  for b, prefix in zip(list(buckets) + [None], prefixes + [None]):
    for n in rows:  # arms slots then deactivates them all below
      state = engine.insert(state, prefix, list(range(n)), token=[0] * n, pos=[0] * n,
                            end=[0] * n, keys=np.zeros((n, 2), np.uint32), temperature=1.0,
                            top_k=0, top_p=1.0, greedy=False, stop_ids=[],
                            pages=None if trash is None else trash[:n])
      tick(f"insert {n} rows" + (f" of prefix {b}" if b else ""))
  def arm_slot_0(top_p: float):  # slot 0 lies in every width
    return engine.insert(state, None, [0], token=[0], pos=[0], end=[0],
                         keys=np.zeros((1, 2), np.uint32), temperature=1.0, top_k=0, top_p=top_p,
                         greedy=False, stop_ids=[], pages=None if trash is None else trash[:1])

  for truncating in range(_truncations(engine)):
    if truncating:  # the programs that sort: slot 0 asks for top-p
      state = arm_slot_0(0.5)
    for kv_len in engine.kv_buckets:
      for width in engine.width_buckets:
        state, out = engine.generate(engine.params, state, kv_len, width, pages=trash)
        tick(f"generate kv {kv_len} width {width}" + (" top-k/top-p" if truncating else ""))
    if truncating:  # no slot left asking for it
      state = arm_slot_0(1.0)
  for n in moves:
    k = min(n, s // 2)
    state = engine.move(state, list(range(k)), list(range(s - k, s)))
    tick(f"move {n}")
  state = engine.deactivate(state, list(range(s)))
  jax.block_until_ready(out)
  assert done == total, (done, total)
  return state
