"""N worker processes connected to this one: the same command to all, every reply checked.

The transport of ``learner_group.LearnerGroup``. This process listens (authenticated
``multiprocessing.connection``); it either starts the workers itself with ``subprocess`` (``spawn``)
or waits for workers started elsewhere (``address`` "host:port" and a shared key in
``AREAL_JAX_LEARNER_AUTHKEY``). A worker first sends ``("hello", process_id, pid)``, then answers
each ``(cmd, args)`` with ``("ok", value)`` or ``("error", type names, message, traceback)``
(:func:`error_reply`: the names of the exception's class and its bases, or one name, and its
traceback text), which the driver re-raises under the first type it knows (``errors.remote_error``).

A worker that exits or breaks its connection while a command runs stops the whole group (the
others may be blocked in a collective with it) and raises ``LearnerProcessDied``.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import subprocess
import time
from collections.abc import Callable
from multiprocessing.connection import Listener, wait as wait_ready

from areal_jax.runtime import errors
from areal_jax.runtime.errors import LearnerProcessDied

AUTHKEY_ENV = "AREAL_JAX_LEARNER_AUTHKEY"


class ProcessGroup:
  """``spawn(i, driver_address, key) -> (argv, env)`` starts worker ``i`` here (its output in
  ``<logs>/process_<i>.log``, the pids in ``<logs>/../learner_processes.json``); with ``address``
  the workers are started by someone else and connect to it."""

  def __init__(self, n: int, logs: str, spawn: Callable | None = None, address: str = "",
               start_timeout_s: float = 300.0):
    self.n, self.logs = n, logs
    self._procs: list[subprocess.Popen] = []
    self._conns: list = []
    self.closed = False
    atexit.register(self.kill)
    try:
      if address:
        key = os.environ.get(AUTHKEY_ENV, "")
        if not key:
          raise ValueError(f"runtime.learner_address={address!r} needs {AUTHKEY_ENV} (hex; the "
                           "same for the driver and every learner process)")
        listener = Listener(host_port(address), authkey=bytes.fromhex(key))
        print(f"waiting for {n} learner processes to connect to {address}", flush=True)
      else:
        key = secrets.token_bytes(16).hex()
        listener = Listener(("127.0.0.1", 0), authkey=bytes.fromhex(key))
        self._spawn(spawn, listener.address, key)
      self._accept(listener, start_timeout_s)
    except BaseException:
      self.kill()
      raise

  def _spawn(self, spawn, address, key: str) -> None:
    os.makedirs(self.logs, exist_ok=True)
    for i in range(self.n):
      argv, env = spawn(i, f"{address[0]}:{address[1]}", key)
      with open(os.path.join(self.logs, f"process_{i}.log"), "ab") as log:
        self._procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL))
    pids = [dict(process_id=i, pid=p.pid) for i, p in enumerate(self._procs)]
    path = os.path.join(os.path.dirname(self.logs), "learner_processes.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      json.dump(pids, f)
    os.replace(path + ".tmp", path)

  def _accept(self, listener, timeout_s: float) -> None:
    """The N connections (each says hello with its process id first), watching the processes."""
    conns: dict[int, object] = {}
    listener._listener._socket.settimeout(1.0)  # pylint: disable=protected-access
    deadline = time.time() + timeout_s
    try:
      while len(conns) < self.n:
        self._check_alive()
        if time.time() > deadline:
          raise TimeoutError(f"the learner group did not connect within {timeout_s:.0f} s "
                             f"({len(conns)}/{self.n} processes; logs in {self.logs})")
        try:
          conn = listener.accept()
        except (TimeoutError, OSError):
          continue
        while not conn.poll(1.0):
          self._check_alive()
        _, pid_index, _ = conn.recv()
        if not 0 <= pid_index < self.n or pid_index in conns:
          conn.close()
          raise ValueError(f"a learner process connected as process {pid_index}: expected each "
                           f"of 0..{self.n - 1} once (runtime.learner_processes={self.n})")
        conns[pid_index] = conn
    except BaseException:
      for conn in conns.values():  # the workers that did connect see EOF and exit
        conn.close()
      raise
    finally:
      listener.close()
    self._conns = [conns[i] for i in range(self.n)]

  def _check_alive(self) -> None:
    for i, p in enumerate(self._procs):
      if p.poll() is not None:
        self._died(i, f"exited with status {p.returncode}")

  def _died(self, i: int, why: str):
    try:  # a broken connection is usually a dead process: name its exit status
      if i < len(self._procs):
        why = f"exited with status {self._procs[i].wait(timeout=2)}"
    except subprocess.TimeoutExpired:
      pass
    self.kill()
    where = ""
    if i < len(self._procs):  # started here: its log's last lines
      log = os.path.join(self.logs, f"process_{i}.log")
      where = f" (log: {log})"
      try:
        with open(log, encoding="utf-8", errors="replace") as f:
          where += "\n" + "".join(f.readlines()[-5:]).rstrip()
      except OSError:
        pass
    raise LearnerProcessDied(f"learner process {i} {why}; the group was stopped{where}".rstrip())

  def call(self, cmd: str, *args):
    """Sends ``cmd`` to every process and returns process 0's value (all must succeed)."""
    if self.closed:
      raise RuntimeError(f"learner group is closed (cannot {cmd})")
    for i, conn in enumerate(self._conns):
      try:
        conn.send((cmd, args))
      except OSError as e:
        self._died(i, f"could not be reached ({e})")
    replies: dict[int, tuple] = {}
    index = {id(c): i for i, c in enumerate(self._conns)}
    while len(replies) < self.n:
      for conn in wait_ready([c for i, c in enumerate(self._conns) if i not in replies], 0.5):
        i = index[id(conn)]
        try:
          replies[i] = conn.recv()
        except (EOFError, OSError):
          self._died(i, "closed its connection")
      self._check_alive()
    for i in range(self.n):
      if replies[i][0] == "error":
        raise errors.remote_error(f"learner process {i}", *replies[i][1:])
    return replies[0][1]

  def kill(self) -> None:
    """Stops every process now (no clean shutdown)."""
    self.closed = True
    for p in self._procs:
      if p.poll() is None:
        p.kill()
    for p in self._procs:
      p.wait()
    for c in self._conns:
      c.close()
    self._conns = []

  def close(self) -> None:
    """Sends ``close`` (the workers finish their work and exit), then kills what does not exit."""
    if self.closed:
      return
    try:
      self.call("close")
      for p in self._procs:
        p.wait(timeout=60)
    except (LearnerProcessDied, subprocess.TimeoutExpired):
      pass
    finally:
      self.kill()
      atexit.unregister(self.kill)


def error_reply(error: Exception) -> tuple:
  """A worker's reply for ``error``, raised by the command it ran (call it in the ``except``)."""
  return ("error", *errors.error_fields(error))


def host_port(address: str) -> tuple[str, int]:
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"runtime.learner_address={address!r} is not host:port")
  return host, int(port)
