"""The Ray cluster of a ``runtime.mode="ray"`` run: joining or starting it, and sharing out cores.

``session(config.runtime)`` wraps a run: it joins the cluster named by ``runtime.ray_address`` or
starts a local one, and always shuts Ray down (and restores the process's CPU affinity) at the end.
``plan_cores`` splits this machine's cores between the learner and the rollout workers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from areal_jax import cli
from areal_jax.runtime import ray_worker


def plan_cores(n_workers: int, learner_cores: int = 0, available=None):
  """``(learner_cores, [worker_cores, ...])`` over the cores this process may use, or ``None`` when
  there are too few to give every side at least one core of its own."""
  cores = sorted(os.sched_getaffinity(0) if available is None else available)
  if learner_cores < 0:
    raise ValueError(f"runtime.learner_cores={learner_cores} must be >= 0 (0: an equal share)")
  share = (len(cores) // (n_workers + 1) if learner_cores == 0
           else (len(cores) - learner_cores) // max(n_workers, 1))
  if share < 1:
    return None
  n_learner = len(cores) - n_workers * share
  workers = [cores[n_learner + i * share:n_learner + (i + 1) * share] for i in range(n_workers)]
  return cores[:n_learner], workers


@contextlib.contextmanager
def session(runtime):
  """Connects to Ray for the duration of a run in ray mode (a no-op in local mode).

  ``runtime.ray_address`` "" starts a local cluster (no dashboard, a temporary directory); otherwise
  it joins that cluster. Ray is shut down on the way out, error or not; the process affinity (which
  ``build`` narrows to the learner's cores) is restored.
  """
  if runtime.mode != "ray":
    yield
    return
  import ray  # pylint: disable=import-outside-toplevel

  affinity = os.sched_getaffinity(0)
  started = not ray.is_initialized()
  tmp = None
  if started:  # Ray's own INFO lines (starting, connecting) only when --verbosity asks
    if runtime.ray_address:
      ray.init(address=runtime.ray_address, log_to_driver=True, logging_level=cli.library_level())
    else:
      tmp = tempfile.mkdtemp(prefix="ray_")
      ray.init(num_cpus=len(affinity), include_dashboard=False, _temp_dir=tmp,
               object_store_memory=256 * 2**20, log_to_driver=True,
               logging_level=cli.library_level())
  try:
    yield
  finally:
    if started:
      ray.shutdown()
    if tmp is not None:  # the local cluster's sockets and logs
      shutil.rmtree(tmp, ignore_errors=True)
    ray_worker.pin_process(affinity)
