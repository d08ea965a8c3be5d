"""Async episodes through the rollout controller on the fake engine of ``test_controller``: whole
episodes per group, the cap on episodes running at once (async and blocking), the staleness bound
and "nothing trained twice", a stop that wakes and cancels waiting episodes, an episode's error
stopping the run; and the counters behind the episode metrics (``EpisodeStats``, the share of
episodes that called a tool)."""

import asyncio
import pathlib
import sys
import threading
import time
import types

import pytest

from areal_jax import workflows
from areal_jax.rollout_api import SamplingParams
from areal_jax.runtime.episode_stats import MAX_KINDS, EpisodeStats, tool_call_frac
from areal_jax.workflows.base import Episode, Trajectory, turn_params

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from controller_fakes import (FakeEngine, check_episode_groups, check_turn_requests,  # noqa: E402
                              controller)

RUNTIME_THREADS = ("episode", "eval-episode", "turn-submit")


class Retry(workflows.Workflow):
  """The fake engine's "try again" episode, async: a wrong answer, an environment step of
  ``env_s`` seconds (reported), then the right answer; counts the episodes running at once."""

  name = "retry"

  def __init__(self, env_s: float = 0.0, fail: bool = False):
    self.env_s, self.fail = env_s, fail
    self.running = self.most = self.ended = 0  # (on the one event loop: no lock needed)

  async def run(self, example, ctx, client, params):
    self.running += 1
    self.most = max(self.most, self.running)
    try:
      if self.fail:
        raise ValueError("the workflow's own bug")
      traj = Trajectory(ctx.task.prompt_ids(example, ctx.tokenizer))
      for turn in range(3):
        sample = await client.generate(traj.context, turn_params(params, turn))
        traj.add_turn(sample)
        reward = await ctx.areward(ctx.tokenizer.decode(sample.tokens), example)
        if reward > 0.5:
          break
        t0 = time.monotonic()
        await asyncio.sleep(self.env_s)
        ctx.report_env(time.monotonic() - t0, None)
        traj.add_context(ctx.tokenizer.encode(" try again"), traj.last_version(default=0))
      return Episode(traj.sample(-1, -1, sample.finish_reason), reward, reward > 0.5, turn + 1,
                     "answered")
    finally:
      self.running -= 1
      self.ended += 1


class BlockingRetry(workflows.Workflow):
  """``Retry`` as a blocking workflow (a thread per episode)."""

  name = "blocking_retry"

  def __init__(self, env_s: float):
    self.env_s, self.running, self.most = env_s, 0, 0
    self._lock = threading.Lock()

  def run(self, example, ctx, client, params):
    with self._lock:
      self.running += 1
      self.most = max(self.most, self.running)
    try:
      traj = Trajectory(ctx.task.prompt_ids(example, ctx.tokenizer))
      traj.add_turn(client.generate(traj.context, params))
      time.sleep(self.env_s)
      traj.add_context(ctx.tokenizer.encode(" try again"), traj.last_version(default=0))
      sample = client.generate(traj.context, turn_params(params, 1))
      traj.add_turn(sample)
      return Episode(traj.sample(-1, -1, sample.finish_reason), 1.0, True, 2, "answered")
    finally:
      with self._lock:
        self.running -= 1


def runtime_threads():
  return [t.name for t in threading.enumerate()
          if t.name.startswith(RUNTIME_THREADS) or t.name == "episode-loop"]


def test_async_episodes_make_whole_groups_and_report_their_environment():
  wf = Retry(env_s=0.01)
  assert workflows.is_async(wf) and not workflows.is_async(workflows.MultiTurn(2))
  engine = FakeEngine()
  ctrl, staleness, task = controller(engine, wf)
  ctrl.start()
  try:
    batch = staleness.take_batch(0, timeout=30)
    ctrl.check()
    check_episode_groups(batch, task, 1.0)
    evals = ctrl.evaluate(task.test_examples(2), 2, SamplingParams(greedy=True))
    assert [g.rewards for g in evals] == [[1.0, 1.0]] * 2 and all(g.group_id < 0 for g in evals)
    row = ctrl.step_metrics()
  finally:
    ctrl.stop()
  assert row["env_steps"] >= 6 + 4 and row["env_step_p99_s"] >= row["env_step_p50_s"] > 0
  assert row["env_failures"] == 0 and 0 < row["sampler_busy_frac"] <= 1
  assert row["episodes_in_flight_mean"] > 0
  check_turn_requests(engine)
  assert not runtime_threads() and ctrl.episode_stats.in_flight == 0


@pytest.mark.parametrize("blocking", [False, True])
def test_no_more_episodes_run_at_once_than_the_cap(blocking):
  wf = BlockingRetry(env_s=0.05) if blocking else Retry(env_s=0.05)
  ctrl, staleness, _ = controller(FakeEngine(), wf, max_concurrent_episodes=2)
  ctrl.start()
  try:
    batch = staleness.take_batch(0, timeout=30)  # 6 episodes admitted at once, 2 places
    ctrl.check()
  finally:
    ctrl.stop()
  assert batch is not None and all(g.rewards == [1.0] * 3 for g in batch)
  assert wf.most == 2


def test_async_episodes_keep_the_staleness_bound_and_train_nothing_twice():
  eta, steps = 1, 5
  engine = FakeEngine()
  ctrl, staleness, _ = controller(engine, Retry(env_s=0.02), batch_size=2, n=2, eta=eta,
                                  num_train=64)
  trained_groups, trained_examples = [], []
  ctrl.start()
  try:
    for step in range(steps):
      batch = staleness.take_batch(step, timeout=30)
      ctrl.check()
      assert batch is not None
      ctrl.mark_trained([g.group_id for g in batch])
      for g in batch:
        assert step - g.admit_version <= eta
        for s in g.samples:
          assert min(s.versions) >= g.admit_version and step - min(s.versions) <= eta
      trained_groups += [g.group_id for g in batch]
      trained_examples += [g.example["id"] for g in batch]
      engine.update_params(None, step + 1)  # (episodes in flight go on under the new version)
      staleness.publish(step + 1)
  finally:
    ctrl.stop()
  assert len(trained_groups) == steps * 2 == len(set(trained_groups))
  assert len(set(trained_examples)) == len(trained_examples)


class SilentEngine(FakeEngine):
  """Takes every request and never answers."""

  def submit(self, request):
    with self._lock:
      self.requests.append(request)


class Hang(workflows.Workflow):
  """Every other episode hangs in its environment, the rest wait for a turn that never comes."""

  name = "hang"

  def __init__(self):
    self.started = self.cleaned = 0

  async def run(self, example, ctx, client, params):
    self.started += 1
    try:
      if self.started % 2:
        await asyncio.sleep(3600)
      await client.generate(ctx.task.prompt_ids(example, ctx.tokenizer), params)
      raise AssertionError("a turn came back from an engine that never answers")
    finally:
      self.cleaned += 1


def test_stop_wakes_and_cancels_waiting_async_episodes():
  wf = Hang()
  ctrl, _, _ = controller(SilentEngine(), wf)
  ctrl.start()
  try:
    deadline = time.time() + 30
    while (ctrl.episode_stats.in_flight < 6 or ctrl._episodes.turns.waiting < 3) and \
        time.time() < deadline:
      time.sleep(0.01)
    assert ctrl.episode_stats.in_flight == 6 and ctrl._episodes.turns.waiting == 3
  finally:
    ctrl.stop()
  ctrl.check()  # a stopped episode is no error
  assert wf.cleaned == wf.started == 6 and ctrl.episode_stats.in_flight == 0
  assert not runtime_threads()


def test_an_async_episodes_error_stops_the_run():
  ctrl, staleness, _ = controller(FakeEngine(), Retry(fail=True))
  ctrl.start()
  try:
    deadline = time.time() + 30
    with pytest.raises(RuntimeError, match="rollout controller failed") as info:
      while time.time() < deadline:
        ctrl.check()
        time.sleep(0.01)
    assert isinstance(info.value.__cause__, ValueError)
    assert staleness.take_batch(0, timeout=0.1) is None
  finally:
    ctrl.stop()


def test_episode_stats_in_flight_latencies_and_failure_kinds():
  now = [0.0]
  stats = EpisodeStats(clock=lambda: now[0])
  stats.started()
  stats.started()
  now[0] = 1.0
  stats.ended()
  now[0] = 2.0  # 2 episodes for 1 s, then 1 for 1 s
  for i in range(100):
    stats.env_call(0.01 * (i + 1), None if i % 10 else "timeout")
  stats.env_call(0.5, "Crashed!")  # normalised
  for k in range(MAX_KINDS + 3):
    stats.env_call(0.1, f"kind{k}")
  row = stats.report()
  assert row["episodes_in_flight"] == 1 and row["episodes_in_flight_mean"] == pytest.approx(1.5)
  assert row["env_steps"] == 101 + MAX_KINDS + 3
  assert row["env_failures/timeout"] == 10 and row["env_failures/crashed"] == 1
  kinds = [k for k in row if k.startswith("env_failures/")]
  assert len(kinds) == MAX_KINDS + 1 and "env_failures/other" in row  # (no kinds past the bound)
  assert row["env_failures"] == 10 + 1 + MAX_KINDS + 3
  assert 0.0 < row["env_step_p50_s"] < row["env_step_p99_s"] <= 1.0
  now[0] = 3.0
  row = stats.report()  # a fresh period: no calls, failures stay cumulative
  assert row["env_steps"] == 0 and row["env_step_p50_s"] is None and row["env_failures"] > 0
  assert row["episodes_in_flight_mean"] == pytest.approx(1.0)


def test_tool_call_frac_counts_only_episodes_that_count_calls():
  sample = lambda **meta: types.SimpleNamespace(metadata=meta)
  assert tool_call_frac([sample(turns=1), sample()]) is None  # single-turn: no tools
  assert tool_call_frac([sample(calls=0), sample(calls=2), sample(calls=1), sample(turns=2),
                         sample(calls=0, call_failures=0)]) == 0.5
