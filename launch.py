"""Trains a policy with asynchronous RL.

  python launch.py --config=configs/gsm8k.py:tiny --workdir=/tmp/run
  python launch.py --config=configs/gsm8k.py --workdir=gs://bucket/run --config.actor.lr=1e-6

Rerunning the same command resumes from the latest checkpoint in --workdir.
The same run can be started from Python: ``areal_jax.runtime.trainer.run(config, workdir)``.
"""

import sys

from absl import app, flags
from ml_collections import config_flags

from areal_jax import config as config_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "path/to/config.py[:preset]")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and logs go here.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  from areal_jax.runtime import trainer  # imports JAX after flags are parsed

  trainer.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  config_lib.check_overrides(sys.argv)
  app.run(main)
