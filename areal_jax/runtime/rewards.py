"""Scores completions in a pool of worker processes with a time limit.

A reward function that raises or runs past ``timeout_s`` scores 0 and is counted, never stalls the
run. Workers are separate processes (spawned, not forked from the JAX process), so a hanging reward
can be killed: on a timeout the pool is replaced.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import threading
from collections.abc import Callable
from typing import Any


def _score_all(fn: Callable[[str, Any], float], texts: list[str], example: Any) -> list[float]:
  out = []
  for text in texts:
    try:
      out.append(float(fn(text, example)))
    except Exception:  # a crashing reward scores 0 (counted by the caller as a failure)
      out.append(float("nan"))
  return out


class RewardPool:
  """``score(fn, texts, example) -> (rewards, n_failed)``; ``fn`` must be picklable."""

  def __init__(self, workers: int, timeout_s: float):
    self.timeout_s = timeout_s
    self.workers = max(1, workers)
    self._lock = threading.Lock()
    self._pool = self._new_pool()
    self.failures = 0
    self.timeouts = 0

  def _new_pool(self) -> cf.ProcessPoolExecutor:
    ctx = multiprocessing.get_context("spawn")
    return cf.ProcessPoolExecutor(self.workers, mp_context=ctx)

  def score(self, fn, texts: list[str], example: Any) -> tuple[list[float], int]:
    with self._lock:
      pool = self._pool
    future = pool.submit(_score_all, fn, texts, example)
    try:
      raw = future.result(timeout=self.timeout_s)
    except cf.TimeoutError:
      self._replace(pool)
      with self._lock:
        self.timeouts += len(texts)
      return [0.0] * len(texts), len(texts)
    except Exception:  # the worker died (e.g. segfault): the pool is broken
      self._replace(pool)
      with self._lock:
        self.failures += len(texts)
      return [0.0] * len(texts), len(texts)
    failed = sum(1 for r in raw if r != r)
    with self._lock:
      self.failures += failed
    return [0.0 if r != r else r for r in raw], failed

  def _replace(self, broken: cf.ProcessPoolExecutor) -> None:
    with self._lock:
      if self._pool is not broken:
        return
      self._pool = self._new_pool()
    for proc in list(getattr(broken, "_processes", {}).values()):
      proc.kill()
    broken.shutdown(wait=False, cancel_futures=True)

  def close(self) -> None:
    with self._lock:
      self._pool.shutdown(wait=False, cancel_futures=True)
