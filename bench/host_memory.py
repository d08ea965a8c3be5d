"""Where a CPU run's host memory goes: a demo-sized training run, its resident set sampled over
time, and its peak broken into parts.

  python bench/host_memory.py                           # configs/arithmetic.py, 4 steps
  python bench/host_memory.py --steps=2 --set train.eval_every=0 --json=/tmp/hm.json

The run is ``trainer.run`` of the config (with the 8 virtual CPU devices ``make demo`` exports,
unless XLA_FLAGS is set), in this process. A thread reads the resident set (``/proc/self/status``)
every few milliseconds; the run's phases (model load, learner, sampler and its memory plan, weight
transfer, each train step, each publish, evaluations, checkpoints) and every XLA compilation
(``jax.monitoring``'s backend-compile events) are marked on that timeline. The table gives, per
phase, the resident set before it, the most during it and after it; per compilation the same
(what the compiler itself took at its peak, and what the program kept: its executable); and the
bytes of live JAX arrays (device buffers, which on CPU are host memory) at the end of each phase,
beside what the learner's and the sampler's memory plans count (weights, optimizer state,
gradients, KV cache, the programs' temporaries). The rest of the resident set is the process's
own: Python and its modules, the model's host copy, XLA's executables, allocator slack.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import sys
import tempfile
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from areal_jax import host_memory  # noqa: E402

GIB = 1024**3
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class Timeline:
  """The resident set sampled every ``interval_s`` by a thread, and labelled intervals on it."""

  def __init__(self, interval_s: float = 0.005):
    self.t0 = time.perf_counter()
    self.samples = []  # (t, rss bytes)
    self.phases = []  # dicts: name, start, end, live (live JAX array bytes at its end)
    self.compiles = []  # (start, end)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._sample, args=(interval_s,), daemon=True)
    self._thread.start()

  def now(self) -> float:
    return time.perf_counter() - self.t0

  def _sample(self, interval_s: float) -> None:
    while not self._stop.is_set():
      self.samples.append((self.now(), host_memory.rss_bytes()))
      time.sleep(interval_s)

  def stop(self) -> None:
    self._stop.set()
    self._thread.join()

  def on_event(self, event: str, seconds: float, **_) -> None:
    if event == COMPILE_EVENT:
      end = self.now()
      self.compiles.append((end - seconds, end))

  @contextlib.contextmanager
  def phase(self, name: str):
    start = self.now()
    try:
      yield
    finally:
      self.phases.append(dict(name=name, start=start, end=self.now(),
                              live=host_memory.live_array_bytes()))

  def wrap(self, owner, attr: str, name: str) -> None:
    """Marks every call of ``owner.attr`` as phase ``name``."""
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def marked(*args, **kwargs):
      with self.phase(name):
        return fn(*args, **kwargs)
    setattr(owner, attr, marked)

  def window(self, start: float, end: float) -> dict:
    """Resident set just before ``start``, the most in ``[start, end]``, and at ``end``."""
    before = [r for t, r in self.samples if t <= start][-1:] or [self.samples[0][1]]
    inside = [r for t, r in self.samples if start <= t <= end] or before
    after = [r for t, r in self.samples if t >= end][:1] or inside[-1:]
    return dict(before=before[0], peak=max(inside), after=after[0])


def mappings() -> dict:
  """The resident set by kind of mapping (/proc/self/smaps): ``heap`` (malloc's main heap),
  ``arenas`` (malloc's per-thread heaps: anonymous, 64 MiB-aligned), ``mapped`` (other anonymous
  mappings: large allocations), ``files`` (code and data of libraries and modules)."""
  out = dict(heap=0, arenas=0, mapped=0, files=0)
  start, name = 0, ""
  with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
    for line in f:
      head = line.split()
      if "-" in head[0] and not head[0].endswith(":"):
        start, name = int(head[0].split("-")[0], 16), (head[5] if len(head) > 5 else "")
      elif head[0] == "Rss:":
        kib = int(head[1]) * 1024
        kind = ("heap" if name == "[heap]" else "files" if name.startswith("/") else
                "mapped" if name and name.startswith("[") else
                "arenas" if start % (64 << 20) == 0 else "mapped")
        out[kind] += kib
  return out


def planned(config, learner, engine) -> dict:
  """The parts the memory plans count (bytes per device), computed on abstract shapes."""
  from areal_jax.learner import memory as learner_memory
  from areal_jax.runtime import weight_transfer
  from areal_jax.sampler import memory as sampler_memory

  out = {}
  kept = learner_memory.kept_bytes(learner)
  out.update({f"learner_{k}": v for k, v in kept.items()})
  row_len, rows = learner_memory.shape(learner, learner.opts.micro_batch_tokens)
  step = learner_memory.step_peak(learner, row_len, rows)
  step.pop("update_cost", None)
  out.update({f"learner_step_{k}": v for k, v in step.items() if k not in kept})
  publish = weight_transfer.version_caster(config)  # (None: a version is published as it is)
  if publish is not None:
    out["learner_publish"] = learner_memory.publish_peak(learner, publish)
  jax_engine = getattr(engine, "engine", None)
  if jax_engine is not None:
    p = sampler_memory.plan(jax_engine, None)
    out.update(sampler_weights=p.weights, sampler_state=p.state, sampler_memo=p.memo,
               sampler_incoming=p.incoming, sampler_decode_temp=p.generate_temp,
               sampler_prefill=p.prefill, sampler_peak=p.peak_bytes,
               sampler_resident=p.resident_bytes)
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", default="configs/arithmetic.py", help="path[:preset]")
  ap.add_argument("--steps", type=int, default=4, help="train.total_steps")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="config overrides (Python literals)")
  ap.add_argument("--workdir", default="", help="the run's directory (default: a temporary one)")
  ap.add_argument("--json", default="", help="write the result here")
  ap.add_argument("--no-plan", action="store_true", help="skip the planned parts (compiles more)")
  args = ap.parse_args()
  t_start = time.perf_counter()

  import importlib.util

  from areal_jax import learner as learner_lib
  from areal_jax.runtime import checkpoint, engines, model_source, trainer
  from areal_jax.sampler import service
  import common

  path, _, preset = args.config.partition(":")
  if not os.path.exists(path):  # (relative to the repository, as the usage lines give it)
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)
  spec = importlib.util.spec_from_file_location("bench_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(preset or "default")
  config.train.total_steps = args.steps
  common.override_all(config, args.set)
  # an empty persistent compilation cache, as launch.py's on a fresh clone
  cache = tempfile.TemporaryDirectory()
  jax.config.update("jax_compilation_cache_dir", cache.name)

  tl = Timeline()
  jax.monitoring.register_event_duration_secs_listener(tl.on_event)
  tl.wrap(model_source, "load", "model load")
  tl.wrap(learner_lib.Learner, "__init__", "learner build")
  tl.wrap(engines, "build_planned", "sampler build + plans")
  tl.wrap(trainer, "_build_transfer", "transfer build")
  tl.wrap(learner_lib.Learner, "train_step", "train step")
  tl.wrap(service.JaxRolloutEngine, "update_params", "weights to sampler")
  tl.wrap(trainer, "evaluate", "evaluation")
  tl.wrap(checkpoint.Checkpointer, "save", "checkpoint")
  keep = {}
  build = engines.build_planned

  def capture(cfg, model, tokenizer, mesh, learner=None):
    engine = build(cfg, model, tokenizer, mesh, learner)
    keep.update(learner=learner, engine=engine)
    return engine
  engines.build_planned = capture

  with tempfile.TemporaryDirectory() as tmp, tl.phase("run"):
    trainer.run(config, args.workdir or tmp)
  tl.stop()
  cache.cleanup()
  end = dict(rss=host_memory.rss_bytes(), live=host_memory.live_array_bytes(), **mappings())
  end["after_trim"] = host_memory.rss_bytes() if host_memory.release() else None

  phases = collections.OrderedDict()
  for p in tl.phases:  # the same phase's calls merged: the first's before, the most, the last's live
    w = tl.window(p["start"], p["end"])
    q = phases.setdefault(p["name"], dict(calls=0, seconds=0.0, before=w["before"], peak=0,
                                          after=0, live=0))
    q.update(calls=q["calls"] + 1, seconds=q["seconds"] + p["end"] - p["start"],
             peak=max(q["peak"], w["peak"]), after=w["after"], live=p["live"])
  compiles = [dict(start=s, seconds=e - s, **tl.window(s, e)) for s, e in tl.compiles]
  peak_t, peak = max(tl.samples, key=lambda x: x[1])
  at_peak = [p["name"] for p in tl.phases if p["start"] <= peak_t <= p["end"] and p["name"] != "run"]
  in_compile = any(c["start"] <= peak_t <= c["start"] + c["seconds"] for c in compiles)

  g = lambda b: f"{b / GIB:6.2f}"  # noqa: E731
  print(f"\nhost memory of {args.config} ({args.steps} steps; {os.cpu_count()} cores; "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')})")
  print(f"{'phase':24s} {'calls':>5s} {'s':>7s} {'before':>7s} {'peak':>7s} {'after':>7s} "
        f"{'live arrays':>11s}  (GiB)")
  for name, q in phases.items():
    print(f"{name:24s} {q['calls']:5d} {q['seconds']:7.1f} {g(q['before'])} {g(q['peak'])} "
          f"{g(q['after'])} {g(q['live']):>11s}")
  print(f"\n{len(compiles)} compilations, {sum(c['seconds'] for c in compiles):.0f} s; the five "
        "with the highest peak over the resident set before them:")
  for c in sorted(compiles, key=lambda c: c["before"] - c["peak"])[:5]:
    print(f"  at {c['start']:6.1f} s, {c['seconds']:5.1f} s: {g(c['before'])} -> peak "
          f"{g(c['peak'])} -> {g(c['after'])} GiB")
  kept = sum(max(0, c["after"] - c["before"]) for c in compiles)
  print(f"  resident set added across compilations (executables, and what grew meanwhile): "
        f"{kept / GIB:.2f} GiB")
  print(f"\npeak resident set {peak / GIB:.2f} GiB at {peak_t:.1f} s, during "
        f"{', '.join(at_peak) or 'none of the marked phases'}"
        + (" (in a compilation)" if in_compile else ""))
  print(f"\nat the end (engines stopped): resident {g(end['rss'])} GiB = malloc heap "
        f"{g(end['heap'])} + malloc arenas {g(end['arenas'])} + other anonymous "
        f"{g(end['mapped'])} + files {g(end['files'])}; live arrays {g(end['live'])}; "
        + (f"after malloc_trim {g(end['after_trim'])}" if end["after_trim"] else "no malloc_trim"))
  result = dict(config=args.config, steps=args.steps, overrides=args.set,
                xla_flags=os.environ.get("XLA_FLAGS", ""), peak_rss=peak, peak_at_s=peak_t,
                peak_during=at_peak, peak_in_compile=in_compile, end=end, phases=phases,
                compiles=compiles, timeline=[(round(t, 2), r) for t, r in tl.samples[::20]])
  if args.json:  # (before the plans compile: the run's figures are kept if that is cut short)
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)
  if not args.no_plan and keep.get("learner") is not None:
    result["planned"] = plan = planned(config, keep["learner"], keep["engine"])
    print("\nplanned (per device, GiB): " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in plan.items()))
  common.finish(result, args.json or None, t_start)


if __name__ == "__main__":
  main()
