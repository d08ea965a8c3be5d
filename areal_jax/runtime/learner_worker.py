"""One process of the learner group: ``python -m areal_jax.runtime.learner_worker``.

The driver (``learner_group.LearnerGroup``) listens on ``--driver``; each worker connects, joins
the other workers with ``jax.distributed`` (process 0 serves ``--coordinator``), builds the
``Learner`` on the mesh spanning the whole group and then executes the driver's commands, the same
command on every process (multi-controller SPMD): ``train_step`` on the same batch, ``save`` /
``restore`` of the run checkpoint and ``publish`` of a weights version through Orbax, every process
writing or reading its own shards. Replies are ``("ok", value)`` or
``("error", type names, message, traceback)`` (``process_group.error_reply``).

Started by the driver on its own host; on other hosts start it by hand (or by the cluster's
launcher) with the same arguments and ``AREAL_JAX_LEARNER_AUTHKEY`` set to the driver's key.
The worker exits when the driver closes the connection or dies, and ignores SIGINT (the driver
decides when the group stops).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from multiprocessing.connection import Client

from areal_jax.runtime import process_group
from areal_jax.runtime.process_group import AUTHKEY_ENV


class _Worker:

  def __init__(self, config, workdir: str):
    from areal_jax import learner as learner_lib  # noqa: PLC0415 (after jax.distributed)
    from areal_jax.learner import memory
    from areal_jax.runtime import checkpoint, distributed, model_source, weight_transfer
    from jax.experimental import multihost_utils

    c_roll, c_act = config.rollout, config.actor
    mesh = distributed.learner_mesh(config.mesh)
    model, _ = model_source.load(config)
    self.learner = learner_lib.Learner(
        model, c_act, mesh, temperature=c_roll.temperature, total_steps=config.train.total_steps,
        max_seq_len=c_roll.max_prompt_len + c_roll.max_new_tokens)
    memory.fit(self.learner, config.mesh, publish=weight_transfer.version_caster(config))
    # every process must run the same program: a host with less memory must not plan alone
    multihost_utils.assert_equal(c_act.micro_batch_tokens, "actor.micro_batch_tokens differs between "
                                 "learner processes (their devices report different memory)")
    # The driver already moved old checkpoints aside when train.resume=False.
    self.ckpt = checkpoint.Checkpointer.of_run(workdir, config, resume=True)
    path = config.weights.path or os.path.join(workdir, "weights")
    self.publisher = weight_transfer.OrbaxPublisher(path, config.weights.keep,
                                                    weight_transfer.version_dtype(config))

  def train_step(self, groups, rewards):
    return self.learner.train_step(groups, rewards)

  def version(self):
    return self.learner.version

  def restore(self):
    found = self.ckpt.restore_latest(self.learner.abstract_state())
    if found is None:
      return None
    step, state, meta = found
    self.learner.load_state(state)
    return step, meta

  def save(self, step, meta):
    self.ckpt.save(step, self.learner.state, meta)
    return self.ckpt.latest_step()

  def latest_step(self):
    return self.ckpt.latest_step()

  def publish(self, version):
    """Starts the Orbax save of ``version``; blocks only for the copy out of device memory."""
    return self.publisher.publish(self.learner.params(), version, wait=False)

  def wait_published(self):
    return self.publisher.wait()

  def close(self):
    self.publisher.close()
    self.ckpt.close()


def serve(conn, process_id: int, num_processes: int, coordinator: str) -> None:
  conn.send(("hello", process_id, os.getpid()))  # before joining: the driver accepts the others
  from areal_jax.runtime import distributed  # noqa: PLC0415 (imports jax)

  distributed.initialize(coordinator, num_processes, process_id)
  import jax  # noqa: PLC0415

  worker = None
  while True:
    try:
      cmd, args = conn.recv()
    except (EOFError, OSError):  # the driver is gone: nothing left to do
      return
    try:
      if cmd == "init":
        worker = _Worker(*args)
        value = dict(version=worker.learner.version, num_params=worker.learner.num_params,
                     devices=jax.device_count())
      elif cmd == "close":
        if worker is not None:
          worker.close()
        jax.distributed.shutdown()
        conn.send(("ok", None))
        return
      else:
        value = getattr(worker, cmd)(*args)
      reply = ("ok", value)
    except Exception as e:  # pylint: disable=broad-except  (reported to the driver, which raises)
      reply = process_group.error_reply(e)
    conn.send(reply)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--driver", required=True, help="host:port the driver listens on")
  p.add_argument("--coordinator", required=True, help="host:port of process 0's coordinator")
  p.add_argument("--process_id", type=int, required=True)
  p.add_argument("--num_processes", type=int, required=True)
  p.add_argument("--connect_timeout_s", type=float, default=600.0)
  a = p.parse_args(argv)
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  key = os.environ.get(AUTHKEY_ENV)
  if not key:
    sys.exit(f"error: {AUTHKEY_ENV} is not set (the driver's key for the learner connection)")
  host, port = a.driver.rsplit(":", 1)
  deadline = time.time() + a.connect_timeout_s
  while True:  # the driver may not listen yet (it is starting, or restarting)
    try:
      conn = Client((host, int(port)), authkey=bytes.fromhex(key))
      break
    except ConnectionRefusedError:
      if time.time() > deadline:
        sys.exit(f"error: no driver listens on {a.driver} after {a.connect_timeout_s:.0f} s")
      time.sleep(1.0)
  with conn:
    serve(conn, a.process_id, a.num_processes, a.coordinator)


if __name__ == "__main__":
  main()
