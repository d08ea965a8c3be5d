"""Learner restarts: reruns a training process that died abnormally; it resumes by itself.

``launch.py`` runs the training under ``supervise`` when the learner is a group of processes
(``runtime.learner_processes > 1``). When a learner process dies (SIGKILL, OOM, a crashed host),
the driver tears the group down and exits with ``RESTART_EXIT_CODE``; a driver killed by a signal
is treated the same. The supervisor then reruns the same command with
``--config.train.resume=True``, up to ``runtime.max_learner_restarts`` times: the new process
restores the last checkpoint (learner state, policy version, data position, unfinished groups,
staleness counters), drops the metrics rows and trajectory dumps written after it and goes on, so
versions stay continuous and the staleness bound holds across the restart.

Not restarted: a clean exit (0), an ordinary error (exit 1: bad config, an unusable run
directory, a non-finite loss — rerunning would fail the same way) and a stop asked for with
SIGINT/SIGTERM (forwarded to the training process, which saves a checkpoint and exits).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from areal_jax.runtime.errors import RESTART_EXIT_CODE

CHILD_ENV = "AREAL_JAX_SUPERVISED"  # set in the training process: it must not supervise itself
RESUME_FLAG = "--config.train.resume=True"


def restartable(returncode: int) -> bool:
  """A learner group that lost a process, or a training process killed by a signal."""
  return returncode == RESTART_EXIT_CODE or returncode < 0


def describe(returncode: int) -> str:
  if returncode < 0:
    try:
      return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
      return f"was killed by signal {-returncode}"
  if returncode == RESTART_EXIT_CODE:
    return "lost a learner process"
  return f"exited with status {returncode}"


def supervise(cmd: list[str], max_restarts: int, env: dict | None = None) -> int:
  """Runs ``cmd`` until it ends for good; returns its last exit status (128 + n for signal n)."""
  env = dict(os.environ if env is None else env, **{CHILD_ENV: "1"})
  stopping = False
  proc = None

  def forward(signum, frame):
    del frame
    nonlocal stopping
    stopping = True
    if proc is not None and proc.poll() is None:
      proc.send_signal(signum)

  old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    restarts, args = 0, list(cmd)
    while True:
      proc = subprocess.Popen(args, env=env)
      while True:
        try:
          rc = proc.wait()
          break
        except InterruptedError:
          continue
      if stopping or rc == 0 or not restartable(rc):
        return rc if rc >= 0 else 128 - rc
      if restarts >= max_restarts:
        print(f"supervisor: the training process {describe(rc)}; runtime.max_learner_restarts="
              f"{max_restarts} restarts used up, giving up (rerun the command to resume)",
              file=sys.stderr, flush=True)
        return rc if rc >= 0 else 128 - rc
      restarts += 1
      print(f"supervisor: the training process {describe(rc)}; restart {restarts}/{max_restarts} "
            "from the last checkpoint", file=sys.stderr, flush=True)
      args = list(cmd) + [RESUME_FLAG]
  finally:
    for s, h in old.items():
      signal.signal(s, h)


def is_child() -> bool:
  return os.environ.get(CHILD_ENV) == "1"
