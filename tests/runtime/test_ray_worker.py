"""A rollout worker's body (``runtime.ray_worker.RolloutWorker``), built in this process: its
devices hold nothing but what its sampler's memory plan counts."""

import pathlib
import sys

from areal_jax.runtime import engines, ray_worker

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_trainer import device_bytes, tiny_config  # noqa: E402


def test_a_worker_plans_its_sampler_on_empty_devices_and_keeps_what_it_planned(tmp_path,
                                                                               monkeypatch):
  c = tiny_config(**{"runtime.mode": "ray", "runtime.worker_devices": "gpu",  # (this process's)
                     "mesh.sampler_devices": 2, "model.dtype": "bfloat16",
                     "mesh.device_memory_gib": 16.0})  # (a budget: the plan is made)
  before, at_plan = device_bytes(), {}
  build = engines.build

  def recording_build(*args, **kwargs):
    at_plan.update(device_bytes())
    return build(*args, **kwargs)

  monkeypatch.setattr(engines, "build", recording_build)
  worker = ray_worker.RolloutWorker(c, str(tmp_path / "weights"))
  try:
    # The sampler plans against the whole budget: the model's weights must not already sit on a
    # device (a float32 copy from models.load left on the first one while the engine is planned
    # and built would be 4 bytes a parameter, 5.8 GiB at 1.5B, that no plan counts).
    assert {d: n - before.get(d, 0) for d, n in at_plan.items() if n > before.get(d, 0)} == {}
    plan = worker.engine.memory_plan
    now = device_bytes()
    grown = [n - before.get(d, 0) for d, n in now.items() if n > before.get(d, 0)]
    # (its two sampler devices; the prefix memo and continuation rows the plan counts fill as it
    # runs, none held yet)
    assert plan is not None
    filled = plan.memo + plan.kept_rows * plan.row_bytes
    assert grown == [plan.resident_bytes - filled] * 2
  finally:
    worker.stop()
