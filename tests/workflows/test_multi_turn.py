"""Multi-turn feedback episodes on a scripted engine: exact tokens, masks, logprobs, versions,
the next turn's prompt, and the discounted reward."""

import pathlib
import sys

import pytest

from areal_jax import tasks
from areal_jax.rollout_api import SamplingParams
from areal_jax.workflows import Context, MultiTurn, chat, get, multi_turn

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from workflow_helpers import EOS, TOK, ScriptedClient  # noqa: E402

TASK = tasks.get_task({"name": "arithmetic", "num_train": 4, "num_test": 2})
EXAMPLE = {"id": "x", "question": "Ava has 3 apples and finds 4 more. How many now?",
           "answer": "3 + 4 = 7\n#### 7"}


def ctx(max_prompt_len=4096):
  return Context(TASK, TOK, TASK.reward, max_prompt_len)


def feedback(last):
  return chat.user_turn_tokens(TASK, TOK, EXAMPLE, multi_turn.FEEDBACK, last)


def test_wrong_then_right_masks_versions_logprobs_and_reward_are_exact():
  wrong = "It is \\boxed{6}"
  n1 = len(TOK.encode(wrong)) + 1
  # a weight swap inside turn 1 (tokens 0..4 by version 3, the rest by 4) and one before turn 2
  client = ScriptedClient([(wrong, "eos", [3] * 5 + [4] * (n1 - 5)), ("So \\boxed{7}", "eos", 5)])
  ep = MultiTurn(max_turns=3, turn_discount=0.8).run(EXAMPLE, ctx(), client, SamplingParams(seed=11))
  s = ep.sample
  prompt = TASK.prompt_ids(EXAMPLE, TOK)
  t1, t2 = TOK.encode(wrong) + [EOS], TOK.encode("So \\boxed{7}") + [EOS]
  fb = feedback(EOS)
  assert TOK.decode(fb, skip_special_tokens=False).startswith("\n<|im_start|>user\nYour answer")
  assert TOK.decode(fb, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
  assert s.prompt_tokens == prompt
  assert s.tokens == t1 + fb + t2
  assert s.loss_mask == [1] * len(t1) + [0] * len(fb) + [1] * len(t2)
  assert s.versions == [3] * 5 + [4] * (n1 - 5) + [4] * len(fb) + [5] * len(t2)
  assert min(s.versions) == 3  # the oldest policy token
  assert s.logprobs == ([-1 - j / 100 for j in range(len(t1))] + [0.0] * len(fb)
                        + [-2 - j / 100 for j in range(len(t2))])
  # turn 2 continues the conversation exactly; each turn has a seed of its own
  assert client.prompts == [prompt, prompt + t1 + fb]
  assert client.params[0].seed == 11 and client.params[1].seed != 11
  assert ep.turns == 2 and ep.correct and ep.end == "answered"
  assert ep.reward == pytest.approx(0.8)
  assert s.finish_reason == "eos"


def test_right_first_time_is_one_turn_with_full_reward():
  ep = MultiTurn(3, 0.5).run(EXAMPLE, ctx(), ScriptedClient([("\\boxed{7}", "eos", 0)]),
                             SamplingParams())
  assert ep.reward == 1.0 and ep.turns == 1 and ep.sample.loss_mask == [1] * len(ep.sample.tokens)


def test_all_wrong_uses_every_turn_and_scores_zero():
  script = [("\\boxed{1}", "eos", 0), ("\\boxed{2}", "length", 1), ("\\boxed{3}", "eos", 1)]
  client = ScriptedClient(script)
  ep = MultiTurn(3, 0.9).run(EXAMPLE, ctx(), client, SamplingParams())
  assert ep.turns == 3 and ep.reward == 0.0 and not ep.correct and ep.end == "max_turns"
  # a turn cut off by the budget (no EOS) gets the end-of-turn marker inserted before the feedback
  t1, t2 = TOK.encode("\\boxed{1}") + [EOS], TOK.encode("\\boxed{2}")
  fb1, fb2 = feedback(EOS), feedback(None)
  assert fb2 == [EOS] + fb1
  assert client.prompts[2] == TASK.prompt_ids(EXAMPLE, TOK) + t1 + fb1 + t2 + fb2
  assert sum(ep.sample.loss_mask) == len(t1) + len(t2) + len(TOK.encode("\\boxed{3}")) + 1


def test_a_conversation_that_outgrows_the_prompt_budget_ends():
  prompt = TASK.prompt_ids(EXAMPLE, TOK)
  client = ScriptedClient([("\\boxed{1}", "eos", 0), ("\\boxed{7}", "eos", 0)])
  ep = MultiTurn(3).run(EXAMPLE, ctx(max_prompt_len=len(prompt) + 20), client, SamplingParams())
  assert ep.turns == 1 and ep.end == "context" and ep.reward == 0.0
  assert ep.sample.loss_mask == [1] * len(ep.sample.tokens)  # nothing inserted after the end


def test_an_engine_error_ends_the_episode_as_an_error():
  client = ScriptedClient([("\\boxed{1}", "eos", 0), ("", "error", 0)])
  ep = MultiTurn(3).run(EXAMPLE, ctx(), client, SamplingParams())
  assert ep.end == "error" and ep.sample.finish_reason == "error" and ep.reward == 0.0
  assert ep.sample.error == "scripted failure"


def test_get_and_bad_settings():
  assert get("single_turn").name == "single_turn"
  with pytest.raises(ValueError, match="rollout.workflow"):
    get("chat")
  with pytest.raises(ValueError, match="rollout.max_turns"):
    MultiTurn(0)
  with pytest.raises(ValueError, match="rollout.turn_discount"):
    MultiTurn(2, 1.5)


def test_single_turn_episode_is_the_plain_sample():
  client = ScriptedClient([("\\boxed{7}", "eos", 2)])
  ep = get("single_turn").run(EXAMPLE, ctx(), client, SamplingParams(seed=5))
  assert ep.reward == 1.0 and ep.sample.loss_mask is None and client.params[0].seed == 5


def test_without_chat_template_messages_are_blank_line_separated():
  task = tasks.get_task({"name": "arithmetic", "num_train": 4, "num_test": 2,
                         "use_chat_template": False})
  client = ScriptedClient([("\\boxed{1}", "eos", 0), ("\\boxed{7}", "eos", 0)])
  ep = MultiTurn(2).run(EXAMPLE, Context(task, TOK, task.reward, 4096), client, SamplingParams())
  inserted = [t for t, m in zip(ep.sample.tokens, ep.sample.loss_mask) if m == 0]
  assert TOK.decode(inserted) == f"\n\n{multi_turn.FEEDBACK}\n" and ep.correct
