r"""Async episodes against a slow environment: how many episodes in flight keep the sampler busy.

  python bench/episodes.py --json episodes.json --table table.md
  python bench/episodes.py --latencies 0,1 --episodes 1,16,64,256,1024,2048 --seconds 10

Workload: the rollout controller (``areal_jax.runtime.controller``) runs an async workflow whose
episodes alternate a turn of the JAX sampler (``--tokens`` new tokens, EOS ignored) and a step of
a synthetic in-process environment that answers after ``L`` seconds (``asyncio.sleep``) with
``--inserted`` tokens, ``--turns`` turns per episode; the episodes of one event loop, at most
``n`` in flight (``max_concurrent_episodes``; groups of one episode, the staleness controller with
a wide bound and a consumer that takes every batch at once, so nothing but ``n`` limits them).
``L`` is a fixed latency, or with ``t`` after it (``1t``) long-tailed: ``L`` times a Pareto draw
(shape 2, scale 1/2: mean ``L``, 1% of steps past ``5 L``). Model: ``tiny`` (2 layers, width 64)
or ``small`` (SmolLM2-135M's shapes), random weights: throughput does not depend on them.

Per point ``(L, n)``, after ``--warmup`` seconds (at least two episodes' worth of environment
time): over ``--seconds`` seconds, generated tokens/s, the sampler's busy fraction (the share of
the time with a request at the engine: ``sampler_busy_frac`` of ``metrics.jsonl``), the share of
the engine's decode slots holding a sequence (``slot_fill``), the episodes in flight (time
average), the environment steps' p50/p99, the event loop's lag p99 (a 50 ms timer's lateness: a
loop that something blocks shows it), the host cost: resident memory over that before the point
started, per episode in flight, and CPU: the threads that run episodes (event loop, turn
submission, controller) in cores and per episode, and the whole process (the sampler's decode
on CPU included).

JSON keys (stable): ``tokens_per_s[L][n]``, ``busy_frac[L][n]``, ``episodes_for_90pct[L]`` (the
fewest ``n`` measured whose tokens/s reach 90% of the best tokens/s at ``L = 0``; None if none
does or ``L = 0`` was not run), ``slot_use[L][n]`` (busy fraction x slot fill) and
``episodes_for_90pct_slot_use[L]`` (the same with it), ``host_rss_kib_per_episode[L][n]``,
``episode_cpu_ms_per_s_per_episode[L][n]``, ``points`` (every figure of every point), ``machine``
and ``settings``. ``L`` keys are written as ``"%g"`` (``"0.1"``; ``"1t"`` for the long tail),
``n`` as decimal strings.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import threading
import time

import jax
from flax import nnx

from areal_jax import host_memory, workflows
from areal_jax.models import Transformer
from areal_jax.rollout_api import RolloutEngine, SamplingParams
from areal_jax.runtime.controller import RolloutController
from areal_jax.runtime.staleness import StalenessController
from areal_jax.sampler.service import JaxRolloutEngine
from areal_jax.workflows.base import Episode, Trajectory, turn_params
from common import SMOLLM2, TINY, finish, machine

MODELS = {"tiny": TINY, "small": SMOLLM2}
PROMPT_LEN = 16
ETA = 64  # wide: the bound never holds an episode back in this workload
LAG_TICK_S = 0.05


class Latency:
  """An environment step's seconds: ``L`` fixed, or ``L`` times a Pareto draw of mean 1."""

  def __init__(self, spec: str):
    self.tail = spec.endswith("t")
    self.seconds = float(spec[:-1] if self.tail else spec)
    if self.seconds < 0:
      raise ValueError(f"latency {spec!r} must be >= 0")
    self.key = f"{self.seconds:g}" + ("t" if self.tail else "")
    self._rng = random.Random(0)

  def draw(self) -> float:
    if not self.tail:
      return self.seconds
    return self.seconds * 0.5 * self._rng.paretovariate(2.0)


class SyntheticTask:
  """Examples are their own prompts (random token ids)."""

  def __init__(self, vocab: int, seed: int = 0):
    self.vocab, self._rng = vocab, random.Random(seed)

  def prompt_ids(self, example: dict, tokenizer) -> list[int]:
    del tokenizer
    return example["prompt"]

  def examples(self):
    i = 0
    while True:
      yield {"id": i, "prompt": [self._rng.randrange(1, self.vocab) for _ in range(PROMPT_LEN)]}
      i += 1


class EnvEpisode(workflows.Workflow):
  """``turns`` turns, each followed by the synthetic environment's step (``latency``)."""

  name = "bench_env"

  def __init__(self, turns: int, latency: Latency, inserted: int, vocab: int):
    self.turns, self.latency, self.inserted, self.vocab = turns, latency, inserted, vocab

  async def run(self, example, ctx, client, params):
    traj = Trajectory(ctx.task.prompt_ids(example, ctx.tokenizer))
    for turn in range(self.turns):
      sample = await client.generate(traj.context, turn_params(params, turn))
      traj.add_turn(sample)
      if sample.finish_reason == "error" or turn + 1 == self.turns:
        break
      t0 = time.monotonic()
      await asyncio.sleep(self.latency.draw())
      ctx.report_env(time.monotonic() - t0, None)
      traj.add_context([(7 * turn + j) % (self.vocab - 1) + 1 for j in range(self.inserted)],
                       traj.last_version(default=0))
    return Episode(traj.sample(-1, -1, sample.finish_reason), 0.0, False, turn + 1, "answered")


class Tracked(RolloutEngine):
  """The engine, with the requests it holds counted, so a point can end with an empty engine."""

  def __init__(self, engine: JaxRolloutEngine):
    self.engine, self._held, self._lock = engine, set(), threading.Lock()

  def submit(self, request):
    with self._lock:
      self._held.add(request.group_id)
    self.engine.submit(request)

  def poll(self, timeout=0.0):
    out = self.engine.poll(timeout)
    with self._lock:
      for s in out:
        self._held.discard(s.group_id)
    return out

  def drain(self, timeout_s: float = 120.0) -> None:
    """Aborts what is left and takes it back."""
    with self._lock:
      held = list(self._held)
    for gid in held:
      self.engine.abort(gid)
    deadline = time.time() + timeout_s
    while self._held and time.time() < deadline:
      self.poll(0.05)
    if self._held:
      raise RuntimeError(f"{len(self._held)} requests did not come back from the engine")

  def start(self): self.engine.start()
  def stop(self): self.engine.stop()
  def update_params(self, params, version): self.engine.update_params(params, version)
  def pause(self): self.engine.pause()
  def resume(self): self.engine.resume()
  def abort(self, group_id): self.engine.abort(group_id)

  @property
  def version(self):
    return self.engine.version


class Rewards:
  workers = 1

  def score(self, texts, example):
    return [0.0] * len(texts), 0


def thread_cpu_s(threads) -> float:
  """User + system CPU seconds of these threads so far (Linux: /proc/self/task)."""
  tick, total = os.sysconf("SC_CLK_TCK"), 0.0
  for t in threads:
    try:
      with open(f"/proc/self/task/{t.native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      total += (int(fields[11]) + int(fields[12])) / tick
    except (OSError, TypeError):
      pass
  return total


def episode_threads():
  return [t for t in threading.enumerate()
          if t.name in ("episode-loop", "turn-submit", "rollout-controller")]


class Consumer(threading.Thread):
  """Takes every batch as soon as it is ready and publishes the next version (no learner)."""

  def __init__(self, ctrl: RolloutController, staleness: StalenessController):
    super().__init__(name="bench-consumer", daemon=True)
    self.ctrl, self.staleness, self.done = ctrl, staleness, threading.Event()

  def run(self):
    step = 0
    while not self.done.is_set():
      batch = self.staleness.take_batch(step, timeout=0.2)
      if batch is None:
        continue
      self.ctrl.mark_trained([g.group_id for g in batch])
      step += 1
      self.staleness.publish(step)


async def _lag(samples: list[float], stop: asyncio.Event):
  while not stop.is_set():
    t0 = time.monotonic()
    await asyncio.sleep(LAG_TICK_S)
    samples.append(time.monotonic() - t0 - LAG_TICK_S)


def run_point(engine: Tracked, latency: Latency, n: int, args) -> dict:
  """One ``(L, n)`` point (see the module's docstring)."""
  host_memory.release()
  rss0 = host_memory.rss_bytes()
  vocab = engine.engine.vocab_size
  task = SyntheticTask(vocab, seed=n)
  batch = max(1, n // 4)
  staleness = StalenessController(batch, ETA, n)
  wf = EnvEpisode(args.turns, latency, args.inserted, vocab)
  params = SamplingParams(temperature=1.0, max_new_tokens=args.tokens, ignore_eos=True)
  ctrl = RolloutController(engine, task, None, staleness, task.examples(), Rewards(), n_samples=1,
                           params=params, max_prompt_len=engine.engine.max_len,
                           filter_uniform_groups=False, seed=0, workflow=wf,
                           max_concurrent_episodes=n)
  consumer = Consumer(ctrl, staleness)
  lags: list[float] = []
  lag_stop = asyncio.Event()
  ctrl.start()
  consumer.start()
  lag = asyncio.run_coroutine_threadsafe(_lag(lags, lag_stop), ctrl._episodes.loop)
  warmup = max(args.warmup, 2 * latency.seconds * args.turns)
  try:
    time.sleep(warmup)
    ctrl.check()
    ctrl.step_metrics()  # (starts the window)
    lags.clear()
    stats0, tok0, t0 = dict(engine.engine.stats), ctrl.stats["gen_tokens"], time.time()
    cpu0, proc0 = thread_cpu_s(episode_threads()), time.process_time()
    time.sleep(args.seconds)
    ctrl.check()
    t1, tok1, stats1 = time.time(), ctrl.stats["gen_tokens"], dict(engine.engine.stats)
    cpu1, proc1 = thread_cpu_s(episode_threads()), time.process_time()
    rss1 = host_memory.rss_bytes()
    row = ctrl.step_metrics()
  finally:
    ctrl._episodes.loop.call_soon_threadsafe(lag_stop.set)
    try:
      lag.result(5)
    except Exception:  # pylint: disable=broad-except
      pass
    consumer.done.set()
    ctrl.stop()
    consumer.join(5)
    engine.drain()
  wall = t1 - t0
  slot_steps = (stats1.get("calls", 0) - stats0.get("calls", 0)) * engine.engine.num_slots * \
      engine.engine.engine.config.steps_per_call
  engine_tokens = stats1.get("tokens", 0) - stats0.get("tokens", 0)
  episode_cpu = (cpu1 - cpu0) / wall
  lags.sort()
  return dict(
      L=latency.key, n=n, window_s=wall, tokens_per_s=(tok1 - tok0) / wall,
      busy_frac=row["sampler_busy_frac"],
      slot_fill=engine_tokens / slot_steps if slot_steps else 0.0,
      episodes_in_flight_mean=row["episodes_in_flight_mean"], env_steps=row["env_steps"],
      env_step_p50_s=row["env_step_p50_s"], env_step_p99_s=row["env_step_p99_s"],
      loop_lag_p99_ms=1e3 * lags[int(0.99 * (len(lags) - 1))] if lags else None,
      host_rss_delta_mib=(rss1 - rss0) / 2**20,
      host_rss_kib_per_episode=(rss1 - rss0) / 1024 / n,
      episode_cpu_cores=episode_cpu, episode_cpu_ms_per_s_per_episode=1e3 * episode_cpu / n,
      process_cpu_cores=(proc1 - proc0) / wall)


def build_engine(args) -> Tracked:
  cfg = MODELS[args.model]
  model = Transformer(cfg, nnx.Rngs(0))
  longest = PROMPT_LEN + args.turns * (args.tokens + args.inserted)
  buckets = tuple(b for b in (32, 64, 128, 256, 512, 1024) if b < longest) + \
      (min(b for b in (32, 64, 128, 256, 512, 1024, 2048) if b >= longest),)
  eng = JaxRolloutEngine(model, num_slots=args.slots, max_len=buckets[-1] + args.tokens,
                         prefill_buckets=buckets, eos_token_ids=())
  t0 = time.perf_counter()
  eng.warmup(continuations=True)
  print(f"engine: {args.model}, {args.slots} slots, prefill buckets {buckets}, "
        f"compiled in {time.perf_counter() - t0:.0f} s", flush=True)
  tracked = Tracked(eng)
  tracked.start()
  return tracked


def fewest_for_90pct(by_latency: dict) -> tuple[dict, float | None]:
  """Per ``L``, the fewest ``n`` whose figure reaches 90% of the best at ``L = 0``; and that best."""
  ref = max(by_latency.get("0", {}).values(), default=None)
  out = {}
  for lat, by_n in by_latency.items():
    reach = [int(n) for n, v in by_n.items() if ref is not None and v >= 0.9 * ref]
    out[lat] = min(reach) if reach else None
  return out, ref


def summary(points: list[dict]) -> dict:
  """The keyed figures of ``points``. ``slot_use``: busy fraction x slot fill, the share of the
  sampler's slot-time that holds a sequence; ``episodes_for_90pct_slot_use``: as
  ``episodes_for_90pct`` with it in place of tokens/s (machine load on a shared machine moves
  tokens/s from point to point, not how full the sampler is kept)."""
  out: dict = {k: {} for k in ("tokens_per_s", "busy_frac", "slot_use",
                               "host_rss_kib_per_episode", "episode_cpu_ms_per_s_per_episode")}
  for p in points:
    p = dict(p, slot_use=(p["busy_frac"] or 0.0) * p["slot_fill"])
    for k in out:
      out[k].setdefault(p["L"], {})[str(p["n"])] = p[k]
  out["episodes_for_90pct"], out["reference_tokens_per_s"] = fewest_for_90pct(out["tokens_per_s"])
  out["episodes_for_90pct_slot_use"], out["reference_slot_use"] = fewest_for_90pct(out["slot_use"])
  return out


def table(points: list[dict]) -> str:
  head = ("| L (s) | episodes | tokens/s | busy | slot fill | in flight | env p50/p99 s | "
          "loop lag p99 ms | RSS KiB/episode | episode CPU ms/s/episode | process CPU cores |")
  lines = [head, "|" + " --- |" * (head.count("|") - 1)]
  fmt = lambda v, spec: "-" if v is None else format(v, spec)
  for p in points:
    lines.append(
        f"| {p['L']} | {p['n']} | {p['tokens_per_s']:.0f} | {fmt(p['busy_frac'], '.2f')} | "
        f"{p['slot_fill']:.2f} | {p['episodes_in_flight_mean']:.0f} | "
        f"{fmt(p['env_step_p50_s'], '.2f')}/{fmt(p['env_step_p99_s'], '.2f')} | "
        f"{fmt(p['loop_lag_p99_ms'], '.1f')} | {p['host_rss_kib_per_episode']:.1f} | "
        f"{p['episode_cpu_ms_per_s_per_episode']:.3f} | {p['process_cpu_cores']:.2f} |")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
  ap.add_argument("--latencies", default="0,0.1,1,5,1t",
                  help="environment step seconds, comma-separated; 't' after one: long-tailed")
  ap.add_argument("--episodes", default="1,4,16,64,256,1024,2048,4096",
                  help="episodes in flight, comma-separated")
  ap.add_argument("--seconds", type=float, default=20.0, help="measured seconds per point")
  ap.add_argument("--warmup", type=float, default=5.0,
                  help="seconds before measuring (at least two episodes' environment time)")
  ap.add_argument("--turns", type=int, default=4, help="turns per episode")
  ap.add_argument("--tokens", type=int, default=16, help="new tokens per turn")
  ap.add_argument("--inserted", type=int, default=4, help="environment tokens after a turn")
  ap.add_argument("--slots", type=int, default=64, help="the sampler's decode slots")
  ap.add_argument("--json", default=None)
  ap.add_argument("--table", default=None, help="also write the table (Markdown) here")
  args = ap.parse_args(argv)
  t_start = time.perf_counter()
  latencies = [Latency(s.strip()) for s in args.latencies.split(",") if s.strip()]
  counts = [int(s) for s in args.episodes.split(",") if s.strip()]
  if not latencies or not counts or min(counts) < 1:
    sys.exit("--latencies and --episodes need at least one value each, episodes >= 1")
  engine = build_engine(args)
  points = []
  try:
    for lat in latencies:
      for n in counts:
        p = run_point(engine, lat, n, args)
        points.append(p)
        print(f"L={p['L']:>4} n={n:>5}: {p['tokens_per_s']:8.0f} tok/s  busy "
              f"{p['busy_frac'] or 0:.2f}  fill {p['slot_fill']:.2f}  in flight "
              f"{p['episodes_in_flight_mean']:.0f}  RSS {p['host_rss_kib_per_episode']:.1f} "
              f"KiB/ep  CPU {p['episode_cpu_ms_per_s_per_episode']:.3f} ms/s/ep  lag p99 "
              f"{p['loop_lag_p99_ms'] or 0:.1f} ms", flush=True)
  finally:
    engine.stop()
  text = table(points)
  print(text)
  if args.table:
    with open(args.table, "w") as f:
      f.write(text + "\n")
  result = dict(summary(points), points=points, machine=machine(), settings=dict(
      model=args.model, turns=args.turns, tokens=args.tokens, inserted=args.inserted,
      slots=args.slots, seconds=args.seconds, warmup=args.warmup, prompt_len=PROMPT_LEN,
      eta=ETA, jax=jax.__version__))
  print("episodes_for_90pct:", result["episodes_for_90pct"], " by slot use:",
        result["episodes_for_90pct_slot_use"])
  finish(result, args.json, t_start)


if __name__ == "__main__":
  main()
