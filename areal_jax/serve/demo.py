r"""``make serve-demo``: the policy learns arithmetic from simulated users' conversations alone.

  python -m areal_jax.serve.demo --config=configs/serve_arithmetic.py --workdir=runs/serve_demo
  python -m areal_jax.serve.demo --config=configs/serve_arithmetic.py:tiny --workdir=/tmp/sd \
      --duration_s=60 --eval_size=8
  python -m areal_jax.serve.demo --config=configs/serve_arithmetic.py --workdir=runs/serve_opd \
      --signal=opd
  python -m areal_jax.serve.demo --config=configs/serve_arithmetic.py --workdir=runs/serve_comb \
      --signal=combined --config.serve.signal_w_opd=0.25

``--config.<key>=<value>`` overrides a config key, as for ``python -m areal_jax.serve``: the demo,
its server and its evaluations all read the overridden config.

``--signal`` (``serve.signal``: binary, opd or combined) picks what the judged turns train with and
``--feedback`` (``serve.sim_feedback``) what the users reply; by default the users whose replies
the signal reads: "right" / "that's wrong" for binary, the way to work the problem out in words
(no right/wrong word) for opd, both for combined (serve/simulated_user.py).

  1. held-out greedy pass@1 of the starting model (the standalone evaluator, ``eval_before.json``;
     kept from an earlier run of the same workdir);
  2. the server (``python -m areal_jax.serve``, its own process) starts on the loopback port;
  3. ``serve.sim_users`` simulated users (the official ``openai`` client) ask train-split questions
     and reply "right" / "that's wrong" for ``--duration_s`` seconds (``conversations.jsonl``);
     the judge and trainer loops learn from the recorded turns meanwhile;
  4. SIGTERM: the trainer checkpoints, the server stops;
  5. the evaluator scores up to ``--curve_points`` of the kept checkpoints, the last one included
     (``eval_v<version>.json``; ``eval_after.json`` is the last);
  6. ``serve_curve.png``: held-out pass@1 against policy version and against time, with the users'
     own success rate (a rolling mean over their conversations).
While the users talk, a status line every ``serve.status_every_s`` (``--status_every_s``): time
left, the users' conversations and success rate over the last window, then the server's numbers
from ``/health`` (``areal_jax.serve.status``); the server's own lines go to ``server.log``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from absl import app, flags
from ml_collections import config_flags

from areal_jax import config as config_lib

FEEDBACK_OF = {"binary": "verdict", "opd": "words", "combined": "both"}


def signal_overrides(config, signal: str | None, feedback: str | None) -> dict:
  """The ``serve.*`` settings ``--signal`` / ``--feedback`` give, applied to ``config`` (the users
  read it) and returned as command-line overrides for the server."""
  out = {}
  if signal is not None:
    out["serve.signal"] = signal
  if feedback is not None or signal is not None:
    out["serve.sim_feedback"] = feedback or FEEDBACK_OF[signal]
  for key, value in out.items():
    section, name = key.split(".")
    config[section][name] = value
  return out


def override_args(values: dict) -> list[str]:
  """``--config.<key>=<value>`` arguments that give a config flag's ``override_values`` to another
  process whose ``--config`` is the same file: the values written the way the flag parses them."""
  def text(v):
    if isinstance(v, bool):
      return str(v).lower()
    if isinstance(v, (tuple, list)):
      return repr(tuple(v))
    return v if isinstance(v, str) else repr(v)
  return [f"--config.{key}={text(value)}" for key, value in values.items()]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _evaluate(spec: str, extra: list[str], checkpoint: str, output: str) -> dict:
  cmd = [sys.executable, "-m", "areal_jax.evaluate", f"--config={spec}", f"--output={output}", *extra]
  if checkpoint:
    cmd.append(f"--checkpoint={checkpoint}")
  subprocess.run(cmd, check=True)
  with open(output, encoding="utf-8") as f:
    return json.load(f)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
  deadline = time.time() + timeout
  while time.time() < deadline:
    if proc.poll() is not None:
      raise SystemExit(f"the server exited with status {proc.returncode} before it was up")
    try:
      with urllib.request.urlopen(url, timeout=5) as r:
        if r.status == 200:
          return
    except OSError:
      time.sleep(1.0)
  raise SystemExit(f"the server did not answer {url} within {timeout:.0f} s")


def _clock(seconds: float) -> str:
  return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def _report(users, health_url: str, every_s: float, duration: float, stop: threading.Event) -> None:
  """Prints a status line every ``every_s`` seconds until ``stop`` (the module docstring)."""
  from areal_jax.serve import status  # pylint: disable=import-outside-toplevel

  t0, seen = time.time(), 0
  while not stop.wait(every_s):
    done = users.finished()
    window, seen = done[seen:], len(done)
    right = f"{100 * sum(r['right'] for r in window) / len(window):.0f}% right" if window else "none"
    try:
      with urllib.request.urlopen(health_url, timeout=10) as r:
        server = status.describe(json.load(r)["serving"])
    except (OSError, KeyError, ValueError) as e:
      server = f"the server did not answer /health ({e})"
    elapsed = time.time() - t0
    print(f"status {_clock(elapsed)} of {_clock(duration)} ({_clock(max(duration - elapsed, 0))} "
          f"left): users {len(window)} conversations, {right} over the last {every_s:.0f} s; "
          f"{server}", flush=True)


def main(argv) -> None:
  del argv
  from areal_jax import cli  # pylint: disable=import-outside-toplevel

  cli.set_up_logging()  # no line per HTTP request of the users' client
  spec = config_flags.get_config_filename(flags.FLAGS["config"])
  workdir, config = os.path.abspath(_WORKDIR.value), _CONFIG.value
  given = override_args(config_flags.get_override_values(flags.FLAGS["config"]))
  overrides = signal_overrides(config, _SIGNAL.value, _FEEDBACK.value)
  every = config.serve.status_every_s if _STATUS_EVERY.value is None else _STATUS_EVERY.value
  os.makedirs(workdir, exist_ok=True)
  extra = given + ([] if _EVAL_SIZE.value is None else
                   [f"--config.train.eval_size={_EVAL_SIZE.value}"])
  before_path = os.path.join(workdir, "eval_before.json")
  before = _evaluate(spec, extra, "", before_path) if not os.path.exists(before_path) else \
      json.load(open(before_path, encoding="utf-8"))

  port = _free_port()
  log = open(os.path.join(workdir, "server.log"), "a", encoding="utf-8")
  server = subprocess.Popen([sys.executable, "-m", "areal_jax.serve", f"--config={spec}",
                             f"--workdir={workdir}", *given, f"--config.serve.port={port}",
                             f"--config.serve.status_every_s={every}",
                             *override_args(overrides)],
                            stdout=log, stderr=subprocess.STDOUT)
  t_start = time.time()
  try:
    _wait_healthy(f"http://127.0.0.1:{port}/health", server, timeout=1800)
    from areal_jax.serve.simulated_user import SimulatedUsers  # pylint: disable=import-outside-toplevel

    users = SimulatedUsers(config, f"http://127.0.0.1:{port}/v1",
                           os.path.join(workdir, "conversations.jsonl"))
    duration = _DURATION.value or config.serve.sim_duration_s
    print(f"simulated users talking to the server for {duration:.0f} s", flush=True)
    stop = threading.Event()
    reporter = threading.Thread(target=_report, daemon=True, args=(
        users, f"http://127.0.0.1:{port}/health", every, duration, stop))
    if every > 0:
      reporter.start()
    try:
      results = users.run(duration)
    finally:
      stop.set()
    try:
      with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
        health = json.load(r)
    except OSError as e:  # the server died (e.g. killed for memory): evaluate what it checkpointed
      health = {"error": f"the server did not answer /health ({e}); exit status {server.poll()}, "
                         f"see {workdir}/server.log"}
      print(health["error"], file=sys.stderr, flush=True)
  finally:
    if server.poll() is None:
      server.send_signal(signal.SIGTERM)
    server.wait(timeout=900)
    log.close()
  print(f"{len(results)} conversations ({users.errors} failed requests); server status: "
        f"{json.dumps(health)}", flush=True)

  steps = sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit()) \
      if os.path.isdir(os.path.join(workdir, "checkpoints")) else []
  picked = sorted({steps[round(i * (len(steps) - 1) / max(_POINTS.value - 1, 1))]
                   for i in range(_POINTS.value)}) if steps else []
  curve = [(0, before["pass@1"])]
  for step in picked:
    out = _evaluate(spec, extra, os.path.join(workdir, "checkpoints", str(step)),
                    os.path.join(workdir, f"eval_v{step}.json"))
    curve.append((step, out["pass@1"]))
  after = curve[-1][1]
  if picked:
    os.replace(os.path.join(workdir, f"eval_v{picked[-1]}.json"), os.path.join(workdir, "eval_after.json"))
  summary = dict(pass_at_1_before=before["pass@1"], pass_at_1_after=after, versions=[v for v, _ in curve],
                 curve=curve, conversations=len(results), user_success=float(
                     sum(r["right"] for r in results) / max(len(results), 1)),
                 user_cut_off=float(sum(r["cut_off"] for r in results) / max(len(results), 1)),
                 served_s=time.time() - t_start, trained=health.get("trainer"),
                 judged=health.get("judge"), signal=config.serve.signal,
                 feedback=config.serve.sim_feedback)
  with open(os.path.join(workdir, "serve_demo.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  png = plot(workdir, curve, results)
  print(f"held-out greedy pass@1: {before['pass@1']:.3f} before -> {after:.3f} after "
        f"({100 * (after - before['pass@1']):+.1f} points, versions {[v for v, _ in curve]}); "
        f"curve: {png}", flush=True)


def plot(workdir: str, curve, conversations) -> str:
  """``serve_curve.png``: pass@1 by policy version; the users' rolling success rate by time."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  fig = Figure(figsize=(10, 4), dpi=100, layout="constrained")
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 2, 1)
  ax.plot([v for v, _ in curve], [a for _, a in curve], marker="o")
  ax.set(xlabel="policy version (train steps)", ylabel="held-out greedy pass@1",
         title="standalone evaluator")
  ax2 = fig.add_subplot(1, 2, 2)
  if conversations:
    t0 = conversations[0]["time_s"]
    right = [float(r["right"]) for r in conversations]
    window = max(1, len(right) // 10)
    rolling = [sum(right[max(0, i - window + 1):i + 1]) / len(right[max(0, i - window + 1):i + 1])
               for i in range(len(right))]
    ax2.plot([(r["time_s"] - t0) / 60 for r in conversations], rolling)
  ax2.set(xlabel="minutes of serving", ylabel="answers the users called right",
          title=f"simulated users (rolling mean of {max(1, len(conversations) // 10)})")
  path = os.path.join(workdir, "serve_curve.png")
  fig.savefig(path + ".tmp", format="png")
  os.replace(path + ".tmp", path)
  return path


if __name__ == "__main__":
  # Flags are defined here, not at import, so importing this module (its tests, bench scripts)
  # never defines --config beside another module's.
  _CONFIG = config_flags.DEFINE_config_file(
      "config", "configs/serve_arithmetic.py",
      "config file[:preset]; --config.<key>=<value> overrides")
  _WORKDIR = flags.DEFINE_string("workdir", "runs/serve_demo", "the server's workdir")
  _DURATION = flags.DEFINE_float("duration_s", None, "simulated users' time (serve.sim_duration_s)")
  _EVAL_SIZE = flags.DEFINE_integer("eval_size", None, "held-out problems (train.eval_size)")
  _POINTS = flags.DEFINE_integer("curve_points", 4, "checkpoints evaluated for the curve")
  _STATUS_EVERY = flags.DEFINE_float("status_every_s", None,
                                     "seconds between status lines (serve.status_every_s)")
  _SIGNAL = flags.DEFINE_enum("signal", None, ["binary", "opd", "combined"],
                              "what judged turns train with (serve.signal; default: the config's)")
  _FEEDBACK = flags.DEFINE_enum("feedback", None, ["verdict", "words", "both"],
                                "what the simulated users reply (serve.sim_feedback; default: "
                                "verdict for binary, words for opd, both for combined)")
  config_lib.check_overrides(sys.argv)  # an unknown key: one line with the nearby valid keys
  app.run(main)
