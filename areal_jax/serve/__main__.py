r"""Serves the policy over an OpenAI-compatible API and learns from the conversations.

  python -m areal_jax.serve --config=configs/serve_arithmetic.py --workdir=runs/serve
  python -m areal_jax.serve --config=configs/serve_arithmetic.py:tiny --workdir=/tmp/serve_tiny \
      --config.serve.port=8001

Runs until SIGINT/SIGTERM; then the trainer checkpoints and everything stops. Restarting with the
same workdir resumes: turns from ``<workdir>/turns.sqlite``, the policy from its newest checkpoint.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from absl import app, flags
from ml_collections import config_flags

from areal_jax import config as config_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "Serving config file (preset after ':').")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the turn store, checkpoints and metrics live.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv) -> None:
  del argv
  # serve.trainer_process: this process keeps the server's cores, pinned before JAX is imported
  # (XLA's CPU thread pool then spans only them); the trainer process pins itself to the rest.
  from areal_jax.runtime.ray_worker import pin_process  # pylint: disable=import-outside-toplevel
  from areal_jax.serve.trainer_supervisor import plan_cores  # pylint: disable=import-outside-toplevel

  cores = plan_cores(_CONFIG.value)
  if cores is not None:
    if "jax" in sys.modules:
      raise RuntimeError("JAX was imported before the server pinned its cores")
    pin_process(cores[0])
    print(f"server on cores {cores[0]}, trainer process on cores {cores[1]}", flush=True)
  from areal_jax import cli  # pylint: disable=import-outside-toplevel
  from areal_jax.serve.runtime import ServeRuntime  # pylint: disable=import-outside-toplevel

  cli.set_up_logging(logging.INFO)  # the engine's warm-up, the plan and the trainer's versions
  # a memory plan that cannot fit, a model that is not there, settings that contradict each
  # other: one line naming what to change (areal_jax.cli)
  # SIGTERM while starting (warm-up, the trainer process restoring) interrupts like Ctrl-C: what
  # started is stopped (runtime.start), nothing was served yet
  signal.signal(signal.SIGTERM, signal.default_int_handler)
  done, started = threading.Event(), False
  try:
    with cli.reported_faults():
      runtime = ServeRuntime(_CONFIG.value, _WORKDIR.value, cores=cores)
      runtime.start()  # (its trainer process's faults too)
    started = True
    for sig in (signal.SIGINT, signal.SIGTERM):
      signal.signal(sig, lambda *_: done.set())
  except KeyboardInterrupt:
    if started:  # (a signal just before the handlers were in place)
      runtime.stop()
    print("interrupted while starting; stopped", file=sys.stderr, flush=True)
    sys.exit(130)
  while not done.wait(1.0):
    pass
  print("stopping: the trainer checkpoints, then the server and the engine stop", flush=True)
  runtime.stop()


if __name__ == "__main__":
  config_lib.check_overrides(sys.argv)
  app.run(main)
