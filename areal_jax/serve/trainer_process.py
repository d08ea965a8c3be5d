r"""The trainer loop as its own process (``serve.trainer_process = True``), started by the server.

  python -m areal_jax.serve.trainer_process --workdir=runs/serve [--cores=1]

The server writes its config to ``<workdir>/trainer_config.pkl`` and starts this process (and starts
it again when it dies). It pins itself to ``--cores`` *before* JAX is imported (XLA's CPU thread pool
then spans only those cores), then runs the same ``TrainerLoop`` as the in-process mode (with ``serve.teacher_at = "trainer"``
the OPD teacher too, on this process's cores): judged turns from the SQLite store (WAL: the server writes while this process reads), the store's
exactly-once marks, checkpoints and resume (``restore`` rolls back marks of steps after the newest
checkpoint). Each version is written as Orbax weights (``<weights.path or workdir/weights>/<v>/``)
and announced in ``<workdir>/trainer_status.json`` (atomic), which the server's watcher reads; the
status also carries the loop's counters and error for ``/health``; a fault a person fixes (e.g. a
checkpoint saved with other settings) is written there with its type and traceback, and the
process exits with ``errors.FAULT_EXIT_CODE``: the server does not restart it.
SIGTERM/SIGINT (or the server dying: this process then has another parent): stop after the
current step and checkpoint; SIGKILL loses only the steps since the last checkpoint (redone on the
same turns after the restart, nothing trained twice).

``--bench=train|swap`` is for bench/serve.py only: train the first recorded batch back to back
(nothing marked, published or saved), or publish a new version every ``--swap_every_s``.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import sys
import threading
import time

from absl import app, flags

CONFIG_FILE = "trainer_config.pkl"
STATUS_FILE = "trainer_status.json"

FLAGS = flags.FLAGS


def _define_flags():  # only when run as a program (the server imports this module beside its flags)
  flags.DEFINE_string("workdir", None, "The server's workdir (config, store, checkpoints).")
  flags.DEFINE_list("cores", [], "CPU cores to pin this process to (before JAX is imported).")
  flags.DEFINE_enum("bench", None, ["train", "swap"], "bench/serve.py phases only.")
  flags.DEFINE_float("swap_every_s", 2.0, "--bench=swap: seconds between versions.")
  flags.mark_flags_as_required(["workdir"])


def weights_path(config, workdir: str) -> str:
  return config.weights.path or os.path.join(workdir, "weights")


def write_json(path: str, obj: dict) -> None:
  """Atomic: readers see the old or the new file, never a partial one."""
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f)
  os.replace(tmp, path)


def read_status(workdir: str) -> dict | None:
  try:
    with open(os.path.join(workdir, STATUS_FILE), encoding="utf-8") as f:
      return json.load(f)
  except (FileNotFoundError, json.JSONDecodeError):
    return None


def build_trainer(config, workdir: str, store, model, tokenizer, learner_mesh, transfer_fn,
                  engine=None):
  """The ``TrainerLoop`` both modes run: its learner on ``learner_mesh`` and ``transfer_fn(learner)``
  (the weight transfer: device_put/Orbax to an engine in this process, or an Orbax publisher), and
  with ``serve.teacher_at = "trainer"`` the OPD teacher on the same devices."""
  from areal_jax import learner as learner_lib  # pylint: disable=import-outside-toplevel
  from areal_jax.runtime.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  from areal_jax.serve import teacher as teacher_lib  # pylint: disable=import-outside-toplevel
  from areal_jax.serve.trainer_loop import TrainerLoop  # pylint: disable=import-outside-toplevel

  # the teacher's copy of the start weights, before the learner takes them
  teacher = teacher_lib.build(config, model, learner_mesh, tokenizer, at="trainer")
  c_roll = config.rollout
  # with hindsight OPD the batch carries the teacher's logprobs (or top k) of each token
  distill_topk = None if config.serve.signal == "binary" else config.serve.teacher_topk
  learner = learner_lib.Learner(model, config.actor, learner_mesh, temperature=c_roll.temperature,
                                total_steps=config.train.total_steps,
                                max_seq_len=c_roll.max_prompt_len + c_roll.max_new_tokens,
                                distill_topk=distill_topk)
  ckpt = Checkpointer.of_run(workdir, config, resume=config.train.resume)
  return TrainerLoop(config, workdir, store, learner, transfer_fn(learner), engine, ckpt, teacher)


def _bench(loop, mode: str, stop: threading.Event, status) -> None:
  from areal_jax.rollout_api import Sample  # pylint: disable=import-outside-toplevel

  learner, n = loop.learner, 0
  if mode == "train":
    rows = loop.store.first(loop.batch_size)
    batch = [[Sample(r["id"], 0, r["prompt_tokens"], r["completion_tokens"], r["logprobs"],
                     r["versions"], "eos")] for r in rows]
    adv = [[(-1.0) ** i] for i in range(len(batch))]
    learner.train_step(batch, adv)  # compiles before the phase starts
    status(ready=True)
    while not stop.is_set():
      t0 = time.time()
      status(ready=True, bench_steps=n, step_started=t0)
      learner.train_step(batch, adv)
      n += 1
      status(ready=True, bench_steps=n, step_started=None, last_step_s=time.time() - t0)
  else:
    version = learner.version
    while not stop.wait(FLAGS.swap_every_s):
      version += 1
      loop.transfer.publish(learner.params(), version)
      n += 1
      status(ready=True, published=version, bench_swaps=n)


def main(argv) -> None:
  del argv
  workdir = os.path.abspath(FLAGS.workdir)
  try:
    _main(workdir)
  except BaseException as e:
    from areal_jax.runtime import errors  # pylint: disable=import-outside-toplevel

    if not errors.is_fault(e):
      raise
    # a fault a person fixes (a checkpoint saved with other settings, a plan that cannot fit):
    # the server reads it here, does not restart this process, and names it
    types, message, trace = errors.error_fields(e)
    write_json(os.path.join(workdir, STATUS_FILE),
               dict(pid=os.getpid(), error=message, fault=dict(types=types, message=message,
                                                               traceback=trace)))
    sys.exit(errors.FAULT_EXIT_CODE)  # (the server prints it: this process's stderr is its)


def _main(workdir: str) -> None:
  if FLAGS.cores:
    from areal_jax.runtime.ray_worker import pin_process  # pylint: disable=import-outside-toplevel

    if "jax" in sys.modules:
      raise RuntimeError("JAX was imported in the trainer process before it was pinned")
    pin_process(int(c) for c in FLAGS.cores)
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: the server writes it before starting this process")
  with open(path, "rb") as f:
    config = pickle.load(f)

  from areal_jax import cli  # pylint: disable=import-outside-toplevel
  # pylint: disable-next=import-outside-toplevel  (imports JAX)
  from areal_jax.runtime import meshes, model_source, weight_transfer
  from areal_jax.serve.store import TurnStore  # pylint: disable=import-outside-toplevel

  cli.set_up_logging(logging.INFO)  # its versions trained; the libraries at WARNING
  stop = threading.Event()
  store = TurnStore(config.serve.db_path or os.path.join(workdir, "turns.sqlite"))
  learner_mesh, _ = meshes.build(config.mesh)
  model, tokenizer = model_source.load(config)
  publisher = lambda _: weight_transfer.OrbaxPublisher(weights_path(config, workdir), config.weights.keep,
                                                       weight_transfer.version_dtype(config))
  loop = build_trainer(config, workdir, store, model, tokenizer, learner_mesh, publisher)
  state = dict(pid=os.getpid(), started=time.time(), cores=sorted(os.sched_getaffinity(0)))

  def status(**kw) -> None:
    state.update(kw, version=loop.version, stats=dict(loop.stats), error=loop.error,
                 updated=time.time())
    write_json(os.path.join(workdir, STATUS_FILE), state)

  def on_signal(*_):
    stop.set()
    loop.request_stop()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, on_signal)
  parent = os.getppid()

  def orphaned():  # the server died (SIGKILL): stop like on SIGTERM, leave no process behind
    while not stop.wait(1.0):
      if os.getppid() != parent:
        on_signal()
  threading.Thread(target=orphaned, name="trainer-orphan-check", daemon=True).start()

  loop.restore()
  loop.publish()  # the restored version, announced before any step (the server swaps to it)
  status(published=loop.version)
  if FLAGS.bench:
    _bench(loop, FLAGS.bench, stop, status)
  else:
    loop.on_step = lambda: status(published=loop.version)
    loop.run()  # until SIGTERM: then checkpoints
  loop.transfer.close()
  loop.ckpt.close()
  status(stopped=True)
  if loop.error:
    sys.exit(1)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
