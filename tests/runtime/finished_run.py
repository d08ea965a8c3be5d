"""One finished 3-step tiny run with checkpoints 1, 2 and 3, run once per test process and shared
by the modules that damage copies of it (test_checkpoint.py, test_run_output.py; this directory is
on sys.path: see the importers). Tests copy it before touching it, never change it in place."""

from test_trainer import tiny_config

STEPS, ETA = 3, 1
RUN = {"train.total_steps": STEPS, "train.checkpoint_every": 1, "train.keep_checkpoints": 3,
       "train.dump_trajectories": True, "rollout.max_head_offpolicyness": ETA,
       "rollout.max_new_tokens": 16}

_WORKDIR = []


def workdir(tmp_path_factory):
  """The run's directory (``tiny_config(**RUN)``), run on the first call."""
  if not _WORKDIR:
    from areal_jax.runtime import trainer

    path = tmp_path_factory.mktemp("tiny_run")
    trainer.run(tiny_config(**RUN), str(path))
    _WORKDIR.append(path)
  return _WORKDIR[0]
