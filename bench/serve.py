"""Serving latency while idle, while the learner trains, and across weight swaps, in one run.

  python bench/serve.py [--quick] [--json PATH] [--phase-s S] [--clients K] [--trainer=MODE]
  python bench/serve.py --follow-ups [--quick] [--json PATH] [--phase-s S] [--clients K]
  (either with --set KEY=VALUE: a key of the recipe, e.g. task.system_prompt)

The server (``areal_jax.serve``, configs/serve_arithmetic.py: SmolLM2-135M; ``--quick``: the tiny
random model) runs in this process on its loopback port, its trainer loop as the config says
(``serve.trainer_process``: SmolLM2 its own process pinned to half the cores, the server on the
other half; tiny: a thread) or as ``--trainer=thread|process`` forces, to compare both; ``--clients`` threads send arithmetic
questions through the official ``openai`` client, non-streaming, each request ``--max-tokens``
completion tokens at most, back to back, for ``--phase-s`` seconds per phase:
  * ``idle``: serving only (the judge and trainer loops stopped);
  * ``training``: the learner runs train steps back to back on turns recorded in the idle phase
    (the real ``Learner.train_step`` of the trainer loop, one warm-up step compiled before; in a
    thread beside serving, or in the trainer process: ``trainer_process --bench=train``);
  * ``weight_swap``: a new policy version is published to the engine every ``--swap-every-s``
    seconds (thread: ``engine.update_params``; process: Orbax weights the server's watcher loads,
    then ``engine.update_params``; applied between decode steps), no training.
Per phase: requests, ``latency_p50_ms``, ``latency_p99_ms`` (request sent -> response parsed),
completion ``tokens_per_s`` (all clients together) and, for the other phases, the ratios of p50 /
p99 to idle's (the goal: p99 while training within 1.5x of idle). Training and swap counts show
the phase did what it says. The machine and its load average are printed and stored.

``--follow-ups`` measures something else instead, serving only (no trainer, so no weight swap
drops a kept turn): conversations of two turns per client, the question, then "Are you sure?"
``--think-s`` seconds after its answer (``serve.sim_feedback_tokens`` completion tokens), and
the latency of the second turn with the engine keeping each turn's KV for the next
(``serve.keep_turns``: the second turn runs only its new tokens on the kept row) against
prefilling the whole history, in alternating phases (kept, prefilled, kept, prefilled; each
starts with nothing kept, the same weights swapped in as a new version): ``follow_ups`` (per
phase: ``keep_turns``, ``follow_ups``, ``continued`` (requests run on a kept turn, first turns
included), ``latency_p50_ms``, ``latency_p99_ms``) and ``kept_vs_prefilled_p50`` (median of the
kept phases' p50 over the prefilled ones').
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from common import machine, override_all  # noqa: E402

from areal_jax import config as config_lib  # noqa: E402
from areal_jax import tasks  # noqa: E402
from areal_jax.rollout_api import Sample  # noqa: E402
from areal_jax.runtime import model_source  # noqa: E402
from areal_jax.runtime.ray_worker import pin_process  # noqa: E402
from areal_jax.serve import trainer_supervisor  # noqa: E402
from areal_jax.serve.runtime import ServeRuntime  # noqa: E402


def _closed_loop(rt, config, n_clients: int, duration_s: float, request) -> dict:
  """``n_clients`` threads, each calling ``request(client, model, messages)`` back to back on
  train-split questions for ``duration_s`` seconds; ``request`` returns ``(seconds, completion
  tokens)`` of what it times. Requests, errors, wall time, latencies (ms) and tokens."""
  import openai  # pylint: disable=import-outside-toplevel

  task = tasks.get_task(config.task)
  examples = task.examples("train")
  client = openai.OpenAI(base_url=rt.url, api_key="none", max_retries=0, timeout=600)
  lat, toks, errors = [], [], [0]
  lock = threading.Lock()
  deadline = time.time() + duration_s

  def work(k: int):
    i = k
    while time.time() < deadline:
      messages = task.prompt_messages(examples[i % len(examples)])
      i += n_clients
      try:
        seconds, tokens = request(client, config.serve.model_name, messages)
      except Exception:  # pylint: disable=broad-except
        with lock:
          errors[0] += 1
        continue
      with lock:
        lat.append(seconds)
        toks.append(tokens)

  t_start = time.time()
  threads = [threading.Thread(target=work, args=(k,)) for k in range(n_clients)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  wall = time.time() - t_start
  ms = np.asarray(lat) * 1e3
  return dict(requests=len(lat), errors=errors[0], wall_s=wall,
              latency_p50_ms=float(np.percentile(ms, 50)) if len(ms) else None,
              latency_p99_ms=float(np.percentile(ms, 99)) if len(ms) else None,
              latency_max_ms=float(ms.max()) if len(ms) else None,
              tokens_per_s=float(sum(toks) / wall))


def _clients(rt, config, n_clients: int, duration_s: float, max_tokens: int) -> dict:
  """Single questions, non-streaming, ``max_tokens`` completion tokens at most: each request's
  latency (sent -> response parsed)."""
  def ask(client, model, messages):
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=model, max_tokens=max_tokens, messages=messages)
    return time.perf_counter() - t0, r.usage.completion_tokens

  return _closed_loop(rt, config, n_clients, duration_s, ask)


def _follow_ups(rt, config, n_clients: int, duration_s: float, max_tokens: int,
                keep: bool, think_s: float = 0.0) -> dict:
  """Two-turn conversations (a question, then "Are you sure?" ``think_s`` seconds after its
  answer, as the simulated user's), back to back per client; the latency of the second turn
  only, whose prompt holds the first turn: with ``keep`` the engine kept the first turn's KV
  (``serve.keep_turns``), else it prefills the whole history."""
  def converse(client, model, messages):
    first = client.chat.completions.create(model=model, max_tokens=max_tokens, messages=messages)
    messages = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                           {"role": "user", "content": "Are you sure?"}]
    time.sleep(think_s)
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=messages,
                                       max_tokens=config.serve.sim_feedback_tokens)
    return time.perf_counter() - t0, r.usage.completion_tokens

  rt.context.keep_turns, continued = keep, rt.engine.stats["continued"]
  try:
    out = _closed_loop(rt, config, n_clients, duration_s, converse)
  finally:
    rt.context.keep_turns = config.serve.keep_turns
  return dict(keep_turns=keep, follow_ups=out["requests"], errors=out["errors"],
              continued=rt.engine.stats["continued"] - continued,
              latency_p50_ms=out["latency_p50_ms"], latency_p99_ms=out["latency_p99_ms"])


class _Background:
  """Runs ``fn`` back to back in a thread until ``stop()``; counts the calls."""

  def __init__(self, fn, pause_s: float = 0.0):
    self.fn, self.pause_s, self.calls, self._stop = fn, pause_s, 0, threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self):
    while not self._stop.is_set():
      self.fn()
      self.calls += 1
      self._stop.wait(self.pause_s)

  def stop(self) -> int:
    self._stop.set()
    self._thread.join()
    return self.calls


def _thread_phases(rt, config, args, phase_s, max_tokens) -> dict:
  """Training and swaps in the server's process: the learner's steps in a thread beside serving."""
  phases = {}
  rows = rt.store.first(config.actor.batch_size)
  learner = rt.trainer.learner
  batch = [[Sample(r["id"], 0, r["prompt_tokens"], r["completion_tokens"], r["logprobs"],
                   r["versions"], "eos")] for r in rows]
  advantages = [[(-1.0) ** i] for i in range(len(batch))]
  learner.train_step(batch, advantages)  # compiles
  steps = _Background(lambda: learner.train_step(batch, advantages))
  phases["training"] = _clients(rt, config, args.clients, phase_s, max_tokens)
  phases["training"]["train_steps"] = steps.stop()

  version = [rt.engine.version]

  def swap():
    version[0] += 1
    rt.engine.update_params(learner.params(), version[0])
  swap_before = rt.engine.stats["swaps"]
  swaps = _Background(swap, pause_s=args.swap_every_s)
  phases["weight_swap"] = _clients(rt, config, args.clients, phase_s, max_tokens)
  swaps.stop()
  phases["weight_swap"]["swaps_applied"] = rt.engine.stats["swaps"] - swap_before
  return phases


def _process_phases(rt, config, args, phase_s, max_tokens) -> dict:
  """Training and swaps in the trainer process (its own cores): the same steps on the first batch
  of recorded turns (``--bench=train``), then Orbax versions every ``--swap-every-s`` that the
  server's watcher loads (``--bench=swap``)."""
  phases = {}
  for name, extra in (("training", ["--bench=train"]),
                      ("weight_swap", ["--bench=swap", f"--swap_every_s={args.swap_every_s}"])):
    rt.trainer.stop()
    rt.trainer.extra_args = extra
    rt.trainer.start()
    deadline = time.time() + 900
    while not (rt.trainer.status() or {}).get("ready"):  # loaded, restored, compiled
      if time.time() > deadline:
        raise TimeoutError(f"the trainer process did not get ready for the {name} phase")
      time.sleep(0.5)
    swap_before = rt.engine.stats["swaps"]
    phases[name] = _clients(rt, config, args.clients, phase_s, max_tokens)
    st = rt.trainer.status() or {}
    if name == "training":
      phases[name]["train_steps"] = st.get("bench_steps", 0)  # completed within the phase
      if st.get("step_started"):  # a step still running at the end: busy for this long
        phases[name]["train_step_running_s"] = round(time.time() - st["step_started"], 1)
    else:
      phases[name]["swaps_applied"] = rt.engine.stats["swaps"] - swap_before
  return phases


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="the tiny model, short phases")
  ap.add_argument("--json", default=None, help="write results to this path")
  ap.add_argument("--phase-s", type=float, default=None, help="seconds per phase")
  ap.add_argument("--clients", type=int, default=4)
  ap.add_argument("--max-tokens", type=int, default=None)
  ap.add_argument("--swap-every-s", type=float, default=2.0)
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="override a key of the recipe (e.g. task.system_prompt='You are ...')")
  ap.add_argument("--follow-ups", action="store_true",
                  help="only: second turns of conversations with the first turn's KV kept "
                       "(serve.keep_turns) against prefilled, serving only, phases alternating")
  ap.add_argument("--think-s", type=float, default=0.0,
                  help="--follow-ups: seconds between a first turn's answer and the second turn")
  ap.add_argument("--trainer", choices=("config", "thread", "process"), default="config",
                  help="the trainer loop as a thread of the server or its own pinned process "
                       "(serve.trainer_process); config: as the config says")
  args = ap.parse_args()
  preset = "tiny" if args.quick else "default"
  phase_s = args.phase_s or (15.0 if args.quick else 60.0)
  max_tokens = args.max_tokens or (16 if args.quick else 32)
  config = config_lib.load(f"configs/serve_arithmetic.py:{preset}")
  config.unlock()
  config.serve.port = 0
  config.serve.warmup = True  # every decode bucket compiled before the first request
  override_all(config, args.set)
  if args.trainer != "config":
    config.serve.trainer_process = args.trainer == "process"
  if args.follow_ups:  # serving only: no version swap drops what is kept
    config.serve.train, config.serve.trainer_process = False, False
  mode = "process" if config.serve.trainer_process else "thread"
  config.lock()
  cores = trainer_supervisor.plan_cores(config)
  if cores is not None:  # as the CLI does: the server's share before JAX's CPU client exists
    pin_process(cores[0])
  info = machine()
  print(f"machine: {info['cpu']}, {info['cores']} cores, jax {info['jax']} ({info['devices']}); "
        f"load average {info['load_avg']:.1f}; model {config.model.source}, {args.clients} clients, "
        f"max_tokens {max_tokens}, {phase_s:.0f} s per phase, trainer as a {mode}", flush=True)
  t_start = time.time()
  with tempfile.TemporaryDirectory() as workdir:
    rt = ServeRuntime(config, workdir, cores=cores)
    rt.start()
    rt.judge.stop()
    if rt.trainer is not None and mode == "thread":
      rt.trainer.stop(checkpoint=False)
    try:
      _clients(rt, config, args.clients, min(phase_s, 10.0), max_tokens)  # compile and warm up
      if args.follow_ups:
        return _follow_up_table(rt, config, args, phase_s, max_tokens, info, t_start)
      phases = {"idle": _clients(rt, config, args.clients, phase_s, max_tokens)}
      if mode == "thread":
        phases.update(_thread_phases(rt, config, args, phase_s, max_tokens))
      else:
        phases.update(_process_phases(rt, config, args, phase_s, max_tokens))
    finally:
      rt.stop()
  idle = phases["idle"]
  print(f"{'phase':>12} {'requests':>8} {'errors':>6} {'p50 ms':>9} {'p99 ms':>9} {'tok/s':>7} "
        f"{'p50/idle':>8} {'p99/idle':>8}  notes")
  for name, p in phases.items():
    if idle["latency_p50_ms"] and p["latency_p50_ms"]:
      p["p50_vs_idle"] = p["latency_p50_ms"] / idle["latency_p50_ms"]
      p["p99_vs_idle"] = p["latency_p99_ms"] / idle["latency_p99_ms"]
    note = ", ".join(f"{k}={p[k]}" for k in ("train_steps", "train_step_running_s", "swaps_applied")
                     if k in p)
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    print(f"{name:>12} {p['requests']:>8} {p['errors']:>6} {fmt(p['latency_p50_ms'], '9.0f')} "
          f"{fmt(p['latency_p99_ms'], '9.0f')} {p['tokens_per_s']:>7.1f} "
          f"{fmt(p.get('p50_vs_idle'), '8.2f')} {fmt(p.get('p99_vs_idle'), '8.2f')}  {note}")
  info["load_avg_end"] = os.getloadavg()[0]
  result = dict(machine=info, model=config.model.source, overrides=args.set, trainer=mode,
                cores=rt.cores, clients=args.clients, max_tokens=max_tokens,
                phase_s=phase_s, phases=phases, wall_s=time.time() - t_start)
  print(f"bench took {result['wall_s']:.0f} s; load average {info['load_avg_end']:.1f} at the end")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)
    print(f"wrote {args.json}")


def _follow_up_table(rt, config, args, phase_s, max_tokens, info, t_start) -> None:
  """``--follow-ups``: kept and prefilled second turns, alternating twice, side by side."""
  from flax import nnx  # pylint: disable=import-outside-toplevel

  params = nnx.to_pure_dict(nnx.state(model_source.load(config)[0], nnx.Param))

  def fresh():  # each phase starts with nothing kept: the same weights as a new version
    swaps = rt.engine.stats["swaps"]
    rt.engine.update_params(params, rt.engine.version + 1)
    deadline = time.time() + 60
    while rt.engine.stats["swaps"] == swaps:
      if time.time() > deadline:
        raise TimeoutError("the engine did not apply the version that empties its kept turns "
                           "within 60 s")
      time.sleep(0.05)

  _follow_ups(rt, config, args.clients, min(phase_s, 10.0), max_tokens, True)  # compile
  runs = []
  for keep in (True, False, True, False):
    fresh()
    runs.append(_follow_ups(rt, config, args.clients, phase_s, max_tokens, keep, args.think_s))
  print(f"{'second turns':>14} {'turns':>6} {'errors':>6} {'continued':>9} {'p50 ms':>8} "
        f"{'p99 ms':>8}")
  for r in runs:
    print(f"{'kept' if r['keep_turns'] else 'prefilled':>14} {r['follow_ups']:>6} "
          f"{r['errors']:>6} {r['continued']:>9} {r['latency_p50_ms']:>8.0f} "
          f"{r['latency_p99_ms']:>8.0f}")
  kept = [r['latency_p50_ms'] for r in runs if r['keep_turns']]
  full = [r['latency_p50_ms'] for r in runs if not r['keep_turns']]
  ratio = float(np.median(kept) / np.median(full))
  info["load_avg_end"] = os.getloadavg()[0]
  result = dict(machine=info, model=config.model.source, clients=args.clients,
                overrides=args.set, think_s=args.think_s, max_tokens=max_tokens,
                feedback_tokens=config.serve.sim_feedback_tokens,
                phase_s=phase_s, follow_ups=runs, kept_vs_prefilled_p50=ratio,
                wall_s=time.time() - t_start)
  print(f"second turn p50, kept / prefilled: {ratio:.2f}x; bench took {result['wall_s']:.0f} s; "
        f"load average {info['load_avg_end']:.1f} at the end")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
