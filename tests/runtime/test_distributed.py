"""The learner over 2 processes (jax.distributed, Gloo CPU collectives, 2 fake devices each) trains
to the same parameters as over 4 devices of one process."""

import json
import os
import pathlib
import sys

import jax
import numpy as np
import pytest

from areal_jax.learner import Learner
from areal_jax.runtime import distributed

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "learner")]
from learner_helpers import actor, batch, mesh, model  # noqa: E402
from processes import running  # noqa: E402


@pytest.mark.slow  # three processes start and compile (~50 s)
def test_two_processes_train_the_same_parameters_as_one(tmp_path):
  out = str(tmp_path / "params.npz")
  coordinator = f"127.0.0.1:{distributed.free_port()}"
  env = dict(os.environ)  # (the worker sets its own device count)
  with running(([sys.executable, str(HERE / "distributed_worker.py"), str(i), "2", coordinator,
                 out] for i in range(2)), env=env) as procs:
    # the reference meanwhile: one process, the same 4-device FSDP mesh, batch and step
    one = Learner(model(), actor(ppo_n_minibatches=2), mesh(4))
    m1 = one.train_step(*batch(1, groups=4, n=4))
    logs = [p.communicate(timeout=240)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], "\n".join(l[-3000:] for l in logs)
  got = np.load(out)
  want = {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(one.params())}
  assert sorted(got.files) == sorted(want)
  diff = max(float(np.max(np.abs(got[k] - w))) for k, w in want.items())
  print(f"2 processes vs 1: max |param difference| after one step = {diff:.3g}")
  for k, w in want.items():
    # the same 4-device layout: only the collectives' implementation differs (measured: 3e-8)
    np.testing.assert_allclose(got[k], w, rtol=1e-5, atol=1e-6, err_msg=k)
  with open(out + ".json") as f:
    m2 = json.load(f)
  for k in ("loss", "grad_norm", "entropy", "approx_kl", "tokens"):
    np.testing.assert_allclose(m2[k], m1[k], rtol=1e-5, err_msg=k)
