"""The rollout controller with episodic workflows, on a fake in-process engine: every episode's
turns are one-sample requests routed back to it, groups are accepted whole with one reward per
episode, and the single-turn path still sends one grouped request per prompt."""

import collections
import queue
import threading

from areal_jax import tasks, workflows
from areal_jax.models import byte_tokenizer
from areal_jax.rollout_api import RolloutEngine, Sample, SamplingParams
from areal_jax.runtime import episodes
from areal_jax.runtime.controller import RolloutController
from areal_jax.runtime.staleness import StalenessController

TOK = byte_tokenizer()
EOS = TOK.eos_token_ids[0]


class FakeEngine(RolloutEngine):
  """Answers "WRONG" on a conversation's first turn and "RIGHT" after one "try again"."""

  def __init__(self):
    self.requests, self._out, self._version = [], queue.Queue(), 0
    self._lock = threading.Lock()

  def start(self): pass
  def stop(self): pass
  def pause(self): pass
  def resume(self): pass
  def abort(self, group_id): pass

  def update_params(self, params, version):
    self._version = version

  @property
  def version(self):
    return self._version

  def submit(self, request):
    with self._lock:
      self.requests.append(request)
    retries = TOK.decode(request.prompt_tokens).count("try again")
    toks = TOK.encode("RIGHT" if retries else "WRONG") + [EOS]
    for i in range(request.n):
      self._out.put(Sample(request.group_id, i, request.prompt_tokens, toks, [-0.5] * len(toks),
                           [self._version] * len(toks), "eos", metadata=dict(request.metadata)))

  def poll(self, timeout=0.0):
    out = []
    try:
      out.append(self._out.get(timeout=timeout or 1e-3))
      while True:
        out.append(self._out.get_nowait())
    except queue.Empty:
      pass
    return out


class Rewards:
  workers = 1

  def score(self, texts, example):
    return [1.0 if "RIGHT" in t else 0.0 for t in texts], 0


def controller(engine, workflow, batch_size=2, n=3):
  task = tasks.get_task({"name": "arithmetic", "num_train": 16, "num_test": 4})
  staleness = StalenessController(batch_size, 1, batch_size)
  ctrl = RolloutController(engine, task, TOK, staleness, iter(task.examples("train")), Rewards(),
                           n_samples=n, params=SamplingParams(max_new_tokens=8),
                           max_prompt_len=1024, filter_uniform_groups=False, seed=3,
                           workflow=workflow)
  return ctrl, staleness, task


def test_multi_turn_groups_are_whole_episodes_with_discounted_rewards():
  engine = FakeEngine()
  ctrl, staleness, task = controller(engine, workflows.MultiTurn(max_turns=3, turn_discount=0.5))
  ctrl.start()
  try:
    batch = staleness.take_batch(0, timeout=30)
    ctrl.check()
    assert batch is not None and len(batch) == 2
    for group in batch:
      assert [s.index for s in group.samples] == [0, 1, 2]
      assert group.rewards == [0.5] * 3  # right on the second turn
      for s in group.samples:
        assert s.group_id == group.group_id and s.metadata["turns"] == 2
        assert TOK.decode([t for t, m in zip(s.tokens, s.loss_mask) if m]) == "WRONGRIGHT"
        assert s.loss_mask.count(0) > 0 and s.prompt_tokens == task.prompt_ids(group.example, TOK)
    evals = ctrl.evaluate(task.test_examples(2), 2, SamplingParams(greedy=True, max_new_tokens=8))
    assert [g.rewards for g in evals] == [[1.0, 1.0]] * 2  # right within max_turns, undiscounted
    assert all(g.group_id < 0 for g in evals)
  finally:
    ctrl.stop()
  turns = [r for r in engine.requests if r.metadata["kind"] == "turn"]
  assert turns and len(turns) == len(engine.requests)
  assert all(r.n == 1 and r.group_id >= episodes.TURN_ID_BASE for r in turns)
  assert len({r.group_id for r in turns}) == len(turns)  # each turn has an id of its own
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
