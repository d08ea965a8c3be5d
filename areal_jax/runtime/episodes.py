"""Running workflow episodes against a rollout engine: turn requests and their routing.

An episode (``areal_jax.workflows``) calls ``TurnClient.generate`` once per turn from its own
thread. Each call is a one-sample ``GroupRequest`` with a fresh id from a range of its own
(``TURN_ID_BASE`` and up: training groups use 0, 1, ..., evaluation groups negative ids) and
``metadata["kind"] == "turn"``; the controller's loop hands every such sample from
``engine.poll`` to ``deliver``, which wakes the waiting episode. A stopped controller wakes every
waiting episode with ``Stopped``. ``EpisodeRunner`` plays the episodes on worker threads.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout

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


class EpisodeRunner:
  """Plays workflow episodes on worker threads: training ones (``submit``) and evaluation ones
  (``evaluate``, on a pool of their own so they never wait behind training episodes).

  ``on_error(exc)`` receives an episode's unexpected exception (the run then stops); an episode
  cut short by the stop ends quietly.
  """

  def __init__(self, workflow, ctx, engine: RolloutEngine, stop: threading.Event,
               train_workers: int, on_error, eval_workers: int = 64):
    self.workflow, self.ctx, self.on_error = workflow, ctx, on_error
    self.turns = TurnClient(engine, stop)
    self._train = ThreadPoolExecutor(max(1, train_workers), thread_name_prefix="episode")
    self._eval = ThreadPoolExecutor(eval_workers, thread_name_prefix="eval-episode")

  def shutdown(self) -> None:
    """Waits for the episodes to end (they see the stop within 0.1 s)."""
    self._train.shutdown(wait=True, cancel_futures=True)
    self._eval.shutdown(wait=True, cancel_futures=True)

  def play(self, group_id: int, index: int, example: dict, params: SamplingParams, kind: str):
    """One episode, its sample labelled (group, index, kind, turns, end); None if stopped or
    failed (the failure goes to ``on_error``)."""
    try:
      ep = self.workflow.run(example, self.ctx, self.turns, params)
    except Stopped:
      return None
    except BaseException as e:  # pylint: disable=broad-except
      self.on_error(e)
      return None
    ep.sample.group_id, ep.sample.index = group_id, index
    ep.sample.metadata.update(kind=kind, turns=ep.turns, end=ep.end)
    return ep

  def submit(self, fn, *args) -> Future:
    """Runs ``fn(*args)`` (which calls ``play``) on a training episode thread."""
    return self._train.submit(fn, *args)

  def evaluate(self, jobs, k: int, params: SamplingParams, seed: int, check, progress=None):
    """``k`` episodes for each ``(group_id, example)`` of ``jobs``, as lists of ``Episode``s.

    ``check()`` raises if the run failed; ``progress(done, total)`` as examples finish."""
    futures = [[self._eval.submit(self.play, gid, i, example,
                                  dataclasses.replace(params, seed=episode_seed(seed, gid, i)),
                                  "eval") for i in range(k)] for gid, example in jobs]
    reported = 0
    while True:
      done = sum(all(f.done() for f in fs) for fs in futures)
      if done == len(futures):
        break
      if progress is not None and done > reported:
        reported = done
        progress(done, len(futures))
      check()
      time.sleep(0.01)
    check()
    if progress is not None:
      progress(len(futures), len(futures))
    out = [[f.result() for f in fs] for fs in futures]
    if any(ep is None for eps in out for ep in eps):
      raise RuntimeError("evaluation episodes were stopped: the rollout controller stopped")
    return out
