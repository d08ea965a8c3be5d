"""The learner as a group of ``runtime.learner_processes`` processes joined by ``jax.distributed``.

The driver (the training process: rollout controller, staleness queue, sampler) keeps everything
that decides *what* is trained; the group only executes. ``LearnerGroup`` duck-types what
``trainer.run`` uses of ``Learner``: ``train_step(groups, rewards)`` (every process runs it on the
same batch; process 0's metrics come back), ``version``, ``state`` / ``load_state`` (a token: the
state stays in the group), ``params()`` (a token for ``transfer``), and gives the two objects the
trainer builds around a learner: ``checkpointer()`` (the run checkpoint, saved and restored by all
processes through Orbax, with the driver's meta) and ``transfer(...)`` (each version published by
the group as an Orbax weights version, ``weights.transfer="orbax"``, and restored by the driver
straight onto the sampler mesh: the driver never gathers the full weights; with ``actor.lora``
a version is the adapters, which the sampler merges into its base). With
``runtime.mode="ray"`` the driver has no sampler: ``announcer()`` has the group publish each version,
and the rollout workers restore it from the same directory themselves.

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
checkpoint (see launch.py). A fault a person fixes raised in a worker (``errors.fault_kinds``: a
checkpoint saved with other settings, a memory plan that cannot fit) is raised by the driver under
its own type, naming the process, and is not restarted into.
"""

from __future__ import annotations

import os
import sys
import time

import jax

from areal_jax import config as config_lib
from areal_jax.models import lora as lora_lib
from areal_jax.runtime import checkpoint, distributed, process_group, weight_transfer
REMOTE_STATE = "<learner state held by the learner group>"


class RemoteParams:
  """``LearnerGroup.params()``: names the group's current parameters without holding them."""

  def __init__(self, group: "LearnerGroup"):
    self.group = group


def check_config(config) -> int:
  """The number of learner processes, after checking the keys a group depends on (ConfigError)."""
  errors = config_lib.learner_group_errors(config)
  if errors:
    raise config_lib.ConfigError("invalid config:\n  " + "\n  ".join(errors))
  return int(config.runtime.learner_processes)


class LearnerGroup:
  """Starts the group and builds its ``Learner``; see the module docstring."""

  def __init__(self, config, workdir: str, start_timeout_s: float = 300.0):
    self.n = check_config(config)
    self.workdir = os.path.abspath(workdir)
    self.lora = lora_lib.LoraConfig.from_config(config.actor.get("lora"))  # (adapters published)
    ckpt_dir = os.path.join(self.workdir, "checkpoints")
    if not config.train.resume and os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
      old = checkpoint.move_aside(ckpt_dir, f".old-{checkpoint.utc_tag()}")
      print(f"train.resume=False: the previous checkpoints were moved to {old}", flush=True)
    coordinator = f"127.0.0.1:{distributed.free_port()}"
    per = config.mesh.learner_devices // self.n

    def spawn(i, driver, key):
      env = dict(os.environ, **{process_group.AUTHKEY_ENV: key})
      if jax.default_backend() == "cpu":
        env.update(distributed.local_device_count_env(per))
      else:
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(d) for d in range(i * per, (i + 1) * per))
      return [sys.executable, "-m", "areal_jax.runtime.learner_worker", f"--driver={driver}",
              f"--coordinator={coordinator}", f"--process_id={i}",
              f"--num_processes={self.n}"], env

    self.processes = process_group.ProcessGroup(
        self.n, os.path.join(self.workdir, "learner_logs"), spawn, config.runtime.learner_address,
        start_timeout_s)
    try:
      info = self.call("init", config, self.workdir)
    except BaseException:
      self.processes.kill()
      raise
    self._version = info["version"]
    self.num_params = info["num_params"]

  def call(self, cmd: str, *args):
    """Runs ``cmd`` on every process (``learner_worker._Worker``); process 0's value."""
    return self.processes.call(cmd, *args)

  def kill(self) -> None:
    self.processes.kill()

  def close(self) -> None:
    """Flushes pending publishes and shuts the group down (kills what does not exit)."""
    self.processes.close()

  # ---- what the trainer uses of a Learner ---------------------------------------------------------
  def train_step(self, groups, rewards) -> dict:
    metrics = self.call("train_step", groups, rewards)
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

  def announcer(self) -> "GroupAnnouncer":
    return GroupAnnouncer(self)

  def transfer(self, weights, model, sampler_mesh, dtype=None) -> "GroupTransfer":
    """``dtype``: the processes' versions are cast to it (``weight_transfer.version_dtype``)."""
    path = weights.path or os.path.join(self.workdir, "weights")
    target = weight_transfer.version_target(model, sampler_mesh, self.lora, dtype)
    return GroupTransfer(self, weight_transfer.OrbaxReceiver(path, target))


class GroupCheckpointer:
  """The run checkpoint (``checkpoint.Checkpointer``'s interface) written by the group's processes."""

  def __init__(self, group: LearnerGroup):
    self.group = group
    self.directory = os.path.join(group.workdir, "checkpoints")

  def latest_step(self) -> int | None:
    return self.group.call("latest_step")

  def save(self, step: int, state, meta: dict) -> None:
    self.group.load_state(state)  # checks that it is the group's own state
    self.group.call("save", step, meta)

  def restore_latest(self, abstract_state=None):
    del abstract_state  # the processes restore onto their own mesh
    found = self.group.call("restore")
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
    self.group.call("publish", version)
    self.last_publish_s = time.perf_counter() - t0
    self.group.call("wait_published")
    out = self.receiver.fetch(version)
    self.last_fetch_s = self.receiver.last_fetch_s
    return out

  def close(self) -> None:
    self.receiver.close()


class GroupAnnouncer(weight_transfer.StorageAnnouncer):
  """``runtime.mode="ray"``: the group publishes each version as Orbax weights, which the rollout
  workers read themselves; the driver only announces the version (it never holds the weights).

  ``send`` returns once every process has copied its shards out of device memory; the write
  finishes in the background (the next ``publish`` or the group's ``close`` waits for it), and a
  worker loads the version once it is finalized.
  """

  def __init__(self, group: LearnerGroup):
    self.group = group
    self.last_publish_s = 0.0

  def send(self, params: RemoteParams, version: int) -> None:
    if not isinstance(params, RemoteParams) or params.group is not self.group:
      raise TypeError("GroupAnnouncer.send publishes the group's own parameters (group.params())")
    t0 = time.perf_counter()
    self.group.call("publish", version)
    self.last_publish_s = time.perf_counter() - t0

  def close(self) -> None:
    """Nothing to flush here: closing the group waits for its last publish."""
