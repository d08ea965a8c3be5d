"""The sampler's compiled program variants (one per shape: prefill bucket and rows, kv bucket and
width, ...), each built on first use. That first use traces and compiles it (for a 1.5B model on a
GPU, XLA's matmul autotuning took minutes a program, measured on an H200), so its first call is
timed, logged (as a warning from ``SLOW_COMPILE_S`` on, which the launcher's default verbosity
shows) and summed in the engine's ``compile_stats``."""

from __future__ import annotations

import functools
import logging
import time

log = logging.getLogger(__name__)
SLOW_COMPILE_S = 20.0  # a program variant whose first call took longer is logged as a warning


def get(table: dict, key, make, what: str, stats: dict):
  """Variant ``key`` of ``table``, built by ``make()`` the first time (then its first call is
  timed into ``stats``: ``{"compiles", "compile_s"}``)."""
  fn = table.get(key)
  if fn is not None:
    return fn
  fn = table[key] = make()
  return functools.partial(_timed_call, fn, what, stats)


def _timed_call(fn, what: str, stats: dict, *args):
  t0 = time.perf_counter()
  out = fn(*args)
  seconds = time.perf_counter() - t0
  stats["compiles"] += 1
  stats["compile_s"] += seconds
  level = logging.WARNING if seconds >= SLOW_COMPILE_S else logging.INFO
  log.log(level, "sampler: %s compiled in %.1f s (its first call)%s", what, seconds,
          "; a persistent compilation cache (runtime.compile_cache_dir) keeps it for later runs"
          if level == logging.WARNING else "")
  return out
