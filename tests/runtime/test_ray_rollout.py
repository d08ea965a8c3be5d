"""runtime.mode="ray": rollout workers as Ray actors, a worker SIGKILLed mid-run, the core plan,
LoRA runs (adapters only cross processes) and a learner group feeding the workers.

One local Ray cluster (2 CPUs, no dashboard, its own temporary directory) serves the module; it is
shut down at the end and no Ray process is left behind.
"""

import os
import pathlib
import signal
import sys
import threading
import time

import pytest

from areal_jax import config as config_lib
from areal_jax.runtime import metrics as metrics_lib
from areal_jax.runtime import learner_group, ray_cluster, ray_rollout

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import lora_run  # noqa: E402
from test_trainer import trajectories  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = f"{ROOT}/configs/gsm8k.py:tiny"
ARITH_TINY = f"{ROOT}/configs/arithmetic.py:tiny"


def test_plan_cores_gives_each_side_cores_of_its_own():
  assert ray_cluster.plan_cores(1, available=[0, 1]) == ([0], [[1]])
  learner, workers = ray_cluster.plan_cores(3, available=range(16))
  assert learner == [0, 1, 2, 3] and workers == [[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
  learner, workers = ray_cluster.plan_cores(2, learner_cores=6, available=range(16))
  assert learner == list(range(6)) and workers == [[6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
  assert ray_cluster.plan_cores(2, available=[0, 1]) is None  # 3 sides, 2 cores: no pinning
  all_cores = sorted(learner + [c for w in workers for c in w])
  assert all_cores == list(range(16))


def test_ray_mode_rejects_colocated_meshes_and_takes_lora_and_learner_groups():
  c = config_lib.load(TINY)
  for key, value in {"runtime.mode": "ray", "mesh.colocated": True, "actor.lora.rank": 4}.items():
    config_lib.override(c, key, value)
  with pytest.raises(ValueError, match="mesh.colocated=False") as e:
    config_lib.validate(c)
  assert "lora" not in str(e.value)
  config_lib.override(c, "mesh.colocated", False)
  config_lib.validate(c)
  # a learner group beside Ray workers (which always read Orbax versions, whatever weights.transfer)
  for key, value in {"actor.lora.rank": 0, "runtime.learner_processes": 2,
                     "mesh.learner_devices": 2, "weights.transfer": "device_put"}.items():
    config_lib.override(c, key, value)
  assert learner_group.check_config(c) == 2


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
  ray = pytest.importorskip("ray")
  tmp = tmp_path_factory.mktemp("ray")
  before = _descendants()
  # This test kills a worker itself; Ray's memory monitor killing one more on a crowded machine
  # would make the run's course (not its guarantees) unpredictable.
  os.environ["RAY_memory_monitor_refresh_ms"] = "0"
  # No idle default workers started ahead: every worker here is an actor with its own runtime_env,
  # which never takes one (each would only cost a Python start-up).
  os.environ["RAY_prestart_worker_first_driver"] = "0"
  ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp), object_store_memory=128 * 2**20,
           log_to_driver=False)
  yield ray
  ray.shutdown()
  os.environ.pop("RAY_memory_monitor_refresh_ms", None)
  os.environ.pop("RAY_prestart_worker_first_driver", None)
  deadline = time.time() + 20  # every process the cluster started is gone
  while _leftovers(before, str(tmp)) and time.time() < deadline:
    time.sleep(0.2)
  left = _leftovers(before, str(tmp))
  assert not left, {p: _processes().get(p) for p in left}


def _processes() -> dict[int, tuple[int, bytes]]:
  """pid -> (parent pid, command line) of every process now."""
  out = {}
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/stat", "rb") as f:
        ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        out[int(pid)] = (ppid, f.read())
    except (OSError, IndexError, ValueError):  # ended meanwhile
      pass
  return out


def _descendants(procs=None) -> set[int]:
  procs = _processes() if procs is None else procs
  found, frontier = set(), {os.getpid()}
  while frontier:
    frontier = {p for p, (ppid, _) in procs.items() if ppid in frontier} - found
    found |= frontier
  return found


def _leftovers(before: set[int], tmp: str) -> set[int]:
  """Processes this test module started (children, or naming the cluster's temp dir) still alive."""
  procs = _processes()
  named = {p for p, (_, cmd) in procs.items() if tmp.encode() in cmd}
  # multiprocessing's resource tracker (started by the reward pool) lives as long as this process
  tracker = {p for p, (_, cmd) in procs.items() if b"multiprocessing.resource_tracker" in cmd}
  return ((_descendants(procs) - before) | named) - tracker


class _Recorder:
  """Wraps the engine: remembers it, and the announced version at each group's submission."""

  def __init__(self):
    self.engine, self.submitted = None, {}

  def __call__(self, engine):
    self.engine = engine
    inner_submit = engine.submit

    def submit(request):
      self.submitted[request.group_id] = engine.version
      inner_submit(request)

    engine.submit = submit
    return engine


@pytest.mark.slow
@pytest.mark.parametrize("transfer", ["orbax", "jax_transfer"])
def test_a_sigkilled_rollout_worker_restarts_and_no_group_is_lost_or_trained_twice(
    local_ray, tmp_path, transfer):
  """Weights through Orbax files, or pulled from the learner's memory (jax_transfer: the restarted
  worker pulls under a new uuid)."""
  from areal_jax.runtime import trainer

  steps, eta, batch, n = 5, 1, 2, 4
  c = config_lib.load(TINY)
  for key, value in {"runtime.mode": "ray", "rollout.workers": 1, "train.total_steps": steps,
                     "rollout.max_head_offpolicyness": eta, "actor.batch_size": batch,
                     "rollout.n_samples": n, "rollout.num_slots": 8, "rollout.max_new_tokens": 24,
                     "train.dump_trajectories": True, "train.checkpoint_every": 100,
                     "weights.transfer": transfer, "weights.pull_timeout_s": 30.0}.items():
    config_lib.override(c, key, value)
  record = _Recorder()
  killed = {}

  def killer():  # once step 1 is trained, SIGKILL the worker while it holds unfinished groups
    path = tmp_path / "metrics.jsonl"
    while not (path.exists() and path.read_text().count("\n") >= 1):
      time.sleep(0.05)
    engine = record.engine
    killed["pid"] = engine.worker_info()[0]["pid"]
    deadline = time.time() + 300
    while time.time() < deadline:  # the next groups may not be admitted yet: wait for one
      with engine._lock:  # pylint: disable=protected-access
        if engine._groups:  # pylint: disable=protected-access
          # killed under the lock: the groups it holds cannot change between the two lines
          killed["holding"] = sorted(engine._groups)  # pylint: disable=protected-access
          os.kill(killed["pid"], signal.SIGKILL)
          return
      time.sleep(0.01)

  thread = threading.Thread(target=killer, daemon=True)
  thread.start()
  trainer.run(c, str(tmp_path), wrap_engine=record)
  thread.join(timeout=5)

  engine = record.engine
  assert killed.get("holding"), "the worker held no group within 300 s of step 1"
  # once by the test; a jax_transfer pull stalled by the kill may end the next incarnation too
  assert engine.workers[0].restarts >= 1
  # Redone: the groups it held (one whose last samples were already on their way back may have
  # completed instead, and one sent to it before its death was noticed is redone too).
  assert set(killed["holding"]) & set(engine.resubmitted)
  assert (tmp_path / "weights").exists() == (transfer == "orbax")  # jax_transfer: no file between
  assert engine.workers[0].stats["version"] >= 1  # the restarted worker loaded weights again
  rows = metrics_lib.read(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in rows] == list(range(1, steps + 1))
  samples = trajectories(str(tmp_path))
  by_group = {}
  for s in samples:
    by_group.setdefault(s["group_id"], []).append(s)
    assert s["staleness"] == s["trained_at_version"] - min(s["versions"])
    assert 0 <= s["staleness"] <= eta, s  # every token's version within the bound
    assert s["versions"] == sorted(s["versions"])  # one attempt: versions never go back
  assert len(by_group) == steps * batch
  for gid, group in by_group.items():  # trained once, all n samples of one attempt
    assert sorted(s["index"] for s in group) == list(range(n)), gid
    assert len({s["trained_at_version"] for s in group}) == 1
  # No group lost: every group whose deadline (admitted at version <= v, trained by v + eta) fell
  # within the run was trained, the killed worker's groups included.
  due = {g for g, v in record.submitted.items() if v + eta <= steps - 1}
  assert due <= set(by_group)
  assert set(killed["holding"]) & due


def test_a_worker_the_cluster_cannot_place_fails_start_with_a_clear_message(local_ray, tmp_path):
  c = config_lib.load(TINY)
  config_lib.override(c, "runtime.worker_devices", "gpu")  # the test cluster has no GPU
  engine = ray_rollout.RayRolloutEngine(c, str(tmp_path / "weights"), [None])
  engine.restart_timeout_s = 2.0
  try:
    with pytest.raises(RuntimeError, match=r"did not start within 2 s.*num_gpus"):
      engine.start()
  finally:
    engine.stop()


def test_a_worker_fault_fails_start_under_its_own_type_in_one_line(local_ray, tmp_path):
  """model.source not on the worker's host: the worker is not restarted into the same fault; start
  raises it as the CheckpointError it is, naming the worker (launch.py: one line)."""
  from areal_jax import models

  c = config_lib.load(TINY)
  config_lib.override(c, "model.source", str(tmp_path / "missing"))
  engine = ray_rollout.RayRolloutEngine(c, str(tmp_path / "weights"), [None])
  try:
    with pytest.raises(models.CheckpointError) as fault:
      engine.start()
  finally:
    engine.stop()
  assert str(fault.value).startswith(f"rollout worker 0: model.source: model source "
                                     f"'{tmp_path / 'missing'}': no such directory")
  assert "Traceback" in fault.value.__notes__[0]  # the worker's, shown only with the driver's
  assert engine.workers[0].restarts == 0


def _overridden(path, **overrides):
  c = config_lib.load(path)
  for key, value in overrides.items():
    config_lib.override(c, key, value)
  return c


@pytest.mark.slow
def test_lora_in_ray_mode_ships_adapters_and_the_worker_samples_the_merged_policy(
    local_ray, tmp_path):
  """actor.lora with a Ray worker: each version on disk is adapters only; the worker merges them
  into its own base, and its behaviour logprobs are those of the merged policy of their version."""
  from areal_jax.runtime import trainer

  steps, eta = 3, 1
  c = _overridden(ARITH_TINY, **{
      "runtime.mode": "ray", "rollout.workers": 1, "mesh.colocated": False,
      "mesh.sampler_devices": 1, "actor.lora.rank": 4, "actor.lora.alpha": 8.0,
      "train.total_steps": steps, "rollout.max_head_offpolicyness": eta, "train.eval_every": 0,
      "train.checkpoint_every": 100, "train.dump_trajectories": True, "weights.keep": steps + 1,
      # the random model never scores: a constant advantage of 1 still trains the adapters
      "actor.adv_norm": "none", "actor.reward_bias": 1.0})
  trainer.run(c, str(tmp_path))

  lora_run.check_adapters_trained_and_sampled(c, tmp_path, steps, eta)


@pytest.mark.slow
def test_a_learner_group_publishes_straight_to_ray_workers(local_ray, tmp_path):
  """runtime.learner_processes=2 beside a Ray worker: the group writes each version, the driver
  only announces it (it holds no weights) and the worker reads it from the group's directory."""
  from areal_jax.runtime import trainer

  steps, eta = 2, 0  # synchronous: the second batch is generated by version 1 alone
  # (the SIGKILL tests' sampler shapes: the worker's programs are compiled once for the module)
  c = _overridden(TINY, **{
      "runtime.mode": "ray", "rollout.workers": 1, "runtime.learner_processes": 2,
      "mesh.learner_devices": 2, "mesh.sampler_devices": 1, "train.total_steps": steps,
      "rollout.max_head_offpolicyness": eta, "rollout.num_slots": 8, "rollout.max_new_tokens": 24,
      "train.checkpoint_every": 100, "train.dump_trajectories": True, "weights.keep": steps + 1})
  record = _Recorder()
  trainer.run(c, str(tmp_path), wrap_engine=record)

  engine = record.engine
  assert isinstance(engine.announcer, learner_group.GroupAnnouncer)
  assert [v for v, *_ in engine.history] == list(range(steps + 1))  # announced once each
  assert sorted(lora_run.published(tmp_path / "weights")) == list(range(steps + 1))
  rows = metrics_lib.read(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in rows] == list(range(1, steps + 1))
  samples = trajectories(str(tmp_path))
  assert len(samples) == steps * c.actor.batch_size * c.rollout.n_samples
  # the worker ran the group's versions: each batch by the version before it
  assert all(set(s["versions"]) == {s["trained_at_version"]} for s in samples)
  assert {s["trained_at_version"] for s in samples} == set(range(steps))
  assert sorted(os.listdir(tmp_path / "learner_logs")) == ["process_0.log", "process_1.log"]
  assert (tmp_path / "checkpoints" / str(steps)).is_dir()
