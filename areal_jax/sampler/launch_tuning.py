"""Timing the decode program's kernel launches on the device it runs on, and keeping the fastest.

On a GPU some launches take kernels off each decode step (our paged step kernel writing the
step's keys and values, ``writes``; each RMSNorm in one kernel with the matmul after it,
``norms``: ``kernels.choice.launches_to_time``), but whether a step runs faster with them turns on
the GPU, the model's shape and the library versions, and this project measured none of them. So
the engine measures them where it runs, once, before its first decode call: ``tune`` compiles the
widest decode program (every slot, the kv bucket of half the positions) under each launch, arms
every slot at that position (each over pages of its own on a paged cache), times ``rounds``
calls of each launch in turn (the launches alternating, so a drift of the clock or the load
spreads over all of them), and keeps the one whose best call was fastest; the engine's own
launch stays unless another is at least ``MARGIN`` faster. A launch that fails to compile or run
is dropped with a warning; where the engine's own took over ``MAX_COMPILE_S`` to compile, the
others are not tried (each would cost about as much again before the first decode).

What the timing writes into the cache lands in slots and pages no sequence holds yet (it runs
before the first one is admitted), and the slots end inactive: decoding afterwards is as with
the chosen launch from the start (tests: tokens and logprobs against an untimed engine's).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import jax
import numpy as np

from areal_jax.kernels import choice

log = logging.getLogger(__name__)
MARGIN = 0.03  # another launch replaces the engine's own when its step is this much faster
ROUNDS = 5  # timed calls of each launch
# the others are not tried when the engine's own launch took longer than this to compile (on a
# GPU XLA's matmul autotuning took minutes a program: measured on an H200 at the 1.5B shape)
MAX_COMPILE_S = 60.0


def wall_seconds(call: Callable[[], Any]) -> float:
  """Seconds ``call()`` takes until its outputs are ready."""
  t0 = time.perf_counter()
  jax.block_until_ready(call())
  return time.perf_counter() - t0


def tune(engine, state, launches: list[choice.Launch] | None = None, *, rounds: int = ROUNDS,
         measure: Callable[[Callable[[], Any]], float] | None = None):
  """Times ``launches`` (default ``engine.launches_to_time()``; the first is the engine's own)
  and leaves ``engine`` on the fastest. ``state``: the engine's decode state with no slot
  armed. Returns ``(state, report)``; the report (None when there was nothing to time) names
  the ``launch`` kept, each launch's best ``step_ms``, its ``compile_s`` (its first call),
  those that ``failed`` and why, and the ``slots`` and ``position`` timed. ``measure(call)``:
  the seconds a call takes (default ``wall_seconds``)."""
  launches = list(launches or engine.launches_to_time())
  if len(launches) < 2:
    return state, None
  measure = measure or wall_seconds
  t_start = time.perf_counter()
  c, steps = engine.config, engine.config.steps_per_call
  position = max(0, min(c.max_len // 2, c.max_len - steps - 1))
  kv_len, width = engine.kv_bucket(position), c.num_slots
  slots, pages = _slots_and_pages(engine, position + steps)
  keys = np.zeros((len(slots), 2), np.uint32)
  holder = {"state": state}

  def arm():  # every timed slot at `position` again (not timed)
    holder["state"] = engine.insert(
        holder["state"], None, slots, token=[1] * len(slots), pos=[position] * len(slots),
        end=[c.max_len] * len(slots), keys=keys, temperature=1.0, top_k=0, top_p=1.0,
        greedy=False, stop_ids=[], pages=None if pages is None else pages[slots])
    jax.block_until_ready([x for x in jax.tree.leaves(holder["state"])
                           if isinstance(x, jax.Array)])

  def call():  # one generate call over every slot
    holder["state"], out = engine.generate(engine.params, holder["state"], kv_len, width,
                                           pages=pages)
    return out

  best: dict[choice.Launch, float] = {}  # seconds a step, the best call
  compile_s: dict[str, float] = {}
  failed: dict[str, str] = {}
  for launch in launches:  # each one's first call compiles it
    engine.use_launch(launch)
    try:
      arm()
      compile_s[launch.name] = round(measure(call), 3)
      best[launch] = float("inf")
    except Exception as e:  # noqa: BLE001 (a launch that cannot run here is not used)
      failed[launch.name] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
      log.warning("sampler: decode launch %s failed, not used (%s)", launch.name,
                  failed[launch.name])
      holder["state"] = _usable(engine, holder["state"])
    if launch is launches[0] and compile_s.get(launch.name, 0.0) > MAX_COMPILE_S:
      log.warning("sampler: the decode program took %.0f s to compile; its other kernel "
                  "launches are not timed", compile_s[launch.name])
      break
  if not best:
    raise RuntimeError(f"no decode launch ran on this device: {failed}")
  for _ in range(rounds):
    for launch in best:
      engine.use_launch(launch)
      arm()
      best[launch] = min(best[launch], measure(call) / steps)
  own, kept = launches[0], min(best, key=best.get)
  if own in best and best[kept] >= best[own] * (1 - MARGIN):
    kept = own
  engine.use_launch(kept)
  state = engine.deactivate(holder.pop("state"), list(range(c.num_slots)))
  report = {"launch": kept.name, "step_ms": {k.name: round(v * 1e3, 4) for k, v in best.items()},
            "compile_s": compile_s, "failed": failed, "slots": len(slots), "position": position,
            "steps_per_call": steps, "rounds": rounds,
            "tune_s": round(time.perf_counter() - t_start, 3)}
  return state, report


def summary(report: dict) -> str:
  """One line: the launch kept and each one's step."""
  steps = ", ".join(f"{name} {ms:.3f} ms" for name, ms in report["step_ms"].items())
  failed = f"; failed: {', '.join(report['failed'])}" if report["failed"] else ""
  return (f"{report['launch']} (a decode step at {report['slots']} slots, position "
          f"{report['position']}: {steps}{failed}; timed in {report['tune_s']:.1f} s)")


def _slots_and_pages(engine, reach: int):
  """The slots the timing arms (every one, or on a paged cache as many as the pool gives
  ``reach`` positions of pages of their own) and the page table (None: a cache of rows)."""
  c = engine.config
  if not engine.paged:
    return list(range(c.num_slots)), None
  need = -(-reach // c.page_size)
  n = max(1, min(c.num_slots, c.kv_pages // need))
  table = np.full((c.num_slots, engine.pages_per_slot), c.kv_pages, np.int32)  # the trash page
  table[:n, :need] = np.arange(n * need, dtype=np.int32).reshape(n, need) % c.kv_pages
  return list(range(n)), table


def _usable(engine, state):
  """``state``, or a new empty one where a failed call had taken (donated) its buffers."""
  if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state)):
    return engine.init_state()
  return state
