"""The OPD teacher's weights at the judge: with ``serve.teacher_weights = "current"`` it scores
with the version serving was last handed (``teacher.FollowingEngine``), from the start weights on.
(The teacher's forward itself, its batching and the trainer's teacher: test_opd.py.)"""

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
from learner_helpers import V, _logsoftmax, mesh, model  # noqa: E402

FMT = "{message}\n\nHint: {hint}"  # the config's serve.hint_format
TURN = {"messages": [{"role": "user", "content": "7 * 8 + 3?"}],
        "completion_tokens": [5, 9, 2, 30, 1]}


def _encode(messages):
  """A byte tokenizer of the conversation (vocabulary of the tiny model), with a turn marker."""
  text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
  return [b % V for b in text.encode()]


def _config(**serve):
  c = config_lib.load("configs/serve_arithmetic.py:tiny")
  c.unlock()
  c.serve.signal, c.serve.teacher_weights, c.serve.teacher_at = "opd", "current", "judge"
  for key, value in serve.items():
    c.serve[key] = value
  return c


def _forward(tiny, params, hint, temperature):
  """The response's logprobs under the hinted prompt, by a plain teacher-forced forward."""
  prompt = _encode(teacher_lib.hinted_messages(TURN["messages"], hint, FMT))
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
  monkeypatch.setattr(teacher_lib, "chat_encoder", lambda tokenizer, thinking: _encode)
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
