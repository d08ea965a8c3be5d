"""The rollout controller with episodic workflows, on a fake in-process engine: every episode's
turns are one-sample requests routed back to it, groups are accepted whole with one reward per
episode, and the single-turn path still sends one grouped request per prompt."""

import collections
import pathlib
import sys
import threading

from areal_jax import workflows
from areal_jax.rollout_api import SamplingParams

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from controller_fakes import (TOK, FakeEngine, check_episode_groups,  # noqa: E402
                              check_turn_requests, controller)


def test_multi_turn_groups_are_whole_episodes_with_discounted_rewards():
  engine = FakeEngine()
  ctrl, staleness, task = controller(engine, workflows.MultiTurn(max_turns=3, turn_discount=0.5))
  ctrl.start()
  try:
    batch = staleness.take_batch(0, timeout=30)
    ctrl.check()
    check_episode_groups(batch, task, 0.5)  # right on the second turn
    evals = ctrl.evaluate(task.test_examples(2), 2, SamplingParams(greedy=True, max_new_tokens=8))
    assert [g.rewards for g in evals] == [[1.0, 1.0]] * 2  # right within max_turns, undiscounted
    assert all(g.group_id < 0 for g in evals)
    row = ctrl.step_metrics()
  finally:
    ctrl.stop()
  assert row["episodes_in_flight_mean"] > 0 and 0 < row["sampler_busy_frac"] <= 1
  assert row["env_steps"] == 0 and row["env_failures"] == 0  # (no environment reported)
  turns = check_turn_requests(engine)
  first = collections.Counter(tuple(r.prompt_tokens) for r in turns
                              if "try again" not in TOK.decode(r.prompt_tokens))
  seeds = {}
  for r in turns:  # the n episodes of a prompt sample with different seeds
    if "try again" not in TOK.decode(r.prompt_tokens):
      seeds.setdefault(tuple(r.prompt_tokens), set()).add(r.params.seed)
  assert all(len(seeds[p]) == c for p, c in first.items())
  assert not [t for t in threading.enumerate() if t.name.startswith(("episode", "eval-episode"))]


def test_single_turn_keeps_one_grouped_request_per_prompt():
  engine = FakeEngine()
  ctrl, staleness, _ = controller(engine, workflows.SingleTurn())
  ctrl.start()
  try:
    batch = staleness.take_batch(0, timeout=30)
  finally:
    ctrl.stop()
  assert ctrl.workflow is None
  assert all(r.n == 3 and r.metadata["kind"] == "train" for r in engine.requests)
  assert all(s.loss_mask is None for g in batch for s in g.samples)
  assert [g.rewards for g in batch] == [[0.0] * 3] * 2
