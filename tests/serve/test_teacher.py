"""The OPD teacher at the judge: with ``serve.teacher_weights = "current"`` it scores with the
version serving was last handed (``teacher.FollowingEngine``), from the start weights on; while
training it scores only the hinted turns of the trainer's next batch. (The teacher's forward
itself, its batching and the trainer's teacher: test_opd.py.)"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax import config as config_lib
from areal_jax.serve import teacher as teacher_lib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "learner"))
from learner_helpers import _logsoftmax, chat_bytes, mesh, model  # noqa: E402

FMT = "{message}\n\nHint: {hint}"  # the config's serve.hint_format
TURN = {"messages": [{"role": "user", "content": "7 * 8 + 3?"}],
        "completion_tokens": [5, 9, 2, 30, 1]}


def _config(**serve):
  c = config_lib.load("configs/serve_arithmetic.py:tiny")
  c.unlock()
  c.serve.signal, c.serve.teacher_weights, c.serve.teacher_at = "opd", "current", "judge"
  for key, value in serve.items():
    c.serve[key] = value
  return c


def _forward(tiny, params, hint, temperature):
  """The response's logprobs under the hinted prompt, by a plain teacher-forced forward."""
  prompt = chat_bytes(teacher_lib.hinted_messages(TURN["messages"], hint, FMT))
  response = TURN["completion_tokens"]
  lp = np.asarray(_logsoftmax(nnx.graphdef(tiny), params,
                              jnp.asarray([prompt + response], jnp.int32), temperature))[0]
  return lp[len(prompt) - 1:len(prompt) + len(response) - 1][np.arange(len(response)), response]


class _Engine:
  version = 0

  def __init__(self):
    self.handed = []

  def update_params(self, params, version):
    self.handed.append((params, version))


def test_the_judges_current_teacher_scores_with_each_version_serving_is_handed(monkeypatch):
  tiny = model()
  c = _config()
  config_lib.validate(c)
  monkeypatch.setattr(teacher_lib, "chat_encoder", lambda tokenizer, thinking: chat_bytes)
  assert teacher_lib.build(c, tiny, mesh(1), None, at="trainer") is None  # the judge runs it
  teacher = teacher_lib.build(c, tiny, mesh(1), None, at="judge")
  assert teacher.current
  start = nnx.to_pure_dict(nnx.state(tiny, nnx.Param))
  # before any version: the weights serving starts on
  first = teacher.score([(TURN, "multiply first")])[0]["logprobs"]
  t = c.rollout.temperature
  assert np.allclose(first, _forward(tiny, start, "multiply first", t), atol=1e-4)
  engine = _Engine()
  serving = teacher_lib.FollowingEngine(engine, teacher)
  moved = jax.tree.map(lambda x: x * 1.5, start)  # version 1, as a publisher hands it over
  serving.update_params(moved, 1)
  assert engine.handed == [(moved, 1)] and serving.version == 0  # the rest passes through
  got = teacher.score([(TURN, "multiply first")])[0]["logprobs"]
  assert np.allclose(got, _forward(tiny, moved, "multiply first", t), atol=1e-4)
  assert not np.allclose(got, first, atol=1e-3)


@pytest.mark.parametrize("keys, message", [
    (dict(teacher_url="http://127.0.0.1:1/v1"), "teacher_url=''"),
    (dict(teacher_at="trainer", teacher_url="http://127.0.0.1:1/v1"), "teacher_url=''"),
])
def test_a_current_teacher_is_the_in_process_one(keys, message):
  with pytest.raises(ValueError, match=message):
    config_lib.validate(_config(**keys))


def test_a_current_teacher_at_the_judge_takes_full_weights_not_adapters():
  c = _config()
  c.actor.lora.rank = 4
  with pytest.raises(ValueError, match="teacher_at='trainer'"):
    config_lib.validate(c)
  c.serve.teacher_at = "trainer"  # the learner merges them
  config_lib.validate(c)


class _Scorer:
  """A teacher without a forward: -1 a token; records the turns it was asked for."""
  current = False

  def __init__(self):
    self.asked = []

  def score(self, items):
    self.asked += [turn["id"] for turn, _ in items]
    return [{"logprobs": [-1.0] * len(turn["completion_tokens"])} for turn, _ in items]


def _session(store, name, version, reply):
  """A session: an answer written at policy ``version``, then the user's reply (its last turn)."""
  q = [{"role": "user", "content": "What is 7 * 8 + 3?"}]
  ids = []
  for i, (messages, answer) in enumerate([(q, "62"), (q + [{"role": "assistant", "content": "62"},
                                                          {"role": "user", "content": reply}],
                                                      "ok")]):
    row = dict(request_id=f"{name}-{i}", messages=messages, prompt_tokens=[1, 2],
               completion_tokens=[3, 4, 5], logprobs=[-1.0] * 3, versions=[version] * 3,
               completion_text=answer, finish_reason="eos", temperature=1.0, created_s=1000.0)
    ids.append(store.add_turns(name, [row], None, "main", i == 1)[0][0])
  return ids[0]


def test_while_training_the_judges_teacher_scores_only_the_trainers_next_batch(tmp_path):
  """``TeacherStage(ahead=...)``: of the hinted turns, only those among the next batch the trainer
  takes (oldest first, still fresh enough at the version after serving's) get a forward; a turn too
  old to train never does, and the next ones are scored once the trainer has taken those."""
  from areal_jax.serve import judge as judge_lib
  from areal_jax.serve.store import TurnStore, skip_reason

  store, scorer, version = TurnStore(str(tmp_path / "t.sqlite")), _Scorer(), [5]
  teach = "that's wrong. Multiply 7 by 8 first, then add 3."
  old = _session(store, "old", 0, teach)  # 5 + 1 - 0 > serve.max_staleness 4: never trains
  right = _session(store, "right", 2, "right")  # judged on its score: in the batch, no forward
  hinted = [_session(store, f"s{i}", 2 + i // 3, teach) for i in range(6)]
  trainable = lambda row: skip_reason(row, version[0] + 1, 4, 1.0) is None  # noqa: E731
  loop = judge_lib.JudgeLoop(store, judge_lib.RuleJudge(judge_lib.Hints("[HINT]", "[/HINT]", 12)),
                             signal="combined", teacher=scorer, ahead=(4, trainable))
  loop.run_once(now=2000.0)
  assert scorer.asked == hinted[:3]  # the next batch of 4: right + 3 hinted
  assert old not in scorer.asked and right not in scorer.asked
  loop.run_once(now=2000.0)
  assert scorer.asked == hinted[:3]  # nothing more until the trainer takes them
  store.mark([right] + hinted[:3], "trained", 6)
  loop.run_once(now=2000.0)
  assert scorer.asked == hinted[:3] + hinted[3:]  # the next ones, oldest first
  assert {r["id"] for r in store.hinted(10)} == {old}  # left for the trainer to count stale
