"""Bridges the rollout engine (its own thread) and the asyncio server: one route per request.

``Dispatcher.submit`` (on the event loop) gives a request a group id and an ``asyncio.Queue``; a
poller thread drains ``engine.poll`` and puts each finished ``Sample`` on its request's queue as
``("done", sample)``. With the JAX engine, tokens also stream while they are generated: its
``set_token_listener`` hook sends every decode call's new tokens out as
``("tokens", index, token_ids)``. They may arrive after the final sample of their sequence, which is
the authority on the tokens; a consumer streams ``sample.tokens`` beyond what it already sent.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import queue as queue_lib
import threading
from collections.abc import Callable

from areal_jax.rollout_api import GroupRequest, RolloutEngine, SamplingParams


def tap_tokens(engine, on_tokens: Callable[[int, int, list[int]], None]) -> bool:
  """Makes ``engine`` report new tokens as ``on_tokens(group_id, index, tokens)`` after each decode
  call; False (no streaming of partial results) when the engine has no such hook."""
  listen = getattr(engine, "set_token_listener", None)
  if listen is None:
    return False
  listen(on_tokens)
  return True


class Dispatcher:
  """Owns the engine's start/stop and routes its output to per-request asyncio queues."""

  def __init__(self, engine: RolloutEngine):
    self.engine = engine
    self._ids = itertools.count(1)
    self._routes: dict[int, Callable] = {}  # group id -> put(item), callable from any thread
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self.finished = collections.Counter()  # samples out of the engine, by finish reason
    self.requests = self.tokens = 0  # requests submitted, tokens generated (the status line)
    self.streams_tokens = tap_tokens(engine, self._on_tokens)

  def start(self) -> None:
    self.engine.start()
    self._stop.clear()
    self._thread = threading.Thread(target=self._poll_loop, name="serve-dispatch", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    self.engine.stop()  # aborts what is in flight; deliver those samples too
    for sample in self.engine.poll(0.0):
      self._route(sample.group_id, ("done", sample))

  def submit(self, prompt_tokens: list[int], n: int, params: SamplingParams,
             metadata: dict | None = None) -> tuple[int, asyncio.Queue]:
    """Queues a request from the running event loop; returns its group id and output queue."""
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    group_id = self._submit(lambda item: loop.call_soon_threadsafe(queue.put_nowait, item),
                            prompt_tokens, n, params, metadata)
    return group_id, queue

  def generate(self, prompt_tokens: list[int], params: SamplingParams, timeout: float = 600.0):
    """Blocking, from any thread but the event loop's: one sample (not recorded anywhere)."""
    return self.generate_many(prompt_tokens, 1, params, timeout)[0]

  def generate_many(self, prompt_tokens: list[int], n: int, params: SamplingParams,
                    timeout: float = 600.0) -> list:
    """Blocking, like ``generate``: ``n`` samples of one prompt, one group on the engine."""
    out: queue_lib.Queue = queue_lib.Queue()
    group_id = self._submit(out.put, prompt_tokens, n, params, None)
    samples = []
    try:
      while len(samples) < n:
        item = out.get(timeout=timeout)
        if item[0] == "done":
          samples.append(item[1])
      return samples
    finally:
      self.release(group_id, abort=len(samples) < n)

  def _submit(self, put, prompt_tokens, n, params, metadata) -> int:
    group_id = next(self._ids)
    with self._lock:
      self._routes[group_id] = put
      self.requests += 1
    self.engine.submit(GroupRequest(group_id, list(prompt_tokens), n, params, dict(metadata or {})))
    return group_id

  def release(self, group_id: int, abort: bool = False) -> None:
    """Forgets a request's route (its consumer is done); ``abort`` also ends it in the engine."""
    with self._lock:
      self._routes.pop(group_id, None)
    if abort:
      self.engine.abort(group_id)

  def inflight(self) -> int:
    with self._lock:
      return len(self._routes)

  def _on_tokens(self, group_id: int, index: int, tokens: list[int]) -> None:
    self._route(group_id, ("tokens", index, list(tokens)))

  def _route(self, group_id: int, item) -> None:
    with self._lock:
      put = self._routes.get(group_id)
    if put is None:
      return
    try:
      put(item)
    except RuntimeError:  # the loop closed (server shutting down)
      pass

  def _poll_loop(self) -> None:
    while not self._stop.is_set():
      for sample in self.engine.poll(0.05):
        self.finished[sample.finish_reason] += 1
        self.tokens += len(sample.tokens)
        self._route(sample.group_id, ("done", sample))
