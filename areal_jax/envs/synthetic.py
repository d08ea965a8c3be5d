"""A synthetic environment for tests and benchmarks: a fixed latency per step, and faults on demand.

``SyntheticEnv(latency_s, turns)`` answers each action after ``latency_s`` seconds (blocking, as
a real tool would) with ``"obs N"``; the episode is done after ``turns`` steps, with reward 1.0 on
the last one. An action containing ``fault:KIND`` (or an example whose ``"fault"`` is KIND, at its
reset), or the first step of an example whose ``"id"`` is a key of ``faults`` (KIND its value),
misbehaves on purpose:

- ``hang``: sleeps ``hang_s`` seconds (an hour by default);
- ``exit``: ends its process at once (``os._exit``; only where it runs in a worker process);
- ``raise``: raises ``RuntimeError``;
- ``garbage``: returns values of the wrong types;
- ``huge``: returns an observation of ``huge_bytes`` bytes (10 MB by default);
- ``print``: prints 64 KiB to standard output, then answers as usual.

``AsyncSyntheticEnv`` is the same with coroutine methods (``asyncio.sleep`` for the latency and
the hang of ``step``).
"""

from __future__ import annotations

import asyncio
import os
import re
import time

_FAULT = re.compile(r"fault:(\w+)")


class SyntheticEnv:

  def __init__(self, latency_s: float = 0.0, turns: int = 2, hang_s: float = 3600.0,
               huge_bytes: int = 10 * 1024 * 1024, faults: dict | None = None):
    self.latency_s, self.turns, self.hang_s = float(latency_s), int(turns), float(hang_s)
    self.huge_bytes, self.t, self.faults, self.pending = int(huge_bytes), 0, dict(faults or {}), None

  def _fault(self, kind: str | None):
    if kind == "hang":
      time.sleep(self.hang_s)
    elif kind == "exit":
      os._exit(17)
    elif kind == "raise":
      raise RuntimeError("synthetic failure")
    elif kind == "garbage":
      return {"not": "text"}, "high", "yes", ["no"]
    elif kind == "huge":
      return "x" * self.huge_bytes, 0.0, False, {}
    elif kind == "print":  # chatter on standard output, then a normal answer
      print("chatter " * 8192, flush=True)
    return None

  def reset(self, example: dict) -> str:
    self.t, example = 0, example or {}
    self.pending = self.faults.get(str(example.get("id")))
    bad = self._fault(example.get("fault"))
    return bad[0] if bad else "obs 0"

  def _answer(self, action: str):
    m = _FAULT.search(action or "")
    kind, self.pending = (m.group(1) if m else self.pending), None
    bad = self._fault(kind)
    if bad:
      return bad
    self.t += 1
    done = self.t >= self.turns
    return f"obs {self.t}", 1.0 if done else 0.0, done, {"t": self.t}

  def step(self, action: str):
    if self.latency_s:
      time.sleep(self.latency_s)
    return self._answer(action)

  def close(self) -> None:
    self.t = -1


class AsyncSyntheticEnv(SyntheticEnv):

  async def reset(self, example: dict) -> str:
    return SyntheticEnv.reset(self, example)

  async def step(self, action: str):
    if self.latency_s:
      await asyncio.sleep(self.latency_s)
    if "fault:hang" in (action or "") or self.pending == "hang":  # without holding the loop
      self.pending = None
      await asyncio.sleep(self.hang_s)
    return self._answer((action or "").replace("fault:hang", ""))

  async def close(self) -> None:
    SyntheticEnv.close(self)
