"""Timing the decode program's launches on the device it runs on, and keeping the fastest.

On a GPU some launches take kernels off each decode step (our paged step kernel writing the step's
keys and values, ``writes``, with or without tensor-core dots; each RMSNorm in one kernel with the
matmul after it, ``norms``) or the host's launches off each call (the call's loop over its steps in
CUDA graphs, ``graphs``), or run its matmuls otherwise (XLA's own autotuned GEMMs instead of the
vendor library's, ``matmul``; ``kernels.decode_launch.launch_stages``), but whether a step runs
faster with them turns on the GPU, the model's shape and the library versions (on one H200 a launch
was kept at one decode shape and not at the other, ``bench/results/h200-2026-11-30-c75e3df``). So
the engine measures them where it runs, once, before its first decode call, stage by stage (the
paged step kernel, the norms, the graphs, the matmuls, each on what the stages before it kept):
``tune`` compiles the widest decode program (every slot, the kv bucket of half the positions) under
each launch (``progress`` told before each compile), arms every slot at that position (each over
pages of its own on a paged cache), times ``rounds`` calls of each launch in turn (alternating, so a
drift of the clock or the load spreads over all of them), and keeps the one whose best call was
fastest; the stage's first launch (the engine's own, then the one kept so far) stays unless another
is at least ``MARGIN`` faster. A launch that fails to compile or run is dropped with a warning;
where the engine's own took over ``MAX_COMPILE_S`` to compile, nothing else is tried (each would
cost about as much again before the first decode), and no stage is started once the timing has taken
``MAX_TUNE_S``. The sampler's memory plan counted the engine's own launch's decode call; a stage
keeps another launch only if it fits the plan too (its decode call at every slot and the largest kv
bucket, compiled as the plan's was: ``within_plan``; one whose program there fails to compile is
dropped too), else the fastest of the rest.

The tests run these kernels in interpret mode only, never compiled on a GPU, so a faster launch is
kept only if it computes what the engine's own does: each launch's first call (its compile) decodes
greedily, every slot from a token of its own (a kernel that mixes up slots or pages shows), and a
launch whose logprobs are not finite, or differ from the engine's own launch's by more than
``CHECK_NATS`` at a step up to where their greedy tokens part, is dropped with a warning saying by
how much. (The slots decode from a cache that holds nothing before ``position``: what the check
sees is the steps' own keys and values, the weights and the kernels' reads and writes of them.)

What the timing writes into the cache lands in slots and pages no sequence holds yet (it runs
before the first one is admitted), and the slots end inactive: decoding afterwards is as with
the chosen launch from the start (tests: tokens and logprobs against an untimed engine's).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import jax
import numpy as np

from areal_jax.kernels import choice
from areal_jax.sampler import memory

log = logging.getLogger(__name__)
MARGIN = 0.03  # another launch replaces the engine's own when its step is this much faster
ROUNDS = 5  # timed calls of each launch
# the others are not tried when the engine's own launch took longer than this to compile (on a
# GPU XLA's matmul autotuning took minutes a program: measured on an H200 at the 1.5B shape)
MAX_COMPILE_S = 60.0
# no stage is started once the timing has taken this long (the last, XLA's GEMMs, autotunes as it
# compiles: where the stages before it took minutes, the model is one whose autotuning would too)
MAX_TUNE_S = 120.0
# a launch whose greedy decode's logprobs differ from the engine's own launch's by more than this
# (nats; by the compute dtype's bytes) computes something else, and is not used
CHECK_NATS = {2: 0.5, 4: 0.05}


def wall_seconds(call: Callable[[], Any]) -> float:
  """Seconds ``call()`` takes until its outputs are ready."""
  t0 = time.perf_counter()
  jax.block_until_ready(call())
  return time.perf_counter() - t0


def tune(engine, state, stages: list[Callable[[choice.Launch], list[choice.Launch]]] | None = None,
         *, rounds: int = ROUNDS, measure: Callable[[Callable[[], Any]], float] | None = None,
         position: int | None = None, progress: Callable[[str], None] | None = None,
         plan=None):
  """Times the launches of each of ``stages`` in turn (default ``engine.launch_stages()``; a
  stage is given the launch kept so far, first the engine's own, and returns it first, then what
  may replace it) and keeps the fastest of each; leaves ``engine`` on the last one kept.
  ``state``: the engine's decode state with no slot armed. Returns ``(state, report)``; the
  report (None when there was nothing to time) names the ``launch`` kept, each launch's best
  ``step_ms``, its ``compile_s`` (its first call), those that ``failed`` and why, and the
  ``slots`` and ``position`` timed, the ``stages`` and how many were ``stages_timed`` (none is
  started after ``MAX_TUNE_S``, nor after a compile of the engine's own launch over
  ``MAX_COMPILE_S``). ``measure(call)``: the seconds a call takes (default
  ``wall_seconds``); ``position``: where the slots decode from (default half the positions);
  ``progress(name)``: before each launch's program compiles (the engine's own included);
  ``plan``: the ``sampler.memory.SamplerPlan`` the engine was sized by (its decode call is the
  engine's own launch's): a stage keeps another launch only if it fits the plan too
  (``within_plan``; one that does not is in ``failed``)."""
  stages = engine.launch_stages() if stages is None else stages
  kept = engine.launch
  if not any(len(stage(kept)) > 1 for stage in stages):
    return state, None
  t_start = time.perf_counter()
  timer = _Timer(engine, state, rounds, measure or wall_seconds, position, progress, plan)
  timed = 0  # stages timed
  for stage in stages:
    if timed and time.perf_counter() - t_start > MAX_TUNE_S:
      log.warning("sampler: timing the decode launches took %.0f s; the %d stage(s) left are "
                  "not timed", time.perf_counter() - t_start, len(stages) - timed)
      break
    if len(launches := stage(kept)) > 1:
      kept = timer.stage(launches)
    timed += 1
    if timer.stopped:
      break
  engine.use_launch(kept)
  c = engine.config
  state = engine.deactivate(timer.state, list(range(c.num_slots)))
  report = {"launch": kept.name,
            "step_ms": {k.name: round(v * 1e3, 4) for k, v in timer.best.items()},
            "compile_s": timer.compile_s, "failed": timer.failed, "slots": len(timer.slots),
            "position": timer.position, "steps_per_call": c.steps_per_call, "rounds": rounds,
            "stages": len(stages), "stages_timed": timed,
            "tune_s": round(time.perf_counter() - t_start, 3)}
  return state, report


class _Timer:
  """Decode calls of ``engine`` over every slot armed at ``position`` (default half the
  positions), timed per launch (``best``: its fastest step, in seconds)."""

  def __init__(self, engine, state, rounds: int, measure, position: int | None = None,
               progress: Callable[[str], None] | None = None, plan=None):
    self.engine, self.state, self.rounds, self.measure = engine, state, rounds, measure
    self.progress, self.plan = progress, plan
    c = engine.config
    self.steps = c.steps_per_call
    position = c.max_len // 2 if position is None else position
    self.position = max(0, min(position, c.max_len - self.steps - 1))
    self.kv_len = engine.kv_bucket(self.position)
    self.slots, self.pages = _slots_and_pages(engine, self.position + self.steps)
    self.best: dict[choice.Launch, float] = {}
    self.compile_s: dict[str, float] = {}
    self.failed: dict[str, str] = {}
    self.stopped = False  # the engine's own launch compiled too slowly to try others
    self.out = None  # the last call's outputs
    self.reference = None  # the first launch that ran: (name, tokens, logprobs, valid)
    self.tolerance = CHECK_NATS.get(np.dtype(engine.model_cfg.compute_dtype).itemsize, 0.05)

  def _arm(self, check: bool = False):
    """Every timed slot at ``position`` again (not timed); ``check``: each slot from a token of
    its own, greedily (what ``_checked`` compares), else all from one token, sampling."""
    e, n, c = self.engine, len(self.slots), self.engine.config
    vocab = e.model_cfg.vocab_size
    tokens = [1 + (7919 * i) % (vocab - 1) for i in range(n)] if check else [1] * n
    self.state = e.insert(
        self.state, None, self.slots, token=tokens, pos=[self.position] * n,
        end=[c.max_len] * n, keys=np.zeros((n, 2), np.uint32), temperature=1.0, top_k=0,
        top_p=1.0, greedy=check, stop_ids=[],
        pages=None if self.pages is None else self.pages[self.slots])
    jax.block_until_ready([x for x in jax.tree.leaves(self.state) if isinstance(x, jax.Array)])

  def _call(self):  # one generate call over every slot
    e = self.engine
    self.state, self.out = e.generate(e.params, self.state, self.kv_len, e.config.num_slots,
                                      pages=self.pages)
    return self.out

  def _timed(self, launch, check: bool = False) -> float:
    self.engine.use_launch(launch)
    self._arm(check)
    return self.measure(self._call)

  def _checked(self, launch) -> str | None:
    """Why ``launch``'s first call (greedy, ``_arm(check=True)``) says it computes something
    other than the first launch that ran (the engine's own), or None. Compared per slot: the
    logprobs of each step up to the first whose greedy token differs (a near tie may flip one),
    within ``CHECK_NATS``; none may be NaN or infinite."""
    tokens, logprobs, valid = (np.asarray(x)[:, :len(self.slots)]
                               for x in jax.device_get(self.out))
    if not np.isfinite(logprobs[valid]).all():
      return "computes NaN or infinite logprobs"
    if self.reference is None:
      self.reference = (launch.name, tokens, logprobs, valid)
      return None
    name, ref_tokens, ref_logprobs, ref_valid = self.reference
    same = np.cumsum(tokens != ref_tokens, axis=0) - (tokens != ref_tokens) == 0  # up to a flip
    compared = same & valid & ref_valid
    diff = np.where(compared, np.abs(logprobs - ref_logprobs), 0.0)
    step, slot = np.unravel_index(np.argmax(diff), diff.shape)
    if diff[step, slot] > self.tolerance:
      return (f"computes otherwise than {name}: greedy logprobs differ by up to "
              f"{diff[step, slot]:.3g} nats (slot {slot}, step {step}; over "
              f"{self.tolerance:g} in {int((diff > self.tolerance).sum())} of "
              f"{int(compared.sum())} compared)")
    return None

  def stage(self, launches: list[choice.Launch]) -> choice.Launch:
    """Compiles (the first call of) each of ``launches`` not timed yet, times ``rounds`` calls
    of each in turn, and returns the fastest (``launches[0]`` unless another is ``MARGIN``
    faster) of those that fit the memory plan (``launches[0]`` is taken to)."""
    for launch in launches:
      if launch in self.best or launch.name in self.failed:
        continue
      if self.progress is not None:
        self.progress(launch.name)
      try:
        self.compile_s[launch.name] = round(self._timed(launch, check=True), 3)
        if (why := self._checked(launch)) is None:
          self.best[launch] = float("inf")
        else:
          self.failed[launch.name] = why
          log.warning("sampler: decode launch %s %s; not used", launch.name, why)
      except Exception as e:  # noqa: BLE001 (a launch that cannot run here is not used)
        self.failed[launch.name] = _first_line(e)
        log.warning("sampler: decode launch %s failed, not used (%s)", launch.name,
                    self.failed[launch.name])
        self.state = _usable(self.engine, self.state)
      if launch is launches[0] and self.compile_s.get(launch.name, 0.0) > MAX_COMPILE_S:
        log.warning("sampler: the decode program took %.0f s to compile; its other kernel "
                    "launches are not timed", self.compile_s[launch.name])
        self.stopped = True
        break
    timed = [x for x in launches if x in self.best and x.name not in self.failed]
    if not timed:
      raise RuntimeError(f"no decode launch ran on this device: {self.failed}")
    for _ in range(self.rounds):
      for launch in timed:
        self.best[launch] = min(self.best[launch], self._timed(launch) / self.steps)
    own = launches[0]  # (the engine's own, which the memory plan counted, or one kept that fit)
    while timed:
      kept = min(timed, key=self.best.get)
      if own in self.best and self.best[kept] >= self.best[own] * (1 - MARGIN):
        kept = own
      if kept == own or (why := self._beyond_plan(kept)) is None:
        return kept
      self.failed[kept.name] = why
      log.warning("sampler: decode launch %s %s; not used", kept.name, why)
      timed.remove(kept)
    raise RuntimeError(f"no decode launch ran on this device within its memory plan: "
                       f"{self.failed}")

  def _beyond_plan(self, launch) -> str | None:
    """Why ``launch`` does not fit the memory plan (``within_plan``; or its planned decode call
    fails to compile), or None (or no plan)."""
    if self.plan is None:
      return None
    self.engine.use_launch(launch)
    try:
      return within_plan(self.engine, self.plan)
    except Exception as e:  # noqa: BLE001 (it would fail at that kv bucket when decoding, too)
      return f"its planned decode call (the largest kv bucket) failed to compile: {_first_line(e)}"


def within_plan(engine, plan) -> str | None:
  """Why the engine's current launch does not fit ``plan`` (a ``sampler.memory.SamplerPlan`` that
  counted another launch's decode call), or None. Its decode call the plan counts (every slot,
  the largest kv bucket) is compiled on abstract shapes (the persistent compilation cache then
  serves its first call) and put in the plan's place."""
  temp = memory.generate_bytes(engine)
  if temp <= plan.generate_temp:
    return None
  planned = dataclasses.replace(plan, generate_temp=temp)
  if planned.fits:
    return None
  return (f"does not fit the memory plan: its decode call needs {memory.size(temp)} of "
          f"temporaries (the plan's {memory.size(plan.generate_temp)}), a peak of "
          f"{memory.size(planned.peak_bytes)} per device"
          + ("" if plan.budget_bytes is None else f" of {memory.size(plan.budget_bytes)}"))


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


def _first_line(e: Exception) -> str:
  """``e``'s type and the first line of its message (a compiler's can run to pages)."""
  return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


def _usable(engine, state):
  """``state``, or a new empty one where a failed call had taken (donated) its buffers."""
  if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state)):
    return engine.init_state()
  return state
