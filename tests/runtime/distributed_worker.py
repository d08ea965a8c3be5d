"""One process of the 2-process learner in test_distributed.py (run as a script).

  python distributed_worker.py <process_id> <num_processes> <coordinator host:port> <out.npz>

Each process has 2 fake CPU devices; the learner mesh (fsdp over all 4) spans both processes.
Process 0 writes the parameters after one train_step (gathered from both) and the metrics.
"""

import json
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = " ".join(  # 2 devices; the other flags as inherited (the tests')
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=2"])
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "learner")]

from areal_jax.runtime import distributed  # noqa: E402

pid, n, coordinator, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
distributed.initialize(coordinator, n, pid)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from learner_helpers import actor, batch, model  # noqa: E402

from areal_jax import config as config_lib  # noqa: E402
from areal_jax.learner import Learner  # noqa: E402

mesh_cfg = config_lib.base_config().mesh
mesh_cfg.learner = dict(data=1, fsdp=-1, tensor=1)
mesh = distributed.learner_mesh(mesh_cfg)
assert mesh.devices.size == 4 and len(jax.local_devices()) == 2
learner = Learner(model(), actor(ppo_n_minibatches=2), mesh)
assert not jax.tree.leaves(learner.params())[0].is_fully_addressable
metrics = learner.train_step(*batch(1, groups=4, n=4))
assert learner.version == 1
params = multihost_utils.process_allgather(learner.params(), tiled=True)
if pid == 0:
  flat = {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(params)}
  np.savez(out + ".tmp.npz", **flat)
  os.replace(out + ".tmp.npz", out)
  with open(out + ".json", "w") as f:
    json.dump({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, f)
multihost_utils.sync_global_devices("done")
jax.distributed.shutdown()
