"""Running workflow episodes against a rollout engine: turn requests, their routing, the runners.

Every turn of an episode is a one-sample ``GroupRequest`` with a fresh id from a range of its own
(``TURN_ID_BASE`` and up: training groups use 0, 1, ..., evaluation groups negative ids) and
``metadata["kind"] == "turn"``; the controller's loop hands every such sample from ``engine.poll``
to ``TurnClient.deliver``, which wakes the waiting episode. A stopped controller wakes every
waiting episode with ``Stopped``.

Two runners play episodes behind one interface (``launch``, ``evaluate``, ``shutdown``, ``turns``):
``EpisodeRunner`` runs blocking workflows, a worker thread per running episode;
``AsyncEpisodeRunner`` (``async_episodes.py``) runs ``async def run`` workflows, all on one event
loop. Both count their running episodes in an ``EpisodeStats``.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout

from areal_jax.rollout_api import GroupRequest, RolloutEngine, Sample, SamplingParams
from areal_jax.runtime.episode_stats import EpisodeStats

TURN_ID_BASE = 1 << 40


class Stopped(Exception):
  """The controller stopped while an episode waited for a turn."""


def episode_seed(run_seed: int, group_id: int, index: int) -> int:
  """The sampling seed of episode ``index`` of group ``group_id`` (distinct per episode)."""
  return ((run_seed * 1_000_003 + group_id) * 1009 + index) % (2**31 - 1)


def _settle(future: Future, result) -> None:
  if isinstance(result, BaseException):
    future.set_exception(result)
  else:
    future.set_result(result)


class TurnClient:
  """A thread-safe ``workflows.Client`` over one engine, shared by all running episodes.

  Each waiting turn holds a ``settle(sample or exception)`` callback: the blocking ``generate``
  settles a future it waits on, the async client (``async_episodes.AsyncTurnClient``) one of the
  event loop. ``busy_s()``: the seconds so far during which at least one turn waited."""

  def __init__(self, engine: RolloutEngine, stop: threading.Event, kind: str = "turn"):
    self.engine, self._stop, self.kind = engine, stop, kind
    self._ids = itertools.count(TURN_ID_BASE)
    self._waiting: dict[int, Callable] = {}
    self._lock = threading.Lock()
    self._busy_s, self._busy_since = 0.0, 0.0

  def _pop(self, rid: int):
    """(under the lock) The turn's ``settle``, or None; the busy time ends with the last turn."""
    settle = self._waiting.pop(rid, None)
    if settle is not None and not self._waiting:
      self._busy_s += time.monotonic() - self._busy_since
    return settle

  def busy_s(self) -> float:
    with self._lock:
      return self._busy_s + (time.monotonic() - self._busy_since if self._waiting else 0.0)

  def request(self, prompt_tokens: list[int], params: SamplingParams,
              settle: Callable) -> GroupRequest:
    """A turn's request with a fresh id; ``settle`` will receive its sample (or ``Stopped``)."""
    with self._lock:
      if self._stop.is_set():
        raise Stopped()
      rid = next(self._ids)
      if not self._waiting:
        self._busy_since = time.monotonic()
      self._waiting[rid] = settle
    # "continue": the JAX sampler keeps the finished turn's KV for the next turn's prompt
    return GroupRequest(rid, list(prompt_tokens), 1, params, {"kind": self.kind, "continue": True})

  def forget(self, rid: int) -> None:
    """Drops a turn nobody waits for any more (its sample, if it comes, is ignored)."""
    with self._lock:
      self._pop(rid)

  def fail(self, rid: int, error: BaseException) -> None:
    """Settles a waiting turn with ``error`` (e.g. the engine refused to take it)."""
    with self._lock:
      settle = self._pop(rid)
    if settle is not None:
      settle(error)

  def generate(self, prompt_tokens: list[int], params: SamplingParams) -> Sample:
    future: Future = Future()
    request = self.request(prompt_tokens, params, lambda result: _settle(future, result))
    try:
      self.engine.submit(request)
      while True:
        try:
          return future.result(timeout=0.1)
        except FutureTimeout:
          if self._stop.is_set():
            raise Stopped() from None
    finally:
      self.forget(request.group_id)

  def deliver(self, sample: Sample) -> bool:
    """Wakes the episode waiting for ``sample``; False if none waits (e.g. it was stopped)."""
    with self._lock:
      settle = self._pop(sample.group_id)
    if settle is None:
      return False
    settle(sample)
    return True

  def stop_waiting(self) -> None:
    """Wakes every waiting episode with ``Stopped`` (the controller stopped)."""
    with self._lock:
      if self._waiting:
        self._busy_s += time.monotonic() - self._busy_since
      waiting, self._waiting = self._waiting, {}
    for settle in waiting.values():
      settle(Stopped())

  @property
  def waiting(self) -> int:
    """Turns submitted whose samples have not come back."""
    with self._lock:
      return len(self._waiting)


class Runner:
  """What both runners share: the label of a finished episode and evaluation over ``launch``."""

  turns: TurnClient

  def launch(self, group_id: int, index: int, example: dict, params: SamplingParams,
             kind: str) -> Future:
    """Starts one episode; the future gives its ``Episode`` (labelled), or None if it was stopped
    or failed (the failure goes to ``on_error``)."""
    raise NotImplementedError

  def shutdown(self) -> None:
    raise NotImplementedError

  @staticmethod
  def label(ep, group_id: int, index: int, kind: str):
    ep.sample.group_id, ep.sample.index = group_id, index
    ep.sample.metadata.update(kind=kind, turns=ep.turns, end=ep.end)
    return ep

  def evaluate(self, jobs, k: int, params: SamplingParams, seed: int, check, progress=None):
    """``k`` episodes for each ``(group_id, example)`` of ``jobs``, as lists of ``Episode``s.

    ``check()`` raises if the run failed; ``progress(done, total)`` as examples finish."""
    futures = [[self.launch(gid, i, example,
                            dataclasses.replace(params, seed=episode_seed(seed, gid, i)), "eval")
                for i in range(k)] for gid, example in jobs]
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
    out = [[None if f.cancelled() else f.result() for f in fs] for fs in futures]
    if any(ep is None for eps in out for ep in eps):
      raise RuntimeError("evaluation episodes were stopped: the rollout controller stopped")
    return out


class EpisodeRunner(Runner):
  """Plays blocking workflow episodes on worker threads: training ones (at most ``train_workers``
  at once) and evaluation ones (on a pool of their own so they never wait behind training ones).

  ``on_error(exc)`` receives an episode's unexpected exception (the run then stops); an episode
  cut short by the stop ends quietly.
  """

  def __init__(self, workflow, ctx, engine: RolloutEngine, stop: threading.Event,
               train_workers: int, on_error, eval_workers: int = 64,
               stats: EpisodeStats | None = None):
    self.workflow, self.ctx, self.on_error = workflow, ctx, on_error
    self.stats = stats or EpisodeStats()
    self.turns = TurnClient(engine, stop)
    self._train = ThreadPoolExecutor(max(1, train_workers), thread_name_prefix="episode")
    self._eval = ThreadPoolExecutor(eval_workers, thread_name_prefix="eval-episode")

  def shutdown(self) -> None:
    """Waits for the episodes to end (they see the stop within 0.1 s)."""
    self.turns.stop_waiting()
    self._train.shutdown(wait=True, cancel_futures=True)
    self._eval.shutdown(wait=True, cancel_futures=True)

  def play(self, group_id: int, index: int, example: dict, params: SamplingParams, kind: str):
    """One episode on this thread (see ``launch``)."""
    self.stats.started()
    try:
      ep = self.workflow.run(example, self.ctx, self.turns, params)
    except Stopped:
      return None
    except BaseException as e:  # pylint: disable=broad-except
      self.on_error(e)
      return None
    finally:
      self.stats.ended()
    return self.label(ep, group_id, index, kind)

  def launch(self, group_id, index, example, params, kind) -> Future:
    pool = self._eval if kind == "eval" else self._train
    return pool.submit(self.play, group_id, index, example, params, kind)
