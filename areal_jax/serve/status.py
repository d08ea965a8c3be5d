"""The server's status line: every ``serve.status_every_s`` one line of what a person watching it
wants to know, and the same numbers in ``/health`` (its ``serving`` field).

  status: serving version 3; 31 requests, 250 tokens/s over the last 30 s; turns 146 recorded,
  69 judged, 40 trained, 2 stale; 3 train steps

Requests and tokens/s are over the window since the previous line; the turn counts (from the turn
store) and train steps are totals. The serve demo prints the same part after its users' own numbers
(``areal_jax.serve.demo``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def describe(n: dict) -> str:
  """The server's part of a status line from :meth:`ServeStatus.numbers` (or ``/health``'s
  ``serving`` field)."""
  steps = n.get("train_steps")
  return (f"serving version {n['version']}; {n['window_requests']} requests, "
          f"{n['tokens_per_s']:.0f} tokens/s over the last {n['window_s']:.0f} s; turns "
          f"{n['turns_recorded']} recorded, {n['turns_judged']} judged, {n['turns_trained']} "
          f"trained, {n['turns_stale']} stale" + ("" if steps is None else f"; {steps} train steps"))


class ServeStatus:
  """Counts windows over ``snapshot()`` (``version``, ``requests`` and ``tokens`` so far,
  ``turns``: the store's counts, ``train_steps`` or None) and prints a line every ``every_s`` (0:
  never) from a thread of its own."""

  def __init__(self, snapshot: Callable[[], dict], every_s: float, clock=time.monotonic,
               out: Callable[[str], None] | None = None):
    self._snapshot, self.every_s, self._clock = snapshot, float(every_s), clock
    self._out = out or (lambda line: print(line, flush=True))
    self._lock = threading.Lock()
    self._start = self._clock()
    self._mark = (self._start, 0, 0)  # time, requests and tokens at the window's start
    self._window = dict(window_s=0.0, window_requests=0, tokens_per_s=0.0)
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def numbers(self) -> dict:
    """The current totals and the last full window's rates (since the start before the first)."""
    snap = self._snapshot()
    turns = snap.get("turns", {})
    with self._lock:
      window = dict(self._window)
      if not window["window_s"]:  # no line yet: the time since the start
        window = self._rates(snap, self._clock())
    return dict(version=snap["version"], requests=snap["requests"], tokens=snap["tokens"],
                **window, turns_recorded=turns.get("turns", 0),
                turns_judged=turns.get("judge_status.judged", 0),
                turns_trained=turns.get("train_status.trained", 0),
                turns_stale=turns.get("train_status.stale", 0), train_steps=snap.get("train_steps"))

  def _rates(self, snap: dict, now: float) -> dict:
    t0, requests, tokens = self._mark
    dt = max(now - t0, 1e-9)
    return dict(window_s=round(now - t0, 1), window_requests=snap["requests"] - requests,
                tokens_per_s=round((snap["tokens"] - tokens) / dt, 1))

  def tick(self) -> str:
    """Closes the window, prints its line and returns it."""
    snap, now = self._snapshot(), self._clock()
    with self._lock:
      self._window = self._rates(snap, now)
      self._mark = (now, snap["requests"], snap["tokens"])
    line = "status: " + describe(self.numbers())
    self._out(line)
    return line

  def start(self) -> None:
    with self._lock:
      self._start = self._clock()
      self._mark = (self._start, *(self._snapshot()[k] for k in ("requests", "tokens")))
    if self.every_s <= 0:
      return
    self._stop.clear()
    self._thread = threading.Thread(target=self._loop, name="serve-status", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=10)
      self._thread = None

  def _loop(self) -> None:
    while not self._stop.wait(self.every_s):
      try:
        self.tick()
      except Exception as e:  # pylint: disable=broad-except  (the store closing at shutdown)
        if not self._stop.is_set():
          self._out(f"status: unavailable ({type(e).__name__}: {e})")
