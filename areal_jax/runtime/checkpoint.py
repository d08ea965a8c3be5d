"""Run checkpoints: learner state plus everything needed to resume exactly.

One Orbax ``CheckpointManager`` under ``<workdir>/checkpoints``, one step per policy version. Each
checkpoint holds two items:
  * ``state``: the learner's pytree (parameters, optimizer state, step), restored straight into the
    learner mesh's shardings;
  * ``meta``: JSON — policy version, data iterator state, the examples of groups admitted but not yet
    trained (redone first after a resume, so the data order is unchanged), the next group id,
    staleness counters and cumulative run statistics.
Orbax writes into a temporary directory and renames it when complete, so a crash mid-save leaves the
previous checkpoint as the latest one; unfinished temporaries are ignored and cleaned up.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:

  def __init__(self, workdir: str, keep: int):
    options = ocp.CheckpointManagerOptions(max_to_keep=max(1, keep), create=True,
                                           enable_async_checkpointing=False,
                                           cleanup_tmp_directories=True)
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def save(self, step: int, state: Any, meta: dict) -> None:
    self._mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                 meta=ocp.args.JsonSave(meta)), force=True)
    self._mgr.wait_until_finished()

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """Restores ``step``; ``abstract_state`` gives shapes, dtypes and target shardings."""
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        abstract_state)
    out = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                          meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]

  def close(self) -> None:
    self._mgr.close()
