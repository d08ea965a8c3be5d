"""What serving learns from its users under each training signal: binary RL, hindsight OPD, both.

  python bench/serve_signals.py [--quick] [--minutes M] [--idle-s S] [--warm-s S] [--json PATH]
      [--signals binary,opd,combined] [--feedback verdict|words|both] [--seed N] [--eval-size N]
      [--workdir DIR] [--set KEY=VALUE ...]

The three ``serve.signal`` settings run one after another, each in a process of its own (this
script with ``--one``), with the same config (configs/serve_arithmetic.py: SmolLM2-135M;
``--quick``: the tiny random model), the same simulated users (``--feedback``, default ``both``:
"right", or "that's wrong" and the way to work the problem out, which every signal can read; use
``--feedback=words`` for users who teach only in words), the same seed and the same minutes; only
the signal differs. Per signal:
  1. the server (``ServeRuntime``, the config's trainer mode, its loopback port) starts, every
     decode bucket compiled first (``serve.warmup``), and the users talk for ``--warm-s`` seconds,
     untimed, the judge loop stopped (the first requests' other programs compile);
  2. ``idle``: the judge loop stopped (nothing is judged, so nothing is taught or trained), the
     users talk for ``--idle-s`` seconds;
  3. ``teaching``: the judge loop runs, the teacher scores hinted turns (in the trainer's process
     by default: ``serve.teacher_at``), the trainer trains on judged ones; the users talk for
     ``--minutes``;
  4. the server stops (the trainer checkpoints), and the standalone evaluator scores the newest
     checkpoint on the held-out split: ``pass_at_1_after`` (``pass_at_1_before``: the start
     weights, once for all signals).
Per signal: ``pass_at_1_after``, ``turns_trained``, ``train_steps``, ``hinted`` /
``teacher_scored`` turns and ``teacher_s_per_turn`` (the teacher's seconds per hinted turn, in the
loop that runs it: ``teacher_at``, ``serve.teacher_at``), conversations, and per phase (``idle``,
``teaching``) the users' question requests:
``requests``, ``latency_p50_ms``, ``latency_p99_ms`` (sent -> response parsed, as bench/serve.py
names them) and, for teaching, ``p50_vs_idle`` / ``p99_vs_idle``. The machine and its load are
printed and stored.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from common import machine, override_all  # noqa: E402

from areal_jax import config as config_lib  # noqa: E402

SIGNALS = ("binary", "opd", "combined")


def _latency(conversations: list[dict]) -> dict:
  ms = np.asarray([1000.0 * c["answer_s"] for c in conversations])
  return dict(requests=len(ms),
              latency_p50_ms=float(np.percentile(ms, 50)) if len(ms) else None,
              latency_p99_ms=float(np.percentile(ms, 99)) if len(ms) else None)


def _config(args, signal: str):
  config = config_lib.load(args.spec)
  config.unlock()
  config.serve.port = 0
  config.serve.warmup = True  # every decode bucket compiled before the first request
  config.serve.signal, config.serve.sim_feedback = signal, args.feedback
  override_all(config, args.set)
  config.lock()
  return config


def run_one(args, signal: str, workdir: str) -> dict:
  """One signal's server, idle and teaching phases (the module docstring, steps 1 to 3)."""
  from areal_jax.runtime.ray_worker import pin_process  # pylint: disable=import-outside-toplevel
  from areal_jax.serve import trainer_supervisor  # pylint: disable=import-outside-toplevel

  config = _config(args, signal)
  cores = trainer_supervisor.plan_cores(config)
  if cores is not None:  # as the CLI does: the server's share before JAX's CPU client exists
    pin_process(cores[0])
  # pylint: disable-next=import-outside-toplevel  (imports JAX, after the pinning)
  from areal_jax.serve.runtime import ServeRuntime
  from areal_jax.serve.simulated_user import SimulatedUsers  # pylint: disable=import-outside-toplevel

  rt = ServeRuntime(config, workdir, cores=cores)
  rt.start()
  try:
    rt.judge.stop()  # idle: nothing judged, so nothing taught or trained
    SimulatedUsers(config, rt.url, seed=args.seed + 2).run(args.warm_s)  # compiles, untimed
    idle = SimulatedUsers(config, rt.url, seed=args.seed)
    idle.run(args.idle_s)
    rt.judge.start()
    users = SimulatedUsers(config, rt.url, seed=args.seed + 1)
    t0 = time.time()
    users.run(60.0 * args.minutes)
    teaching_s = time.time() - t0
    status = rt.status()
  finally:
    rt.stop()
  phases = {"idle": _latency(idle.finished()), "teaching": _latency(users.finished())}
  base = phases["idle"]
  if base["latency_p50_ms"] and phases["teaching"]["latency_p50_ms"]:
    for q in ("p50", "p99"):
      phases["teaching"][f"{q}_vs_idle"] = (phases["teaching"][f"latency_{q}_ms"]
                                            / base[f"latency_{q}_ms"])
  judge, trainer = status.get("judge") or {}, status.get("trainer") or {}
  # the loop that ran the teacher (serve.teacher_at) carries its counters
  teaching = trainer if "teacher_s" in trainer else judge
  done = users.finished()
  return dict(signal=signal, feedback=args.feedback, phases=phases, teaching_s=teaching_s,
              conversations=len(done), user_success=float(
                  np.mean([c["right"] for c in done])) if done else None,
              errors=idle.errors + users.errors, turns_trained=trainer.get("trained"),
              train_steps=trainer.get("steps"), taught=trainer.get("taught"),
              hinted=judge.get("hinted"), teacher_scored=teaching.get("teacher_scored"),
              teacher_at=config.serve.teacher_at,
              teacher_s_per_turn=teaching.get("teacher_s_per_turn"), judged=judge.get("judged"),
              unjudgeable=judge.get("unjudgeable"))


def _newest_checkpoint(workdir: str) -> str | None:
  root = os.path.join(workdir, "checkpoints")
  steps = sorted(int(n) for n in os.listdir(root) if n.isdigit()) if os.path.isdir(root) else []
  return os.path.join(root, str(steps[-1])) if steps else None


def _evaluate(args, checkpoint: str | None, output: str) -> float:
  from areal_jax.serve.demo import _evaluate as evaluate  # pylint: disable=import-outside-toplevel

  extra = [f"--config.train.eval_size={args.eval_size}"] if args.eval_size else []
  return evaluate(args.spec, extra, checkpoint or "", output)["pass@1"]


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="the tiny model")
  ap.add_argument("--minutes", type=float, default=None, help="teaching minutes per signal")
  ap.add_argument("--idle-s", type=float, default=None, help="idle seconds per signal")
  ap.add_argument("--warm-s", type=float, default=None, help="untimed seconds before idle")
  ap.add_argument("--signals", default=",".join(SIGNALS), help="comma-separated serve.signal values")
  ap.add_argument("--feedback", default="both", choices=("verdict", "words", "both"),
                  help="what the simulated users reply (serve.sim_feedback)")
  ap.add_argument("--seed", type=int, default=1, help="the simulated users' seed")
  ap.add_argument("--eval-size", type=int, default=None, help="held-out problems (train.eval_size)")
  ap.add_argument("--workdir", default=None, help="keep each signal's server workdir here")
  ap.add_argument("--json", default=None, help="write results to this path")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="override a key of the recipe for every signal")
  ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: one signal
  ap.add_argument("--out", default=None, help=argparse.SUPPRESS)  # the child's JSON
  args = ap.parse_args()
  args.spec = f"configs/serve_arithmetic.py:{'tiny' if args.quick else 'default'}"
  args.minutes = args.minutes if args.minutes is not None else (1.0 if args.quick else 20.0)
  args.idle_s = args.idle_s if args.idle_s is not None else (20.0 if args.quick else 120.0)
  args.warm_s = args.warm_s if args.warm_s is not None else (10.0 if args.quick else 30.0)
  if args.one:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(run_one(args, args.one, args.workdir), f)
    return
  signals = [s for s in args.signals.split(",") if s]
  bad = [s for s in signals if s not in SIGNALS]
  if bad:
    raise SystemExit(f"--signals: {bad} are not among {SIGNALS}")
  info = machine()
  print(f"machine: {info['cpu']}, {info['cores']} cores, jax {info['jax']}; load average "
        f"{info['load_avg']:.1f}; {args.spec}, users '{args.feedback}', seed {args.seed}, "
        f"{args.idle_s:.0f} s idle + {args.minutes:g} min teaching per signal", flush=True)
  t_start = time.time()
  root = args.workdir or tempfile.mkdtemp(prefix="serve_signals_")
  os.makedirs(root, exist_ok=True)
  before = _evaluate(args, None, os.path.join(root, "eval_before.json"))
  results = {}
  for signal in signals:
    workdir = os.path.join(root, signal)
    out = os.path.join(root, f"{signal}.json")
    cmd = [sys.executable, os.path.abspath(__file__), f"--one={signal}", f"--out={out}",
           f"--workdir={workdir}", f"--minutes={args.minutes}", f"--idle-s={args.idle_s}",
           f"--warm-s={args.warm_s}",
           f"--feedback={args.feedback}", f"--seed={args.seed}", *[f"--set={s}" for s in args.set]]
    subprocess.run(cmd + (["--quick"] if args.quick else []), check=True)
    with open(out, encoding="utf-8") as f:
      res = json.load(f)
    ckpt = _newest_checkpoint(workdir)
    res["version_evaluated"] = int(os.path.basename(ckpt)) if ckpt else 0
    res["pass_at_1_after"] = (_evaluate(args, ckpt, os.path.join(root, f"eval_{signal}.json"))
                              if ckpt else before)
    results[signal] = res
  print(f"held-out pass@1 before: {before:.3f}")
  print(f"{'signal':>9} {'after':>6} {'trained':>7} {'steps':>5} {'taught':>6} {'teach s/turn':>12} "
        f"{'idle p50':>8} {'idle p99':>8} {'teach p50':>9} {'teach p99':>9} {'p99/idle':>8}")
  fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
  for signal, r in results.items():
    idle, teach = r["phases"]["idle"], r["phases"]["teaching"]
    print(f"{signal:>9} {r['pass_at_1_after']:>6.3f} {fmt(r['turns_trained'], '7d')} "
          f"{fmt(r['train_steps'], '5d')} {fmt(r['taught'], '6d')} "
          f"{fmt(r['teacher_s_per_turn'], '12.3f')} {fmt(idle['latency_p50_ms'], '8.0f')} "
          f"{fmt(idle['latency_p99_ms'], '8.0f')} {fmt(teach['latency_p50_ms'], '9.0f')} "
          f"{fmt(teach['latency_p99_ms'], '9.0f')} {fmt(teach.get('p99_vs_idle'), '8.2f')}")
  info["load_avg_end"] = os.getloadavg()[0]
  result = dict(machine=info, spec=args.spec, overrides=args.set, feedback=args.feedback,
                seed=args.seed, minutes=args.minutes, idle_s=args.idle_s, warm_s=args.warm_s,
                eval_size=args.eval_size, pass_at_1_before=before, signals=results,
                wall_s=time.time() - t_start)
  print(f"bench took {result['wall_s']:.0f} s; load average {info['load_avg_end']:.1f} at the end")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
