"""A command that must not outlive the process that started it (its owner).

``python -m areal_jax.vllm_rollout.lifeline --owner PID [--grace S] [--pid-file F] -- CMD ...``
starts CMD in a process group of its own, writes CMD's pid to F, and watches. It stops the whole
group (SIGTERM; SIGKILL to what is left after ``grace`` seconds) when

* the owner is gone: this process is then adopted, so its parent is no longer PID. That covers an
  owner killed by a signal (SIGKILL, or SIGTERM from a scheduler), which runs no exit handler;
* this process gets SIGTERM, SIGINT or SIGHUP: the owner's ``close``;
* CMD ends on its own (or is killed, say by the OOM killer): what it started goes with it.

It exits with CMD's status (128 + n when a signal n ended it), after CMD's group is gone. Stopping
the group, not only CMD, also stops the processes CMD started (vLLM's engine core). It imports
nothing but the standard library, so it costs a few MiB and starts at once.

The lifeline itself may be killed: Ray, when a worker exits, SIGKILLs the worker's direct children
(``RAY_kill_child_processes_on_worker_exit``), which the lifeline is and CMD is not. So CMD should
guard itself too: ``--guard -- MODULE ARGS`` runs the Python module MODULE (as ``python -m``) in
this process, and stops its group (SIGTERM; SIGKILL from a reaper, ``--reap``, after ``grace``
seconds) when its parent, the lifeline, is gone. ``command(guarded(...), ...)`` builds both.

Why not ``PR_SET_PDEATHSIG``: it fires when the *thread* that started the child ends, and engines
are built on worker threads; it is also Linux-only. Polling the parent works everywhere.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import subprocess
import sys
import threading
import time

POLL_S = 0.2
PARENT_ENV = "AREAL_LIFELINE_PID"  # the lifeline's pid, for the guard of the command it starts
MODULE = "areal_jax.vllm_rollout.lifeline"  # not __name__: that is "__main__" when run with -m


def command(cmd: list[str], *, owner: int, grace_s: float, pid_file: str,
            python: str = sys.executable) -> list[str]:
  """``cmd`` wrapped in a lifeline owned by process ``owner``."""
  return [python, "-m", MODULE, "--owner", str(owner), "--grace", str(grace_s),
          "--pid-file", pid_file, "--", *cmd]


def guarded(module: str, args: list[str], *, grace_s: float,
            python: str = sys.executable) -> list[str]:
  """``python -m module args`` that stops itself when its parent (a lifeline) is gone."""
  return [python, "-m", MODULE, "--guard", "--grace", str(grace_s), "--", module, *args]


def _stat(pid: str) -> tuple[str, int] | None:
  """(state, process group) of ``pid`` from /proc, or None if it is gone."""
  try:
    with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except (OSError, IndexError):
    return None
  return fields[0], int(fields[2])


def group_members(pgid: int) -> list[int] | None:
  """The running processes of group ``pgid`` (zombies left out), or None without /proc."""
  if not os.path.exists("/proc/self/stat"):
    return None
  return [int(pid) for pid in os.listdir("/proc")
          if pid.isdigit() and (stat := _stat(pid)) is not None and stat[1] == pgid
          and stat[0] != "Z"]


def group_alive(pgid: int) -> bool:
  """Whether a process of group ``pgid`` still runs. Zombies do not count where /proc tells them
  apart (Linux): an adopted one waits on a reaper that, in some containers, never comes."""
  members = group_members(pgid)
  if members is not None:
    return bool(members)
  try:
    os.killpg(pgid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # a member exists but is not ours to signal
    return True
  return True


def _signal_group(pgid: int, sig: int) -> None:
  try:
    os.killpg(pgid, sig)
  except ProcessLookupError:
    pass


def _await_group(pgid: int, wait_s: float, poll=None) -> bool:
  """Whether group ``pgid`` is gone within ``wait_s`` (``poll``: reaps a child of ours in it)."""
  deadline = time.monotonic() + wait_s
  while True:
    if poll is not None:
      poll()  # a zombie child of ours still counts as a member of its group until reaped
    if not group_alive(pgid):
      return True
    if time.monotonic() >= deadline:
      return False
    time.sleep(0.05)


def reap(pgid: int, grace_s: float, poll=None) -> int:
  """Waits up to ``grace_s`` for group ``pgid`` to end, then SIGKILLs what is left of it and waits
  (a few seconds at most) for that to go too."""
  if not _await_group(pgid, grace_s, poll):
    _signal_group(pgid, signal.SIGKILL)
    _await_group(pgid, 5.0, poll)
  return 0


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
  """SIGTERM to ``proc``'s group (it leads one), then ``reap``: returns once the group is gone
  (or, with unreapable zombies left, shortly after the SIGKILL)."""
  _signal_group(proc.pid, signal.SIGTERM)
  reap(proc.pid, grace_s, proc.poll)


def _write_pid(path: str, pid: int) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(f"{pid}\n")
  os.replace(tmp, path)


def _exit_status(returncode: int) -> int:
  return returncode if returncode >= 0 else 128 - returncode


def _stop_self(grace_s: float) -> None:
  """SIGTERM to this process's group if it leads one (else to itself): each process's orderly
  shutdown. A reaper in a session of its own SIGKILLs what is left of the group after
  ``grace_s``, this process included, since a process ended by the SIGTERM cannot."""
  pgid = os.getpgrp()
  if pgid != os.getpid():  # not a group of its own: only this process is ours to stop
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)
    return
  subprocess.Popen([sys.executable, "-m", MODULE, "--reap", str(pgid), "--grace", str(grace_s)],
                   start_new_session=True, stdin=subprocess.DEVNULL)
  os.killpg(pgid, signal.SIGTERM)


def run_guarded(module: str, args: list[str], grace_s: float) -> int:
  """Runs ``module`` as ``python -m`` would, in this process, while a thread watches the parent
  (the lifeline that started it, named by ``PARENT_ENV``: one killed before this line ran is seen
  gone at once)."""
  parent = int(os.environ.pop(PARENT_ENV, "0")) or os.getppid()

  def watch():
    while os.getppid() == parent:
      time.sleep(POLL_S)
    print(f"lifeline guard: parent {parent} is gone; stopping {module} (pid {os.getpid()})",
          file=sys.stderr, flush=True)
    _stop_self(grace_s)

  threading.Thread(target=watch, name="lifeline-guard", daemon=True).start()
  sys.argv = [module, *args]
  runpy.run_module(module, run_name="__main__", alter_sys=True)
  return 0


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog=f"python -m {MODULE}",
                                   description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("--owner", type=int, default=0, help="pid whose end stops CMD")
  parser.add_argument("--guard", action="store_true",
                      help="run the module CMD names here, until the parent is gone")
  parser.add_argument("--reap", type=int, default=0, metavar="PGID",
                      help="SIGKILL what is left of group PGID after --grace seconds")
  parser.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and KILL")
  parser.add_argument("--pid-file", default="", help="where CMD's pid is written")
  parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ...")
  args = parser.parse_args(argv)
  if args.reap:
    return reap(args.reap, args.grace)
  cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
  if not cmd:
    parser.error("no command given after --")
  if args.guard == bool(args.owner):
    parser.error("give either --owner PID (a lifeline) or --guard (a guarded module)")
  if args.guard:
    return run_guarded(cmd[0], cmd[1:], args.grace)

  asked: list[int] = []
  for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda signum, _frame: asked.append(signum))
  if asked or os.getppid() != args.owner:  # the owner ended or closed before CMD started
    print(f"lifeline: owner {args.owner} is gone or asked to stop; not starting {cmd[0]}",
          file=sys.stderr)
    return 1
  proc = subprocess.Popen(cmd, start_new_session=True,  # pylint: disable=consider-using-with
                          env=dict(os.environ, **{PARENT_ENV: str(os.getpid())}))
  if args.pid_file:
    _write_pid(args.pid_file, proc.pid)
  while proc.poll() is None:
    if asked or os.getppid() != args.owner:
      why = f"signal {asked[0]}" if asked else f"owner {args.owner} is gone"
      print(f"lifeline: {why}; stopping process group {proc.pid}", file=sys.stderr, flush=True)
      stop_group(proc, args.grace)
      break
    time.sleep(POLL_S)
  else:  # CMD ended on its own: what it started goes with it
    if group_alive(proc.pid):
      stop_group(proc, args.grace)
  return _exit_status(proc.wait())


if __name__ == "__main__":
  sys.exit(main())
