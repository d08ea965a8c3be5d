"""Counters of running episodes and of their environments' calls, read once per training step.

Episodes report each environment call through ``workflows.Context.report_env(seconds, failure)``
(``env_call`` here); the runners count episodes as they start and end. ``report()`` gives the
step row's fields (``metrics.jsonl``, docs/getting-started.md):

  ``episodes_in_flight``       episodes running now;
  ``episodes_in_flight_mean``  their time average since the previous report;
  ``env_steps``                environment calls reported since the previous report;
  ``env_step_p50_s``, ``env_step_p99_s``  those calls' wall seconds, median and 99th percentile
                               (None without calls);
  ``env_failures``             failed environment calls since the run (re)started, and
  ``env_failures/<kind>``      the same per kind of failure.

``tool_call_frac(samples)`` gives the step row's share of trained episodes that called a tool.

Failure kinds come from environments (untrusted): a kind is cut to ``KIND_CHARS`` characters of
``[a-z0-9_]`` and past ``MAX_KINDS`` distinct kinds the rest count as "other". Latencies are kept
in a uniform reservoir of ``MAX_KEPT`` per report, so memory stays bounded at any call rate.
"""

from __future__ import annotations

import collections
import random
import re
import threading
import time

import numpy as np

MAX_KEPT = 1 << 15
MAX_KINDS = 16
KIND_CHARS = 32


def tool_call_frac(samples) -> float | None:
  """Share of ``samples`` whose episode called a tool at least once (``metadata["calls"] > 0``).

  Only samples whose workflow counts its calls (tool and Python-tool episodes) are counted; None
  when no sample does (e.g. single-turn runs).
  """
  counted = [s.metadata["calls"] > 0 for s in samples if "calls" in s.metadata]
  return float(np.mean(counted)) if counted else None


def failure_kind(kind) -> str:
  """``kind`` as a metrics name: lower case ``[a-z0-9_]``, at most ``KIND_CHARS`` characters."""
  name = re.sub(r"[^a-z0-9_]+", "_", str(kind).lower())[:KIND_CHARS].strip("_")
  return name or "other"


class EpisodeStats:
  """Thread-safe: episode runners, the event loop and the trainer's report call it at once."""

  def __init__(self, clock=time.monotonic):
    self._clock = clock
    self._lock = threading.Lock()
    self._rng = random.Random(0)
    self.in_flight = 0
    self._since = self._changed = clock()
    self._area = 0.0  # episodes x seconds since the last report
    self._latencies: list[float] = []
    self._calls = 0
    self.failures: collections.Counter = collections.Counter()

  def _advance(self) -> float:
    now = self._clock()
    self._area += self.in_flight * (now - self._changed)
    self._changed = now
    return now

  def started(self) -> None:
    with self._lock:
      self._advance()
      self.in_flight += 1

  def ended(self) -> None:
    with self._lock:
      self._advance()
      self.in_flight -= 1

  def env_call(self, seconds: float, failure: str | None = None) -> None:
    """One environment call took ``seconds``; ``failure``: None, or what went wrong."""
    with self._lock:
      self._calls += 1
      if len(self._latencies) < MAX_KEPT:
        self._latencies.append(float(seconds))
      else:
        j = self._rng.randrange(self._calls)
        if j < MAX_KEPT:
          self._latencies[j] = float(seconds)
      if failure is not None:
        kind = failure_kind(failure)
        if kind not in self.failures and len(self.failures) >= MAX_KINDS:
          kind = "other"
        self.failures[kind] += 1

  def report(self) -> dict:
    """The fields above; the averages and latencies start over."""
    with self._lock:
      now = self._advance()
      period = now - self._since
      mean = self._area / period if period > 0 else float(self.in_flight)
      latencies, calls = self._latencies, self._calls
      self._latencies, self._calls, self._area, self._since = [], 0, 0.0, now
      failures = dict(self.failures)
      in_flight = self.in_flight
    p50, p99 = (np.percentile(latencies, [50, 99]).tolist() if latencies else (None, None))
    return {"episodes_in_flight": in_flight, "episodes_in_flight_mean": mean,
            "env_steps": calls, "env_step_p50_s": p50, "env_step_p99_s": p99,
            "env_failures": sum(failures.values()),
            **{f"env_failures/{k}": v for k, v in sorted(failures.items())}}
