"""The learner as a group of ``runtime.learner_processes`` processes joined by ``jax.distributed``.

The driver (the training process: rollout controller, staleness queue, sampler) keeps everything
that decides *what* is trained; the group only executes. ``LearnerGroup`` duck-types what
``trainer.run`` uses of ``Learner``: ``train_step(groups, rewards)`` (every process runs it on the
same batch; process 0's metrics come back), ``version``, ``state`` / ``load_state`` (a token: the
state stays in the group), ``params()`` (a token for ``transfer``), and gives the two objects the
trainer builds around a learner: ``checkpointer()`` (the run checkpoint, saved and restored by all
processes through Orbax, with the driver's meta) and ``transfer(...)`` (each version published by
the group as an Orbax weights version, ``weights.transfer="orbax"``, and restored by the driver
straight onto the sampler mesh: the driver never gathers the full weights).

Processes: the driver listens (authenticated ``multiprocessing.connection``) for the workers
(``learner_worker.py``). By default it listens on 127.0.0.1 and starts them itself with
``subprocess``, each with ``mesh.learner_devices / learner_processes`` devices of its own (fake CPU
devices on a CPU host, ``JAX_LOCAL_DEVICE_IDS`` otherwise); their logs go to
``<workdir>/learner_logs/process_<i>.log`` and their pids to ``<workdir>/learner_processes.json``.
With ``runtime.learner_address="host:port"`` (several hosts) it listens there and waits for the
workers the cluster's launcher starts, one per host, with the same ``AREAL_JAX_LEARNER_AUTHKEY``:

  python -m areal_jax.runtime.learner_worker --driver=<driver host:port> \
      --coordinator=<host of process 0>:<free port> --process_id=<i> --num_processes=<N>

(in a loop, so that a restarted driver finds them again: a worker exits when its driver goes).

Faults: when a worker exits or its connection breaks during a call, the whole group is killed and
:class:`LearnerProcessDied` is raised; the training process then exits with
``RESTART_EXIT_CODE`` and the supervisor (``supervisor.py``) reruns it, resuming from the last
checkpoint (see launch.py).
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import subprocess
import sys
import time
from multiprocessing.connection import Listener, wait as wait_ready

import jax

from areal_jax.runtime import checkpoint, distributed, learner_worker, weight_transfer
from areal_jax.runtime.errors import LearnerProcessDied, RunDirError

_ERRORS = {c.__name__: c for c in (FloatingPointError, ValueError, MemoryError, TypeError,
                                   RunDirError, LookupError)}
REMOTE_STATE = "<learner state held by the learner group>"


class RemoteParams:
  """``LearnerGroup.params()``: names the group's current parameters without holding them."""

  def __init__(self, group: "LearnerGroup"):
    self.group = group


def check_config(config) -> int:
  """The number of learner processes, after checking the keys a group depends on."""
  n = int(config.runtime.learner_processes)
  errors = []
  if n < 1:
    errors.append(f"runtime.learner_processes={n} must be >= 1")
  elif n > 1:
    if config.weights.transfer != "orbax":
      errors.append(f"runtime.learner_processes={n} needs weights.transfer='orbax' (the group "
                    f"publishes Orbax versions), got {config.weights.transfer!r}")
    if config.mesh.colocated:
      errors.append(f"runtime.learner_processes={n} needs mesh.colocated=False (the learner's "
                    "devices belong to its processes)")
    if config.mesh.learner_devices % n:
      errors.append(f"mesh.learner_devices={config.mesh.learner_devices} is not divisible by "
                    f"runtime.learner_processes={n}")
    if config.runtime.learner_address:
      _host_port(config.runtime.learner_address)
    if config.actor.lora.rank:
      errors.append(f"runtime.learner_processes={n} does not support actor.lora yet (set "
                    "actor.lora.rank=0 or runtime.learner_processes=1)")
  if errors:
    raise ValueError("; ".join(errors))
  return n


class LearnerGroup:
  """Starts the group and builds its ``Learner``; see the module docstring."""

  def __init__(self, config, workdir: str, start_timeout_s: float = 300.0):
    self.n = check_config(config)
    self.workdir = os.path.abspath(workdir)
    self.lora = None
    self._procs: list[subprocess.Popen] = []
    self._conns: list = []
    self._closed = False
    ckpt_dir = os.path.join(self.workdir, "checkpoints")
    if not config.train.resume and os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
      old = checkpoint.move_aside(ckpt_dir, f".old-{checkpoint.utc_tag()}")
      print(f"train.resume=False: the previous checkpoints were moved to {old}", flush=True)
    atexit.register(self.kill)
    try:
      self._start(config, start_timeout_s)
      info = self._call("init", config, self.workdir)
    except BaseException:
      self.kill()
      raise
    self._version = info["version"]
    self.num_params = info["num_params"]

  # ---- processes ---------------------------------------------------------------------------------
  def _start(self, config, timeout_s: float) -> None:
    logs = os.path.join(self.workdir, "learner_logs")
    address = config.runtime.learner_address
    if address:  # the processes are started on their hosts by someone else
      key = os.environ.get(learner_worker.AUTHKEY_ENV, "")
      if not key:
        raise ValueError(f"runtime.learner_address={address!r} needs {learner_worker.AUTHKEY_ENV} "
                         "(hex; the same for the driver and every learner process)")
      host, port = _host_port(address)
      listener = Listener((host, port), authkey=bytes.fromhex(key))
      print(f"waiting for {self.n} learner processes to connect to {address}", flush=True)
    else:
      key = secrets.token_bytes(16).hex()
      listener = Listener(("127.0.0.1", 0), authkey=bytes.fromhex(key))
      self._spawn(config, listener.address, key, logs)
    self._accept(listener, timeout_s, logs)

  def _spawn(self, config, address, key: str, logs: str) -> None:
    coordinator = f"127.0.0.1:{distributed.free_port()}"
    per = config.mesh.learner_devices // self.n
    os.makedirs(logs, exist_ok=True)
    host, port = address
    for i in range(self.n):
      env = dict(os.environ, **{learner_worker.AUTHKEY_ENV: key})
      if jax.default_backend() == "cpu":
        env.update(distributed.local_device_count_env(per))
      else:
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(d) for d in range(i * per, (i + 1) * per))
      with open(os.path.join(logs, f"process_{i}.log"), "ab") as log:
        self._procs.append(subprocess.Popen(
            [sys.executable, "-m", "areal_jax.runtime.learner_worker", f"--driver={host}:{port}",
             f"--coordinator={coordinator}", f"--process_id={i}", f"--num_processes={self.n}"],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    pids = [dict(process_id=i, pid=p.pid) for i, p in enumerate(self._procs)]
    tmp = os.path.join(self.workdir, "learner_processes.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(pids, f)
    os.replace(tmp, os.path.join(self.workdir, "learner_processes.json"))

  def _accept(self, listener, timeout_s: float, logs: str) -> None:
    """The N connections (each says hello with its process id first), watching the processes."""
    conns: dict[int, object] = {}
    listener._listener._socket.settimeout(1.0)  # pylint: disable=protected-access
    deadline = time.time() + timeout_s
    try:
      while len(conns) < self.n:
        self._check_alive()
        if time.time() > deadline:
          raise TimeoutError(f"the learner group did not connect within {timeout_s:.0f} s "
                             f"({len(conns)}/{self.n} processes; logs in {logs})")
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
    log = os.path.join(self.workdir, "learner_logs", f"process_{i}.log")
    tail = ""
    try:
      with open(log, encoding="utf-8", errors="replace") as f:
        tail = "".join(f.readlines()[-5:]).rstrip()
    except OSError:
      pass
    raise LearnerProcessDied(f"learner process {i} {why}; the group was stopped (log: {log})"
                             + (f"\n{tail}" if tail else ""))

  def _call(self, cmd: str, *args):
    """Sends ``cmd`` to every process and returns process 0's value (all must succeed)."""
    if self._closed:
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
        _, name, message = replies[i]
        raise _ERRORS.get(name, RuntimeError)(f"learner process {i}: {name}: {message}")
    return replies[0][1]

  def kill(self) -> None:
    """Stops every process now (no clean shutdown)."""
    self._closed = True
    for p in self._procs:
      if p.poll() is None:
        p.kill()
    for p in self._procs:
      p.wait()
    for c in self._conns:
      c.close()
    self._conns = []

  def close(self) -> None:
    """Flushes pending publishes, shuts the group down cleanly (kills what does not exit)."""
    if self._closed:
      return
    try:
      self._call("close")
      for p in self._procs:
        p.wait(timeout=60)
    except (LearnerProcessDied, subprocess.TimeoutExpired):
      pass
    finally:
      self.kill()
      atexit.unregister(self.kill)

  # ---- what the trainer uses of a Learner ---------------------------------------------------------
  def train_step(self, groups, rewards) -> dict:
    metrics = self._call("train_step", groups, rewards)
    self._version += 1
    return metrics

  @property
  def version(self) -> int:
    return self._version

  @property
  def state(self):
    return REMOTE_STATE

  def load_state(self, state) -> None:
    if state is not REMOTE_STATE:
      raise TypeError("LearnerGroup.load_state: the group restores its own state "
                      "(checkpointer().restore_latest)")

  def params(self) -> RemoteParams:
    return RemoteParams(self)

  def checkpointer(self) -> "GroupCheckpointer":
    return GroupCheckpointer(self)

  def transfer(self, weights, model, sampler_mesh) -> "GroupTransfer":
    path = weights.path or os.path.join(self.workdir, "weights")
    shardings = weight_transfer.target_shardings(model, sampler_mesh)
    return GroupTransfer(self, weight_transfer.OrbaxReceiver(
        path, weight_transfer.abstract_params(model, shardings)))


def _host_port(address: str) -> tuple[str, int]:
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"runtime.learner_address={address!r} is not host:port")
  return host, int(port)


class GroupCheckpointer:
  """The run checkpoint (``checkpoint.Checkpointer``'s interface) written by the group's processes."""

  def __init__(self, group: LearnerGroup):
    self.group = group
    self.directory = os.path.join(group.workdir, "checkpoints")

  def latest_step(self) -> int | None:
    return self.group._call("latest_step")  # pylint: disable=protected-access

  def save(self, step: int, state, meta: dict) -> None:
    self.group.load_state(state)  # checks that it is the group's own state
    self.group._call("save", step, meta)  # pylint: disable=protected-access

  def restore_latest(self, abstract_state=None):
    del abstract_state  # the processes restore onto their own mesh
    found = self.group._call("restore")  # pylint: disable=protected-access
    if found is None:
      return None
    step, meta = found
    self.group._version = int(step)  # pylint: disable=protected-access
    return step, REMOTE_STATE, meta

  def close(self) -> None:
    self.group.close()


class GroupTransfer:
  """``weights.transfer="orbax"`` across processes: the group writes, the driver reads."""

  mode = "orbax"
  colocated = False

  def __init__(self, group: LearnerGroup, receiver: weight_transfer.OrbaxReceiver):
    self.group, self.receiver = group, receiver
    self.last_publish_s = self.last_fetch_s = 0.0

  def send(self, params: RemoteParams, version: int) -> dict:
    """Publishes ``version`` from the group (each process blocked only for its device-to-host
    copy, then for the write to finish), and restores it onto the sampler mesh."""
    if not isinstance(params, RemoteParams) or params.group is not self.group:
      raise TypeError("GroupTransfer.send publishes the group's own parameters (group.params())")
    t0 = time.perf_counter()
    self.group._call("publish", version)  # pylint: disable=protected-access
    self.last_publish_s = time.perf_counter() - t0
    self.group._call("wait_published")  # pylint: disable=protected-access
    out = self.receiver.fetch(version)
    self.last_fetch_s = self.receiver.last_fetch_s
    return out

  def close(self) -> None:
    self.receiver.close()
