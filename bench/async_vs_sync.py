r"""Asynchronous vs synchronous RL: the same run at several staleness bounds, side by side.

  python bench/async_vs_sync.py --json /tmp/async.json            # eta in {0, 1, 2, 4, 8}
  python bench/async_vs_sync.py --quick                           # a few minutes
  python bench/async_vs_sync.py --mode=ray --json /tmp/async_ray.json   # + /tmp/async_ray.png
  python bench/async_vs_sync.py --lengths=reasoning --quick --json /tmp/async_reasoning.json

``--mode=local`` (default): one process, learner and sampler on one fake device each but the same
cores. ``--mode=ray``: the learner (this process) pinned to core 0 and one rollout worker process
(a Ray actor, ``runtime.mode=ray``) pinned to the other core(s), weights through Orbax; the same
hardware for every eta. Expected runtime of the ray mode with the defaults: about 11 minutes on
2 idle cores (measured: 10 min 36 s); ``--quick`` (eta 0 and 4, 8 steps) about 3 minutes.

Every run trains the same config for the same number of steps; only
``rollout.max_head_offpolicyness`` (eta) changes, and eta = 0 is synchronous RL. Generation lengths
are long-tailed, as with reasoning models: each sample's length is drawn from a log-normal
distribution (median ``--median`` 96, ``--sigma`` 1, capped at ``--cap`` 512; seeded by group and
sample, so every eta generates the same lengths) and the sample runs to it (``ignore_eos``: a
random model's EOS would otherwise cut the tail off), so a synchronous batch waits for its longest
sequence while an asynchronous sampler keeps its slots busy. ``--lengths=reasoning`` draws them as a
reasoning model's thinking runs: median 4096, sigma 1, capped at 32768 tokens, all three divided by
``--length-scale`` (default 32: median 128, cap 1024, the same shape of tail at what a CPU runs).
Reported per eta: wall time per step,
effective trained tokens/s, learner wait and sampler idle fractions, final reward, reward per
trained sample, the final policy's reward, and the throughput ratio against eta = 0 (JSON:
top-level ``speedup``, ``final_reward``, ``reward_per_sample``, ``final_policy_reward``,
``staleness_max``, ``gen_busy_frac``, ``learner_busy_frac`` and ``overlap_efficiency``, keyed by
eta as a string). ``overlap_efficiency``: the busier side's busy share of the wall time
(``learner_busy_frac``, or the sampler's ``1 - sampler_idle_frac``), against an ideal of 1, where
the slower side never waits for the other and the step takes its time alone.
``final_reward`` and ``reward_per_sample`` are rewards of the batches trained on (the last quarter
of the steps, every step), which an asynchronous run generated up to eta versions earlier;
``final_policy_reward`` asks the final parameters themselves, after the same number of trained
samples at every eta: ``--eval-size`` held-out prompts x ``--eval-k`` samples at the training
temperature (``final_policy_reward_greedy`` per row: greedy), after the timed run. ``learner_busy_frac``: the share of the timed
wall time spent in train steps (compilation excluded); ``gen_busy_frac`` (ray mode only; None in
local mode, where the two sides share cores): the rollout worker's CPU seconds over the same wall
time (its compilations included); ``weights_load_s_per_step`` (ray mode): the worker's seconds
reading each new version from Orbax (taken from its generation core). ``--png`` (default: next to
``--json``) draws the reward of each trained batch per training step, per policy version that
generated it, and over wall time, one line per eta; ``--keep DIR`` keeps each eta's
``metrics.jsonl``.

The default workload: ``--model=small`` (a random 4M-parameter byte-level Llama, ``models.load(
"small")``) on the synthetic arithmetic prompts (~240 byte tokens with the chat template), 4 groups
of 4 samples per step, 32 sampler slots, rewarded by ``task.reward="digit_share"`` (the share of
digits in the completion: a random model learns it within 16 steps, so the reward curves compare
how each eta learns; ``--reward=answer`` is the task's own reward, ~0 for a random model).
``--model=tiny`` is the 100k-parameter test model: its learner is mostly attention and its decode
steps all overhead, unlike a real model. ``gen_frac_sync`` (the learner's wait share of a
synchronous step) says which regime a run measured: with perfect overlap an asynchronous step
takes max(generation, training) where a synchronous one takes their sum plus the wait for the
longest sample, so the speedup is at most 1 + gen_frac_sync / (1 - gen_frac_sync) when the learner
is the slower side and generation's own time is what the synchronous step waited (its stall on
the longest sample makes that wait longer, so long tails speed up beyond it). XLA compilation
that lands in a timed step (the learner compiles one variant per micro-batch shape it meets) is
measured and taken out of the step's wall time, so the figures are steady-state ones;
``raw_trained_tokens_per_s`` keeps it in.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import shutil
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOAD_BEFORE = os.getloadavg()

import numpy as np  # noqa: E402
from jax._src import monitoring  # noqa: E402  (unregistering a listener is not public API)

from areal_jax import config as config_lib  # noqa: E402
from areal_jax.rollout_api import GroupRequest, RolloutEngine  # noqa: E402
from areal_jax.runtime import metrics as metrics_lib  # noqa: E402
from areal_jax.runtime import trainer  # noqa: E402


# A reasoning model's generation lengths at full scale (tokens): log-normal, capped
REASONING = dict(median=4096, sigma=1.0, cap=32768)


class LongTailEngine(RolloutEngine):
  """Gives each sample of a group its own log-normal token budget (a long-tailed workload)."""

  def __init__(self, inner: RolloutEngine, median: int, sigma: float, cap: int):
    self.inner, self.median, self.sigma, self.cap = inner, median, sigma, cap

  def budget(self, group_id: int, index: int) -> int:
    rng = np.random.default_rng([abs(group_id), index])
    return int(np.clip(rng.lognormal(np.log(self.median), self.sigma), 4, self.cap))

  def submit(self, request: GroupRequest) -> None:
    if request.metadata.get("kind") == "eval":
      return self.inner.submit(request)
    for i in range(request.n):
      # ignore_eos: the drawn budget is the length (a random model's EOS would cut the tail off)
      params = dataclasses.replace(request.params, seed=request.params.seed + i, ignore_eos=True,
                                   max_new_tokens=self.budget(request.group_id, i))
      meta = dict(request.metadata, group=request.group_id, index=i)
      self.inner.submit(GroupRequest(request.group_id * 1024 + i, request.prompt_tokens, 1, params, meta))

  def poll(self, timeout=0.0):
    out = self.inner.poll(timeout)
    for s in out:
      if "group" in s.metadata:
        s.group_id, s.index = s.metadata["group"], s.metadata["index"]
    return out

  def abort(self, group_id):
    for i in range(1024):
      self.inner.abort(group_id * 1024 + i)

  start = property(lambda self: self.inner.start)
  stop = property(lambda self: self.inner.stop)
  update_params = property(lambda self: self.inner.update_params)
  pause = property(lambda self: self.inner.pause)
  resume = property(lambda self: self.inner.resume)
  version = property(lambda self: self.inner.version)
  compile_stats = property(lambda self: self.inner.compile_stats)


class CompileClock:
  """Seconds of XLA compilation per training step (the step in progress when a compile ends is
  read off the number of lines already in ``metrics.jsonl``)."""

  def __init__(self, metrics_path: str):
    self.path, self.by_step = metrics_path, collections.Counter()
    monitoring.register_event_duration_secs_listener(self)

  def __call__(self, event: str, duration: float, **_) -> None:
    if "backend_compile" in event:
      done = 0
      if os.path.exists(self.path):
        with open(self.path, encoding="utf-8") as f:
          done = sum(1 for _ in f)
      self.by_step[done + 1] += duration

  def close(self) -> None:
    monitoring.unregister_event_duration_listener(self)


def run_one(eta: int, args) -> dict:
  c = config_lib.load(args.config)
  for key, value in {"rollout.max_head_offpolicyness": eta, "train.total_steps": args.steps,
                     "rollout.max_new_tokens": args.cap, "train.checkpoint_every": 10**6,
                     "train.eval_every": 0,
                     "actor.batch_size": args.batch, "rollout.num_slots": args.slots,
                     "rollout.max_concurrent_rollouts": max(args.batch, args.slots // c.rollout.n_samples),
                     "rollout.filter_uniform_groups": False, "mesh.colocated": False,
                     "mesh.learner_devices": 1, "mesh.sampler_devices": 1,
                     "runtime.mode": args.mode, "rollout.workers": 1,
                     "task.reward": args.reward, "model.source": args.model}.items():
    config_lib.override(c, key, value)
  engines = []

  def wrap(engine):
    engines.append(engine)
    return LongTailEngine(engine, args.median, args.sigma, args.cap)

  with tempfile.TemporaryDirectory() as workdir:
    clock = CompileClock(os.path.join(workdir, "metrics.jsonl"))
    try:
      trainer.run(c, workdir, wrap_engine=wrap)
    finally:
      clock.close()
    rows = metrics_lib.read(os.path.join(workdir, "metrics.jsonl"))
    final_policy = evaluate_final_policy(c, workdir, args) if args.eval_size else {}
    if args.keep:  # each eta's metrics.jsonl (every step's timings) for a closer look
      os.makedirs(args.keep, exist_ok=True)
      shutil.copy(os.path.join(workdir, "metrics.jsonl"), os.path.join(args.keep, f"eta{eta}.jsonl"))
  skip = min(args.warmup, len(rows) - 1)  # the first steps compile most shapes
  timed = rows[skip:]
  raw_wall = sum(r["step_time_s"] for r in timed)
  compile_s = sum(clock.by_step[r["step"]] for r in timed)
  wall = raw_wall - compile_s  # steady state: a compiled shape is never compiled again
  tokens = sum(r["learner/tokens"] for r in timed)
  train_s = sum(r["learner/tokens"] / r["train_tokens_per_s"] for r in timed if r["train_tokens_per_s"])
  busy = dict(learner_busy_frac=max(0.0, train_s - compile_s) / wall, gen_busy_frac=None,
              weights_load_s_per_step=None)
  history = getattr(engines[0], "history", None)  # ray mode: (version, time, CPU s, load s)
  if history:
    at = {h[0]: h[1:] for h in history}
    (t0, cpu0, load0), (t1, cpu1, load1) = at[skip], at[len(rows)]
    busy["gen_busy_frac"] = (cpu1 - cpu0) / (t1 - t0)
    busy["weights_load_s_per_step"] = (load1 - load0) / len(timed)
  return dict(
      **busy, **final_policy, curve=[dict(step=r["step"], reward=r["reward_mean"], wall_s=r["wall_time_s"],
                          staleness_max=r["staleness_max"],
                          # the policy that generated the batch (its tokens' mean version)
                          gen_version=r["step"] - 1 - r["staleness_mean"]) for r in rows],
      eta=eta, steps=len(rows), timed_steps=len(timed), wall_per_step_s=wall / len(timed),
      trained_tokens_per_s=tokens / wall, raw_trained_tokens_per_s=tokens / raw_wall,
      compile_s_in_timed_steps=compile_s,
      learner_wait_frac=sum(r["learner_wait_s"] for r in timed) / wall,
      sampler_idle_frac=float(np.mean([r["sampler_idle_frac"] for r in timed])),
      gen_tokens_per_step=float(np.mean([r["learner/gen_tokens"] for r in timed])),
      staleness_max=max(r["staleness_max"] for r in rows),
      reward_per_sample=float(np.mean([r["reward_mean"] for r in rows])),  # every step: B groups
      final_reward=float(np.mean([r["reward_mean"] for r in rows[-max(1, len(rows) // 4):]])))


def evaluate_final_policy(c, workdir: str, args) -> dict:
  """The reward the run's final parameters earn, sampled at the training temperature.

  Every eta trains the same number of samples; the mean reward of the batches it trained on lags
  behind the policy by up to eta versions, so this asks the policy itself: ``--eval-size`` held-out
  prompts x ``--eval-k`` samples (no long-tail budgets, EOS honoured, ``--eval-tokens`` at most),
  generated in this process by the JAX sampler on one device after the timed run. Also greedy.
  """
  from areal_jax import evaluate  # pylint: disable=import-outside-toplevel

  e = config_lib.load(args.config)
  for key, value in {"model.source": args.model, "task.reward": args.reward, "runtime.mode": "local",
                     "mesh.colocated": False, "mesh.learner_devices": 1, "mesh.sampler_devices": 1,
                     "rollout.num_slots": args.slots, "rollout.max_new_tokens": args.eval_tokens,
                     "train.eval_size": args.eval_size, "train.eval_samples": args.eval_k,
                     "train.eval_temperature": c.rollout.temperature}.items():
    config_lib.override(e, key, value)
  results = evaluate.evaluate(e, workdir, stream=None)
  sampled = [s["reward"] for rec in results["records"] for s in rec.get("samples", [])]
  greedy = [rec["reward"] for rec in results["records"]]
  return dict(final_policy_reward=float(np.mean(sampled)) if sampled else None,
              final_policy_reward_greedy=float(np.mean(greedy)), final_policy_version=results["model"]["step"],
              final_policy_eval_s=results["eval_seconds"])


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="configs/arithmetic.py:tiny")
  p.add_argument("--etas", default="0,1,2,4,8")
  p.add_argument("--steps", type=int, default=16)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--slots", type=int, default=32)
  p.add_argument("--median", type=int, default=96)
  p.add_argument("--sigma", type=float, default=1.0)
  p.add_argument("--cap", type=int, default=512)
  p.add_argument("--lengths", default="custom", choices=("custom", "reasoning"),
                 help="custom: --median/--sigma/--cap; reasoning: median 4096, sigma 1, cap 32768, "
                      "divided by --length-scale")
  p.add_argument("--length-scale", type=int, default=32,
                 help="with --lengths=reasoning: the factor the lengths are divided by")
  p.add_argument("--model", default="small", choices=("small", "tiny"),
                 help="model.source: small (default: a random 4M-parameter Llama whose compute "
                      "splits like a real model's) or tiny (the 100k-parameter test model, "
                      "whose learner is dominated by attention and whose decode steps are all "
                      "overhead)")
  p.add_argument("--reward", default="digit_share", choices=("digit_share", "answer"),
                 help="task.reward: digit_share (default) is a dense toy reward the random tiny "
                      "model learns within a few steps, so the reward curves say something; "
                      "answer: the arithmetic task's own reward (~0 for a random model)")
  p.add_argument("--eval-size", type=int, default=16,
                 help="held-out prompts the final policy of each eta is evaluated on (0: none)")
  p.add_argument("--eval-k", type=int, default=8, help="samples per held-out prompt")
  p.add_argument("--eval-tokens", type=int, default=128, help="max new tokens of those samples")
  p.add_argument("--quick", action="store_true", help="eta in {0, 4}, fewer steps")
  p.add_argument("--json", default="")
  p.add_argument("--mode", default="local", choices=("local", "ray"),
                 help="local: one process, both meshes on the same cores; ray: one rollout worker "
                      "process on its own core(s), the learner on the others")
  p.add_argument("--keep", default="", help="a directory to keep each eta's metrics.jsonl in")
  p.add_argument("--png", default="", help="reward curves per eta (default: next to --json)")
  args = p.parse_args()
  if args.quick:
    args.etas, args.steps, args.warmup = "0,4", 8, 2
  if args.lengths == "reasoning":
    args.median, args.sigma, args.cap = (REASONING["median"] // args.length_scale,
                                         REASONING["sigma"], REASONING["cap"] // args.length_scale)
  etas = [int(e) for e in args.etas.split(",")]
  ray_tmp = None
  if args.mode == "ray":  # one local cluster for every eta (the runs join it)
    import ray  # pylint: disable=import-outside-toplevel
    ray_tmp = tempfile.mkdtemp(prefix="ray_")
    ray.init(num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False, _temp_dir=ray_tmp,
             object_store_memory=256 * 2**20)
  try:
    rows = [run_one(eta, args) for eta in etas]
  finally:
    if args.mode == "ray":
      try:
        ray.shutdown()
      except Exception as e:  # pylint: disable=broad-except  (the measurements are already taken)
        print(f"warning: ray.shutdown failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
      shutil.rmtree(ray_tmp, ignore_errors=True)
  base = next(r for r in rows if r["eta"] == 0)["trained_tokens_per_s"] if 0 in etas else None
  raw_base = next(r for r in rows if r["eta"] == 0)["raw_trained_tokens_per_s"] if 0 in etas else None
  for r in rows:
    r["speedup"] = r["trained_tokens_per_s"] / base if base else None
    r["raw_speedup"] = r["raw_trained_tokens_per_s"] / raw_base if raw_base else None
  machine = dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                 cores=os.cpu_count(), load_avg_before=LOAD_BEFORE, load_avg_after=os.getloadavg())
  print(f"machine: {machine}; mode {args.mode}; config {args.config}, {args.steps} steps ({args.warmup} untimed), "
        f"B={args.batch}, slots={args.slots}, budget lognormal(median {args.median}, "
        f"sigma {args.sigma}) capped at {args.cap}, EOS ignored; reward {args.reward}")
  header = (f"{'eta':>4} {'s/step':>8} {'train tok/s':>12} {'speedup':>8} {'raw x':>6} {'compile':>8} "
            f"{'wait':>6} {'idle':>6} {'gen':>5} {'learn':>5} {'stale':>6} {'reward':>7} {'r/sample':>8} "
            f"{'policy':>7}")
  print(header)
  for r in rows:
    gen = f"{r['gen_busy_frac']:>5.2f}" if r["gen_busy_frac"] is not None else f"{'-':>5}"
    print(f"{r['eta']:>4} {r['wall_per_step_s']:>8.2f} {r['trained_tokens_per_s']:>12.1f} "
          f"{(r['speedup'] or 0):>8.2f} {(r['raw_speedup'] or 0):>6.2f} {r['compile_s_in_timed_steps']:>7.1f}s "
          f"{r['learner_wait_frac']:>6.2f} {r['sampler_idle_frac']:>6.2f} {gen} "
          f"{r['learner_busy_frac']:>5.2f} {r['staleness_max']:>6d} {r['final_reward']:>7.3f} "
          f"{r['reward_per_sample']:>8.3f} {_fmt(r.get('final_policy_reward')):>7}")
  sync = next((r for r in rows if r["eta"] == 0), None)
  gen_frac = sync["learner_wait_frac"] if sync else None
  if sync:
    print(f"synchronous steps spent {gen_frac:.0%} of their time waiting for generation")
  for r in rows:
    r["overlap_efficiency"] = max(r["learner_busy_frac"], 1 - r["sampler_idle_frac"])
  print("overlap efficiency (the busier side's busy share; ideal 1): " +
        ", ".join(f"eta {r['eta']} {r['overlap_efficiency']:.2f}" for r in rows))
  out = dict(machine=machine, args=vars(args), rows=rows, gen_frac_sync=gen_frac,
             speedup={str(r["eta"]): r["speedup"] for r in rows},
             overlap_efficiency={str(r["eta"]): r["overlap_efficiency"] for r in rows},
             final_reward={str(r["eta"]): r["final_reward"] for r in rows},
             reward_per_sample={str(r["eta"]): r["reward_per_sample"] for r in rows},
             final_policy_reward={str(r["eta"]): r.get("final_policy_reward") for r in rows},
             staleness_max={str(r["eta"]): r["staleness_max"] for r in rows},
             gen_busy_frac={str(r["eta"]): r["gen_busy_frac"] for r in rows},
             learner_busy_frac={str(r["eta"]): r["learner_busy_frac"] for r in rows},
             weights_load_s_per_step={str(r["eta"]): r["weights_load_s_per_step"] for r in rows})
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2)
  png = args.png or (os.path.splitext(args.json)[0] + ".png" if args.json else "")
  if png:
    plot_curves(rows, png, f"{args.mode} mode, B={args.batch}, {machine['cores']} cores")
    print(f"curves: {png}")


def _fmt(value) -> str:
  return "-" if value is None else f"{value:.3f}"


def plot_curves(rows: list[dict], path: str, title: str) -> None:
  """Reward of the trained batch per step (same seeds: the same samples budget) and against wall
  time, one line per eta (Agg canvas, no display needed)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  policy = [r for r in rows if r.get("final_policy_reward") is not None]
  panels = 4 if policy else 3
  fig = Figure(figsize=(5 * panels, 4))
  FigureCanvasAgg(fig)
  by_step, by_version, by_time = (fig.add_subplot(1, panels, i) for i in (1, 2, 3))
  if policy:  # the final parameters' own reward: the same number of trained samples at every eta
    final = fig.add_subplot(1, panels, 4)
    final.bar([str(r["eta"]) for r in policy], [r["final_policy_reward"] for r in policy],
              color=[f"C{i}" for i, r in enumerate(rows) if r in policy])
    final.set(xlabel="eta", ylabel="mean reward, sampled", title="final policy (held-out prompts)")
  for r in rows:
    steps = [p["step"] for p in r["curve"]]
    reward = [p["reward"] for p in r["curve"]]
    by_step.plot(steps, reward, marker=".", label=f"eta {r['eta']}")
    by_version.plot([p["gen_version"] for p in r["curve"]], reward, marker=".", label=f"eta {r['eta']}")
    by_time.plot([p["wall_s"] for p in r["curve"]], reward, marker=".", label=f"eta {r['eta']}")
  by_step.set(xlabel="training step (B groups each)", ylabel="mean reward of the trained batch",
              title="reward per trained sample")
  by_version.set(xlabel="policy version that generated the batch (mean over its tokens)",
                 title="reward by generating policy (each update's gain)")
  by_time.set(xlabel="wall time (s, compilation included)", title="reward over time")
  by_step.legend()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


if __name__ == "__main__":
  main()
