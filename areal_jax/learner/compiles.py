"""Counts XLA compilations done by the calling thread (``jax.monitoring`` compile events).

The learner reports the compilations of each train step (``compiles`` in ``metrics.jsonl``): 0 on a
steady workload once its shapes have been seen. Counts are per thread, so a sampler compiling in
its own thread at the same time is not counted as the learner's.
"""

from __future__ import annotations

import threading

import jax

# The event JAX records once per backend compilation (jax/_src/dispatch.py BACKEND_COMPILE_EVENT).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_local = threading.local()
_lock = threading.Lock()
_registered = False


def _listener(event: str, duration_secs: float, **_) -> None:
  if event == BACKEND_COMPILE_EVENT:
    _local.count = getattr(_local, "count", 0) + 1


def count() -> int:
  """Compilations this thread has done since the first call of ``count`` in the process."""
  global _registered
  with _lock:
    if not _registered:
      jax.monitoring.register_event_duration_secs_listener(_listener)
      _registered = True
  return getattr(_local, "count", 0)
