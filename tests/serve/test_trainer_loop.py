"""The trainer loop's bookkeeping: what it trains, what it skips, and exact resume after a kill.

The learner and checkpointer here are small stand-ins that record what they are given (the real
learner's steps are covered by tests/learner and by tests/serve/test_app.py end to end): these tests
are about which turns reach a train step, with which advantages, and how often.
"""

import copy
import json

import pytest

from areal_jax import config as config_lib
from areal_jax.serve import trainer_loop
from areal_jax.serve.store import TurnStore


class _Learner:

  def __init__(self):
    self.state = {"version": 0}
    self.trained = []  # (version, turn ids, advantages) per step

  @property
  def version(self):
    return self.state["version"]

  def train_step(self, groups, rewards):
    assert all(len(g) == 1 for g in groups)
    self.trained.append((self.version, [g[0].group_id for g in groups], [r[0] for r in rewards]))
    self.state = {"version": self.version + 1}
    return {"loss": 0.0}

  def load_state(self, state):
    self.state = dict(state)

  def params(self):
    return {"w": self.version}


class _Ckpt:

  def __init__(self):
    self.saved = {}

  def save(self, step, state, meta):
    self.saved[step] = (copy.deepcopy(state), copy.deepcopy(meta))

  def latest_step(self):
    return max(self.saved, default=None)

  def restore_latest(self, _):
    step = self.latest_step()
    return None if step is None else (step, *self.saved[step])


class _Engine:

  def __init__(self):
    self.published = []

  def update_params(self, params, version):
    self.published.append(version)


class _Transfer:

  def send(self, params, version):
    return params


def _config(batch=2, checkpoint_every=2, max_staleness=1):
  c = config_lib.load("configs/serve_arithmetic.py:tiny")
  c.unlock()
  c.actor.batch_size, c.train.checkpoint_every = batch, checkpoint_every
  c.serve.max_staleness = max_staleness
  return c


def _add(store, n, score=1.0, version=0, temperature=None, config=None, finish_reason="eos"):
  temperature = config.rollout.temperature if temperature is None else temperature
  ids = []
  for _ in range(n):
    key = f"t{store.counts()['turns']}"
    (tid,), _ = store.add_turns(key, [dict(
        request_id=key, messages=[], prompt_tokens=[1, 2],
        completion_tokens=[3], logprobs=[-1.0], versions=[version], completion_text="x",
        finish_reason=finish_reason, temperature=temperature)])
    ids.append(tid)
  store.set_judgements([(t, "judged", score) for t in ids])
  return ids


def _loop(tmp_path, config, store, learner=None, ckpt=None):
  return trainer_loop.TrainerLoop(config, str(tmp_path), store, learner or _Learner(), _Transfer(),
                                  _Engine(), ckpt or _Ckpt())


def test_stale_and_off_temperature_turns_are_counted_not_trained(tmp_path):
  config = _config(batch=2, max_staleness=1)
  store = TurnStore(str(tmp_path / "t.sqlite"))
  loop = _loop(tmp_path, config, store)
  loop.learner.state = {"version": 3}
  stale = _add(store, 2, version=1, config=config)  # 3 - 1 > 1
  other_t = _add(store, 1, version=3, temperature=0.0, config=config)
  fresh = _add(store, 2, version=2, config=config)
  assert loop.step()
  assert loop.learner.trained[0][1] == fresh
  assert loop.stats["stale"] == 2 and loop.stats["off_policy_temperature"] == 1
  assert {store.get(i)["train_status"] for i in stale + other_t} == {"stale"}
  assert loop.engine.published == [4]


def test_waits_for_a_full_batch(tmp_path):
  config = _config(batch=3)
  store = TurnStore(str(tmp_path / "t.sqlite"))
  loop = _loop(tmp_path, config, store)
  _add(store, 2, config=config)
  assert not loop.step()
  _add(store, 1, config=config)
  assert loop.step()


def test_kill_and_restart_trains_nothing_twice_and_loses_nothing(tmp_path):
  config = _config(batch=2, checkpoint_every=2, max_staleness=10)
  store = TurnStore(str(tmp_path / "t.sqlite"))
  ckpt, learner = _Ckpt(), _Learner()
  loop = _loop(tmp_path, config, store, learner, ckpt)
  ids = _add(store, 6, config=config)
  for _ in range(3):  # versions 1, 2 (checkpointed), 3 (not): then killed
    assert loop.step()
  assert sorted(ckpt.saved) == [2]
  restarted_learner = _Learner()
  loop2 = _loop(tmp_path, config, store, restarted_learner, ckpt)
  assert loop2.restore() == 2
  assert loop2.step()  # redoes version 3 on the same turns
  timeline = learner.trained[:2] + restarted_learner.trained
  trained_ids = [i for _, batch, _ in timeline for i in batch]
  assert sorted(trained_ids) == ids  # each turn exactly once in the surviving timeline
  assert restarted_learner.trained[0][1] == learner.trained[2][1]
  with open(tmp_path / trainer_loop.METRICS_FILE, encoding="utf-8") as f:
    assert [json.loads(line)["version"] for line in f] == [1, 2, 3]  # the lost row 3 replaced


def test_advantages_single_and_grouped():
  rows = [dict(request_id="a", score=1.0), dict(request_id="b", score=0.0),
          dict(request_id="b", score=1.0), dict(request_id="c", score=0.0)]
  adv, baseline = trainer_loop.advantages(rows, 0.25, decay=0.5)
  assert adv == pytest.approx([0.75, -0.5, 0.5, -0.25])
  b = 0.25
  for s in (1.0, 0.0, 1.0, 0.0):
    b = 0.5 * b + 0.5 * s
  assert baseline == pytest.approx(b)


@pytest.mark.parametrize("advantage,rewards", [("baseline", [0.5, -0.5, 0.505, -0.495]),
                                               ("signed", [1.0, -1.0, 1.0, -1.0])])
def test_signed_advantages_are_plus_or_minus_one_whatever_the_baseline(tmp_path, advantage,
                                                                        rewards):
  """serve.advantage = "signed": a rule judge's right (1) trains at +1 and wrong (0) at -1, where
  the running baseline would give a wrong answer only minus the share of right ones."""
  config = _config(batch=2)
  config.serve.advantage = advantage
  config.serve.baseline_decay = 0.9
  store = TurnStore(str(tmp_path / "t.sqlite"))
  learner = _Learner()
  loop = _loop(tmp_path, config, store, learner=learner)
  for _ in range(2):
    _add(store, 1, score=1.0, config=config)
    _add(store, 1, score=0.0, config=config)
    assert loop.step()
  assert [a for _, _, adv in learner.trained for a in adv] == pytest.approx(rewards)


@pytest.mark.parametrize("advantage", ["baseline", "signed"])
def test_a_cut_off_turn_pays_the_penalty_and_the_baseline_follows_the_scores(tmp_path, advantage):
  """serve.cut_off_penalty: a turn that ran into its token limit trains at its advantage less the
  penalty, whatever its score; a finished one as without it, and the running baseline is the
  same as without it."""
  runs = {}
  for penalty in (0.0, 0.75):
    config = _config(batch=3)
    config.serve.advantage, config.serve.cut_off_penalty = advantage, penalty
    store = TurnStore(str(tmp_path / f"t{penalty}.sqlite"))
    learner = _Learner()
    (tmp_path / str(penalty)).mkdir()
    loop = _loop(tmp_path / str(penalty), config, store, learner=learner)
    for _ in range(2):
      _add(store, 1, score=1.0, config=config)
      _add(store, 1, score=0.0, config=config)
      _add(store, 1, score=1.0, config=config, finish_reason="length")
      assert loop.step()
    runs[penalty] = [a for _, _, adv in learner.trained for a in adv], loop.baseline
  (plain, baseline), (penalised, baseline_penalised) = runs[0.0], runs[0.75]
  assert penalised == pytest.approx([a - 0.75 * (i % 3 == 2) for i, a in enumerate(plain)])
  assert baseline_penalised == pytest.approx(baseline)


def test_refuses_group_normalised_advantages(tmp_path):
  config = _config()
  config.actor.adv_norm = "group"
  with pytest.raises(ValueError, match="adv_norm"):
    _loop(tmp_path, config, TurnStore(str(tmp_path / "t.sqlite")))
