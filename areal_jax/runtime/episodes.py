"""Running workflow episodes against a rollout engine: turn requests and their routing.

An episode (``areal_jax.workflows``) calls ``TurnClient.generate`` once per turn from its own
thread. Each call is a one-sample ``GroupRequest`` with a fresh id from a range of its own
(``TURN_ID_BASE`` and up: training groups use 0, 1, ..., evaluation groups negative ids) and
``metadata["kind"] == "turn"``; the controller's loop hands every such sample from
``engine.poll`` to ``deliver``, which wakes the waiting episode. A stopped controller wakes every
waiting episode with ``Stopped``.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future, TimeoutError as FutureTimeout

from areal_jax.rollout_api import GroupRequest, RolloutEngine, Sample, SamplingParams

TURN_ID_BASE = 1 << 40


class Stopped(Exception):
  """The controller stopped while an episode waited for a turn."""


def episode_seed(run_seed: int, group_id: int, index: int) -> int:
  """The sampling seed of episode ``index`` of group ``group_id`` (distinct per episode)."""
  return ((run_seed * 1_000_003 + group_id) * 1009 + index) % (2**31 - 1)


class TurnClient:
  """A thread-safe ``workflows.Client`` over one engine, shared by all running episodes."""

  def __init__(self, engine: RolloutEngine, stop: threading.Event, kind: str = "turn"):
    self.engine, self._stop, self.kind = engine, stop, kind
    self._ids = itertools.count(TURN_ID_BASE)
    self._waiting: dict[int, Future] = {}
    self._lock = threading.Lock()

  def generate(self, prompt_tokens: list[int], params: SamplingParams) -> Sample:
    future: Future = Future()
    with self._lock:
      rid = next(self._ids)
      self._waiting[rid] = future
    # "continue": the JAX sampler keeps the finished turn's KV for the next turn's prompt
    self.engine.submit(GroupRequest(rid, list(prompt_tokens), 1, params,
                                    {"kind": self.kind, "continue": True}))
    while True:
      try:
        return future.result(timeout=0.1)
      except FutureTimeout:
        if self._stop.is_set():
          with self._lock:
            self._waiting.pop(rid, None)
          raise Stopped() from None

  def deliver(self, sample: Sample) -> bool:
    """Wakes the episode waiting for ``sample``; False if none waits (e.g. it was stopped)."""
    with self._lock:
      future = self._waiting.pop(sample.group_id, None)
    if future is None:
      return False
    future.set_result(sample)
    return True

  @property
  def waiting(self) -> int:
    with self._lock:
      return len(self._waiting)
