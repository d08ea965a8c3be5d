"""One of 2 processes sharing a run checkpoint directory (test_checkpoint.py runs it as a script).

  python checkpoint_worker.py <process_id> <num_processes> <coordinator host:port> <workdir>

Each process has 2 fake CPU devices; the state is split over all 4. Checkpoints 1 and 2 are saved
by both processes; then process 1 alone finds checkpoint 2 unusable (a fault only its host sees),
and later every process finds checkpoint 3's meta missing. Each process writes what it restored to
``<workdir>/restored.<process_id>.json``.
"""

import json
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = " ".join(  # 2 devices; the other flags as inherited (the tests')
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=2"])
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

from areal_jax.runtime import distributed  # noqa: E402

pid, n, coordinator, workdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
distributed.initialize(coordinator, n, pid)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from areal_jax.runtime import checkpoint  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("fsdp",))
split = NamedSharding(mesh, PartitionSpec("fsdp"))


def state(step):
  w = jax.make_array_from_callback(
      (8, 4), split, lambda idx: np.arange(32, dtype=np.float32).reshape(8, 4)[idx] * step)
  return {"w": w, "version": jax.device_put(jnp.int32(step), NamedSharding(mesh, PartitionSpec()))}


def meta(step):
  return dict(version=step, data_state={"i": step}, next_group_id=step, pending=[], staleness={},
              totals={})


def restored_as_json(found):
  step, got, _ = found
  w = multihost_utils.process_allgather(got["w"], tiled=True)
  return dict(step=step, w=np.asarray(w).tolist(), version=int(got["version"]))


ckpt = checkpoint.Checkpointer(workdir, keep=5)
for step in (1, 2):
  ckpt.save(step, state(step), meta(step))
out = {}

# 1. Only process 1 finds checkpoint 2 unusable: both fall back to 1; only process 0 moves it.
if pid == 1:
  check = checkpoint.Checkpointer._check_shapes

  def fails_on_2(self, step, abstract_state):
    if step == 2:
      raise ValueError("simulated: checkpoint 2 is unreadable from this host")
    return check(self, step, abstract_state)

  checkpoint.Checkpointer._check_shapes = fails_on_2
out["one_host"] = restored_as_json(ckpt.restore_latest(state(0)))
if pid == 1:
  checkpoint.Checkpointer._check_shapes = check

# 2. Every process finds checkpoint 3's meta missing (both reads fail before Orbax's last barrier).
ckpt.save(3, state(3), meta(3))
if pid == 0:
  os.remove(os.path.join(workdir, "checkpoints", "3", "meta", "metadata"))
multihost_utils.sync_global_devices("meta removed")
out["all_hosts"] = restored_as_json(ckpt.restore_latest(state(0)))
out["listing"] = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
ckpt.close()
with open(os.path.join(workdir, f"restored.{pid}.json"), "w") as f:
  json.dump(out, f)
multihost_utils.sync_global_devices("done")
jax.distributed.shutdown()
