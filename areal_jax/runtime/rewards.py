"""Scores completions in a pool of worker processes with a time limit.

A reward function that raises or runs past ``timeout_s`` scores 0 and is counted; it never stalls
the run. Workers are separate processes (spawned, not forked from the JAX process), so a hanging
reward can be killed: on a timeout the pool is replaced. A worker exits on its own when the process
that started it is gone, even one killed with SIGKILL, so a killed run leaves no worker behind. Workers import the reward function's module
before they are used (``warmup``), so the time limit measures scoring, not interpreter start-up.
Scripts that start a run must guard it with ``if __name__ == "__main__":`` (spawned workers import
the main module).
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from typing import Any

_WARMUP_TIMEOUT_S = 300.0


def _exit_with(owner_pid: int) -> None:
  """Worker initializer: a thread that ends the worker once its owner is gone (it is then adopted,
  so its parent changes). Polling works on every platform and whichever thread started the pool."""

  def watch():
    while os.getppid() == owner_pid:
      time.sleep(0.5)
    os._exit(1)

  threading.Thread(target=watch, name="exit-with-owner", daemon=True).start()


def _import(module: str) -> None:
  importlib.import_module(module)


def _score_all(fn: Callable[[str, Any], float], texts: list[str], example: Any) -> list[float]:
  out = []
  for text in texts:
    try:
      out.append(float(fn(text, example)))
    except Exception:  # a crashing reward scores 0 (counted by the caller as a failure)
      out.append(float("nan"))
  return out


class RewardPool:
  """``score(texts, example) -> (rewards, n_failed)`` with the picklable reward ``fn``."""

  def __init__(self, fn: Callable[[str, Any], float], workers: int, timeout_s: float):
    self.fn, self.timeout_s, self.workers = fn, timeout_s, max(1, workers)
    self._lock = threading.Lock()
    self._replace_lock = threading.Lock()
    self._pool = self._new_pool()
    self.failures = 0
    self.timeouts = 0

  def _new_pool(self) -> cf.ProcessPoolExecutor:
    pool = cf.ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                  initializer=_exit_with, initargs=(os.getpid(),))
    warm = [pool.submit(_import, self.fn.__module__) for _ in range(self.workers)]
    cf.wait(warm, timeout=_WARMUP_TIMEOUT_S)
    return pool

  def score(self, texts: list[str], example: Any) -> tuple[list[float], int]:
    for _ in range(3):
      with self._lock:
        pool = self._pool
      try:
        future = pool.submit(_score_all, self.fn, texts, example)
        break
      except RuntimeError:  # the pool was just replaced by another thread: use the new one
        continue
    else:
      return self._failed(texts, "failures")
    try:
      raw = future.result(timeout=self.timeout_s)
    except cf.TimeoutError:
      self._replace(pool)
      return self._failed(texts, "timeouts")
    except Exception:  # the worker died (e.g. segfault): the pool is broken
      self._replace(pool)
      return self._failed(texts, "failures")
    failed = sum(1 for r in raw if r != r)
    with self._lock:
      self.failures += failed
    return [0.0 if r != r else r for r in raw], failed

  def _failed(self, texts, counter: str) -> tuple[list[float], int]:
    with self._lock:
      setattr(self, counter, getattr(self, counter) + len(texts))
    return [0.0] * len(texts), len(texts)

  def _replace(self, broken: cf.ProcessPoolExecutor) -> None:
    with self._replace_lock:
      with self._lock:
        if self._pool is not broken:
          return
      for proc in list(getattr(broken, "_processes", {}).values()):
        proc.kill()
      broken.shutdown(wait=False, cancel_futures=True)
      fresh = self._new_pool()
      with self._lock:
        self._pool = fresh

  def close(self) -> None:
    with self._lock:
      self._pool.shutdown(wait=False, cancel_futures=True)
