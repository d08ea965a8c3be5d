"""A fake in-process engine and a rollout controller over it, for the controller's and the
episodes' tests (``test_controller.py``, ``test_episodes.py``)."""

import queue
import threading

from areal_jax import tasks
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


def controller(engine, workflow, batch_size=2, n=3, eta=1, num_train=16, **kwargs):
  task = tasks.get_task({"name": "arithmetic", "num_train": num_train, "num_test": 4})
  staleness = StalenessController(batch_size, eta, batch_size)
  ctrl = RolloutController(engine, task, TOK, staleness, iter(task.examples("train")), Rewards(),
                           n_samples=n, params=SamplingParams(max_new_tokens=8),
                           max_prompt_len=1024, filter_uniform_groups=False, seed=3,
                           workflow=workflow, **kwargs)
  return ctrl, staleness, task


def check_episode_groups(batch, task, reward):
  """Two groups of three whole episodes, each "WRONG" then "RIGHT" after the feedback."""
  assert batch is not None and len(batch) == 2
  for group in batch:
    assert [s.index for s in group.samples] == [0, 1, 2] and group.rewards == [reward] * 3
    for s in group.samples:
      assert s.group_id == group.group_id and s.metadata["turns"] == 2
      assert TOK.decode([t for t, m in zip(s.tokens, s.loss_mask) if m]) == "WRONGRIGHT"
      assert s.loss_mask.count(0) > 0 and s.prompt_tokens == task.prompt_ids(group.example, TOK)


def check_turn_requests(engine):
  """Every request the engine got is one episode's turn, with an id of its own; returns them."""
  turns = [r for r in engine.requests if r.metadata["kind"] == "turn"]
  assert turns and len(turns) == len(engine.requests)
  assert all(r.n == 1 and r.group_id >= episodes.TURN_ID_BASE for r in turns)
  assert len({r.group_id for r in turns}) == len(turns)
  return turns
