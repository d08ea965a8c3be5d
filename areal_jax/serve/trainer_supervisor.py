"""The server's side of ``serve.trainer_process``: core split, the supervised trainer process, and
the watcher that loads the versions it announces.

``plan_cores`` splits this process's CPU cores (``serve.trainer_cores``; 0: half) between the server
and the trainer; ``TrainerProcess`` starts ``python -m areal_jax.serve.trainer_process`` pinned to
the trainer's share, restarts it when it dies (exponential back-off up to 30 s; not when it stopped
on a fault a person fixes, ``errors.FAULT_EXIT_CODE``: that fault is its error), stops it with
SIGTERM (it checkpoints) or kills it; ``WeightsWatcher`` (a thread) reads the trainer's status file
and, when it announces a version other than the engine's, restores it (Orbax, straight onto the
sampler's shardings) and calls ``engine.update_params`` (applied between decode steps; in-flight
requests continue). Announced versions can go back after a crash (the trainer resumes from its
checkpoint and redoes the lost steps): the engine follows.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

from areal_jax.runtime import errors
from areal_jax.runtime.ray_cluster import plan_cores as _plan
from areal_jax.serve import trainer_process as tp

log = logging.getLogger(__name__)


def plan_cores(config, available=None):
  """``(server_cores, trainer_cores)``, or None (one core only, or the thread mode): no pinning."""
  s = config.serve
  if not (s.train and s.trainer_process):
    return None
  plan = _plan(1, s.trainer_cores, available)
  if plan is None:
    return None
  trainer, (server,) = plan
  return list(server), list(trainer)


class TrainerProcess:
  """Starts, watches and restarts the trainer process; ``alive``/``error``/``stats`` for /health."""

  def __init__(self, config, workdir: str, cores=None, extra_args=()):
    self.config, self.workdir, self.cores = config, workdir, cores
    self.extra_args = list(extra_args)
    self.restarts = 0
    self.last_exit: int | None = None
    self.fault: dict | None = None  # what stopped the process for good (types, message, traceback)
    self._awaited = False  # wait_announced waits: it raises the fault (else the monitor prints it)
    self._proc: subprocess.Popen | None = None
    self._lock = threading.Lock()
    self._stopping = threading.Event()
    self._monitor: threading.Thread | None = None

  @property
  def pid(self) -> int | None:
    return self._proc.pid if self._proc is not None else None

  @property
  def alive(self) -> bool:
    return self._proc is not None and self._proc.poll() is None

  def status(self) -> dict | None:
    """The status the current process wrote (None before its first announcement)."""
    st = tp.read_status(self.workdir)
    return st if st is not None and st.get("pid") == self.pid else None

  @property
  def error(self) -> str | None:
    if self.fault is not None:
      return f"trainer process stopped, not restarted: {self.fault['message']}"
    st = self.status()
    if st is not None and st.get("error"):
      return st["error"]
    if self.last_exit not in (None, 0):
      return f"trainer process exited with {self.last_exit} (restarted {self.restarts} times)"
    return None

  @property
  def stats(self) -> dict:
    st = self.status() or {}
    return dict(st.get("stats", {}), version=st.get("version"), pid=self.pid,
                restarts=self.restarts, cores=self.cores)

  def start(self) -> None:
    with open(os.path.join(self.workdir, tp.CONFIG_FILE) + ".tmp", "wb") as f:
      pickle.dump(self.config, f)
    os.replace(os.path.join(self.workdir, tp.CONFIG_FILE) + ".tmp",
               os.path.join(self.workdir, tp.CONFIG_FILE))
    self._stopping.clear()
    self.fault = None
    self._spawn()
    self._monitor = threading.Thread(target=self._watch, name="serve-trainer-monitor", daemon=True)
    self._monitor.start()

  def _spawn(self) -> None:
    cmd = [sys.executable, "-m", "areal_jax.serve.trainer_process", f"--workdir={self.workdir}"]
    if self.cores:
      cmd.append("--cores=" + ",".join(map(str, self.cores)))
    with self._lock:
      # Its own session: a terminal's Ctrl-C reaches the server, which stops it (checkpointing).
      self._proc = subprocess.Popen(cmd + self.extra_args,  # pylint: disable=consider-using-with
                                    start_new_session=True)
    log.info("trainer process %d started (cores %s)", self._proc.pid, self.cores)

  def _watch(self) -> None:
    backoff = 1.0
    while not self._stopping.wait(0.5):
      proc = self._proc
      if proc is None or proc.poll() is None:
        continue
      self.last_exit = proc.returncode
      st = tp.read_status(self.workdir) or {}
      fault = st.get("fault") if st.get("pid") == proc.pid else None
      if proc.returncode == errors.FAULT_EXIT_CODE and fault:
        self.fault = fault  # the same settings would fail the same way: fix, then restart
        if not self._awaited:
          print(f"trainer process {proc.pid} stopped, not restarted (serving goes on without "
                f"training): {self.fault['message']}", file=sys.stderr, flush=True)
        return
      up_s = time.time() - st.get("started", time.time())
      backoff = 1.0 if up_s > 60 else min(backoff * 2, 30.0)
      print(f"trainer process {proc.pid} exited with {proc.returncode}; restarting in "
            f"{backoff:.0f} s (it resumes from its newest checkpoint)", file=sys.stderr, flush=True)
      if self._stopping.wait(backoff):
        return
      self._spawn()
      self.restarts += 1  # (after the new process is in place: whoever reads it sees the new pid)

  def wait_announced(self, timeout: float) -> dict:
    """Blocks until the current process has published its first version; its status. A process
    that stopped on a fault raises it here, under its own type (``errors.remote_error``)."""
    self._awaited = True
    try:
      return self._wait_announced(timeout)
    finally:
      self._awaited = False

  def _wait_announced(self, timeout: float) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
      if self.fault is not None:
        raise errors.remote_error("trainer process", self.fault["types"], self.fault["message"],
                                  self.fault["traceback"])
      st = self.status()
      if st is not None and st.get("published") is not None:
        return st
      time.sleep(0.2)
    raise TimeoutError(f"the trainer process announced no weights version in {timeout:.0f} s "
                       f"(exit code {self.last_exit}; see its log above)")

  def stop(self, checkpoint: bool = True, timeout: float = 300.0) -> None:
    """SIGTERM (the trainer checkpoints; SIGKILL after ``timeout``), or SIGKILL right away."""
    self._stopping.set()
    if self._monitor is not None:
      self._monitor.join()
      self._monitor = None
    proc = self._proc
    if proc is None or proc.poll() is not None:
      return
    proc.send_signal(signal.SIGTERM if checkpoint else signal.SIGKILL)
    try:
      proc.wait(timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
    self.last_exit = proc.returncode


class WeightsWatcher:
  """Loads each version the trainer process announces into the engine (a daemon thread)."""

  def __init__(self, supervisor: TrainerProcess, receiver, engine, poll_s: float):
    self.supervisor, self.receiver, self.engine, self.poll_s = supervisor, receiver, engine, poll_s
    self.swaps, self.error = 0, None
    self._requested: int | None = None  # handed to the engine, maybe not applied yet
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="serve-weights-watcher", daemon=True)

  def start(self) -> None:
    self._thread.start()

  def poll(self) -> bool:
    """Swaps to the announced version if it differs from the engine's; True if it did."""
    st = self.supervisor.status()
    v = None if st is None else st.get("published")
    if v is None or v in (self.engine.version, self._requested) or v not in self.receiver.versions():
      return False
    params = self.receiver.fetch(v)
    self.engine.update_params(params, v)
    self._requested = v
    self.swaps += 1
    return True

  def _run(self) -> None:
    while not self._stop.wait(self.poll_s):
      try:
        self.poll()
        self.error = None
      except Exception as e:  # pylint: disable=broad-except  (deleted by retention, ...: next poll)
        self.error = f"{type(e).__name__}: {e}"
        log.warning("weights watcher: %s", self.error)

  def stop(self) -> None:
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join()
