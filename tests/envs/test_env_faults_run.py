"""Environment faults in a run: episodes whose environment hangs, dies, answers garbage or answers
10 MB end with their reason through the rollout controller (counted in the step's metrics), the
pool restarts its worker, the run never stalls, and the staleness bound and "nothing trained
twice" hold across it (the controller and fake engine of tests/runtime/controller_fakes.py)."""

import pathlib
import sys

from areal_jax.envs.pool import EnvPool
from areal_jax.workflows.env_episode import EnvEpisode

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "runtime"))
from controller_fakes import FakeEngine, controller  # noqa: E402

FAULTS = ("hang", "exit", "garbage", "huge")
KINDS = {"hang": "timeout", "exit": "crashed", "garbage": "garbage", "huge": "too_large"}


def test_faulty_environments_end_their_episodes_and_the_run_goes_on():
  eta, steps, batch_size, n = 1, 5, 2, 2
  engine = FakeEngine()
  # Built once to learn the order of the training examples; the pool's environments fail on the
  # first step of the first four (one fault each), then behave.
  _, _, task = controller(engine, None, batch_size=batch_size, n=n, eta=eta, num_train=64)
  ids = [str(e["id"]) for e in task.examples("train")]
  faults = dict(zip(ids, FAULTS))
  pool = EnvPool("areal_jax.envs.synthetic:SyntheticEnv", {"turns": 1, "faults": faults},
                 workers=2, timeout_s=1.0, max_response_bytes=1 << 20)
  ctrl, staleness, task = controller(engine, EnvEpisode(pool, max_turns=2), batch_size=batch_size,
                                     n=n, eta=eta, num_train=64)
  trained, ends, rows = [], {}, []
  ctrl.start()
  try:
    for step in range(steps):
      batch = staleness.take_batch(step, timeout=60)
      ctrl.check()
      assert batch is not None  # never stalls
      ctrl.mark_trained([g.group_id for g in batch])
      for g in batch:
        assert step - g.admit_version <= eta
        for s in g.samples:
          assert min(s.versions) >= g.admit_version and step - min(s.versions) <= eta
        ends[str(g.example["id"])] = ({s.metadata["end"] for s in g.samples}, g.rewards)
      trained += [g.group_id for g in batch]
      rows.append(ctrl.step_metrics())
      engine.update_params(None, step + 1)
      staleness.publish(step + 1)
  finally:
    ctrl.stop()
  assert len(trained) == steps * batch_size == len(set(trained))  # nothing trained twice
  for fault, example_id in zip(FAULTS, ids):  # each fault ended its episodes with its reason
    assert ends[example_id] == ({f"env_{KINDS[fault]}"}, [0.0] * n), (fault, ends[example_id])
  healthy = [v for k, v in ends.items() if k not in faults]
  assert healthy and all(v == ({"done"}, [1.0] * n) for v in healthy)
  failures = {k: sum(r.get(f"env_failures/{k}", 0) for r in rows[-1:]) for k in KINDS.values()}
  assert failures == {kind: n for kind in KINDS.values()}  # cumulative, per episode
  assert pool.stats()["restarts"] >= n + n  # a hang and a death per episode: killed, restarted
  assert all(w.proc is None for w in pool.workers)  # the controller's stop closed the pool
