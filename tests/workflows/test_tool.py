"""The calculator tool: a call cuts the turn, the result is context, the model continues."""

import pathlib
import sys

import pytest

from areal_jax import tasks
from areal_jax.rollout_api import SamplingParams
from areal_jax.workflows import Context, ToolUse, tool

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from workflow_helpers import EOS, TOK, ScriptedClient  # noqa: E402

TASK = tasks.get_task({"name": "arithmetic", "num_train": 4, "num_test": 2})
EXAMPLE = {"id": "x", "question": "Ben has 3 boxes of 4 pencils and 1 more. How many?",
           "answer": "3 * 4 + 1 = 13\n#### 13"}


def run(script, max_turns=4, max_prompt_len=4096):
  client = ScriptedClient(script)
  ep = ToolUse(max_turns).run(EXAMPLE, Context(TASK, TOK, TASK.reward, max_prompt_len), client,
                              SamplingParams())
  return ep, client


def test_call_result_and_final_answer():
  call = "Count: <calc>3*4+1</calc>"
  ep, client = run([(call + " and then rambling", "length", 0), (" so \\boxed{13}", "eos", 1)])
  s = ep.sample
  t1 = TOK.encode(call)  # the tokens sampled after the call are dropped
  res = TOK.encode("<result>13</result>")
  t2 = TOK.encode(" so \\boxed{13}") + [EOS]
  assert s.tokens == t1 + res + t2
  assert s.loss_mask == [1] * len(t1) + [0] * len(res) + [1] * len(t2)
  assert s.logprobs[:len(t1)] == [-1 - j / 100 for j in range(len(t1))]
  assert s.logprobs[len(t1):len(t1) + len(res)] == [0.0] * len(res)
  assert s.versions == [0] * (len(t1) + len(res)) + [1] * len(t2)
  assert client.prompts[1] == TASK.prompt_ids(EXAMPLE, TOK) + t1 + res
  assert ep.reward == 1.0 and ep.turns == 2 and ep.sample.metadata["calls"] == 1


def test_bad_expression_returns_an_error_result_and_max_turns_ends():
  ep, client = run([("<calc>__import__('os')</calc>", "stop", 0), ("<calc>1/0</calc>", "stop", 0)],
                   max_turns=2)
  inserted = TOK.decode([t for t, m in zip(ep.sample.tokens, ep.sample.loss_mask) if m == 0])
  assert inserted.startswith("<result>error: Call is not allowed")
  assert ep.turns == 2 and ep.end == "max_turns" and ep.reward == 0.0
  assert len(client.prompts) == 2


def test_no_call_is_the_final_answer():
  ep, _ = run([("\\boxed{12}", "eos", 0)])
  assert ep.turns == 1 and ep.reward == 0.0 and ep.end == "answered"


def test_cut_after_call_is_the_shortest_prefix():
  tokens = TOK.encode("x <calc>1+1</calc> tail")
  cut = tool.cut_after_call(TOK, tokens)
  assert TOK.decode(tokens[:cut]) == "x <calc>1+1</calc>"
  assert tool.cut_after_call(TOK, TOK.encode("<calc>1+1")) is None
