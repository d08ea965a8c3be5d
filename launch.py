"""Trains a policy with asynchronous RL.

  python launch.py --config=configs/gsm8k.py:tiny --workdir=/tmp/run
  python launch.py --config=configs/gsm8k.py --workdir=gs://bucket/run --config.actor.lr=1e-6

Rerunning the same command resumes from the latest usable checkpoint in --workdir (damaged ones are
moved aside); expected faults (no usable checkpoint, a failed save) print a short message without a
traceback unless --verbosity=1.
With --config.runtime.learner_processes=N (> 1) the learner runs as N processes joined by
jax.distributed (weights.transfer=orbax) under a supervisor that restarts the run from its last
checkpoint when a learner process dies (runtime.max_learner_restarts; areal_jax/runtime/supervisor.py):
  python launch.py --config=configs/gsm8k.py:tiny --workdir=/tmp/run --config.weights.transfer=orbax \
      --config.runtime.learner_processes=2 --config.mesh.learner_devices=2
With --config.runtime.mode=ray the rollout engines run in Ray actors (rollout.workers of them): a
local Ray cluster is started for the run (stopped at its end) unless --config.runtime.ray_address
names one to join; see launch/README.md for GPU hosts and TPU pod slices.
The same run can be started from Python: ``areal_jax.runtime.trainer.run(config, workdir)``.
"""

import os
import sys

# On a CPU-only host, expose 8 virtual devices so the learner and sampler meshes can be split as on
# an accelerator host (ignored by TPU/GPU backends). Set XLA_FLAGS yourself to override.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from areal_jax import config as config_lib  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "path/to/config.py[:preset]")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and logs go here.")
flags.mark_flags_as_required(["config", "workdir"])


def _compile_cache(config) -> None:
  """JAX's persistent compilation cache in ``runtime.compile_cache_dir`` for this process and the
  ones it starts (learner processes, a local Ray cluster's workers inherit the variable): a rerun
  or resume loads its programs instead of compiling them, and on GPU XLA keeps its matmul
  autotuning results there per fusion, so the sampler's many decode variants (kv buckets, widths)
  autotune each matmul once. A $JAX_COMPILATION_CACHE_DIR already set wins."""
  if config.runtime.compile_cache_dir and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.expanduser(config.runtime.compile_cache_dir)
    if "jax" in sys.modules:  # imported already (a config file that imports it): tell it too
      sys.modules["jax"].config.update("jax_compilation_cache_dir",
                                       os.environ["JAX_COMPILATION_CACHE_DIR"])


def main(argv):
  del argv
  from areal_jax import cli  # no JAX import
  from areal_jax.runtime import supervisor  # no JAX import

  cli.set_up_logging()  # the run's own lines are prints; Orbax logs every save at INFO

  config = _CONFIG.value
  _compile_cache(config)  # before JAX is imported
  if config.runtime.learner_processes > 1 and not supervisor.is_child():
    # A learner group: a supervisor reruns the training process (which resumes from its last
    # checkpoint) when a learner process dies, up to runtime.max_learner_restarts times.
    sys.exit(supervisor.supervise([sys.executable, *sys.argv], config.runtime.max_learner_restarts))
  from areal_jax.runtime import trainer  # imports JAX after flags are parsed
  from areal_jax.runtime.errors import RESTART_EXIT_CODE, LearnerProcessDied

  try:
    # Faults of what was given (settings, model files, task data, the run directory, a memory
    # plan that cannot fit): one line that says what to change (areal_jax.cli).
    with cli.reported_faults(quiet_exit=True):
      trainer.run(config, _WORKDIR.value)
  except LearnerProcessDied as e:  # the group is already stopped; the supervisor restarts the run
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(RESTART_EXIT_CODE)


if __name__ == "__main__":
  config_lib.check_overrides(sys.argv)
  app.run(main)
