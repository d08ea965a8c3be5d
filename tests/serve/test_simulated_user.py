"""Simulated users check each answer as a person would: the task's reward, except that an answer
cut off at its token limit is wrong whatever number it stops on (serve.sim_cut_off_wrong). The
client is a stand-in that records the requests: no server, no model."""

import types

import pytest

from areal_jax import config as config_lib
from areal_jax.serve import simulated_user
from areal_jax.tasks import reward as reward_lib


class FakeCompletions:
  """``chat.completions.create``: the first request of a conversation gets ``answer`` with
  ``finish``; every request is recorded."""

  def __init__(self, answer: str, finish: str):
    self.answer, self.finish, self.requests = answer, finish, []

  def create(self, **request):
    self.requests.append(request)
    content, finish = (self.answer, self.finish) if len(self.requests) % 2 else ("ok", "stop")
    choice = types.SimpleNamespace(message=types.SimpleNamespace(content=content),
                                   finish_reason=finish)
    return types.SimpleNamespace(choices=[choice], policy_versions=[0])


def users_answered(answer: str, finish: str, cut_off_wrong: bool, feedback: str = "verdict"):
  config = config_lib.load("configs/serve_arithmetic.py:tiny")
  config.unlock()
  config.serve.sim_cut_off_wrong = cut_off_wrong
  config.serve.sim_feedback = feedback
  config.lock()
  users = simulated_user.SimulatedUsers(config, "http://127.0.0.1:1/v1")
  example = users.examples[0]
  users.examples = [example]  # every conversation asks this one
  fake = FakeCompletions(answer.format(n=reward_lib.reference_answer(example["answer"])), finish)
  users.client = types.SimpleNamespace(chat=types.SimpleNamespace(completions=fake))
  return users.converse(), fake.requests


@pytest.mark.parametrize("finish,cut_off_wrong,right", [
    ("stop", True, True),  # finished, ends on the answer: right
    ("length", True, False),  # cut off at the limit: wrong, whatever number it stops on
    ("length", False, True),  # the task's reward alone: its last number
])
def test_a_cut_off_answer_is_wrong_unless_the_user_reads_only_the_reward(finish, cut_off_wrong,
                                                                         right):
  out, requests = users_answered("1. First step: 2 + 3 = 5. 2. Then {n}", finish, cut_off_wrong)
  assert out["right"] is right and out["cut_off"] is (finish == "length")
  reply = requests[1]["messages"][-1]["content"]
  assert reply in (simulated_user.POSITIVE if right else simulated_user.NEGATIVE)
  assert requests[1]["extra_headers"]["X-Session-Done"] == "true"


def test_a_cut_off_answer_is_taught_like_a_wrong_one():
  """With serve.sim_feedback = both, the user who calls a cut-off answer wrong also says the way."""
  out, requests = users_answered("The answer is {n}", "length", True, feedback="both")
  reply = requests[1]["messages"][-1]["content"]
  assert not out["right"] and "So the answer is" in reply
  assert reply.split(".")[0] in simulated_user.NEGATIVE
