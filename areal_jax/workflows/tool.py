"""Tool use: the policy calls a calculator by writing ``<calc>EXPRESSION</calc>``.

Each turn generates until the model stops or closes a call. If the turn's text contains
``</calc>``, the turn is cut right after the token that completed it (the tokens sampled past it
are dropped: the model would have seen the result instead), the expression is evaluated by the
safe evaluator (``calculator.py``) and ``<result>VALUE</result>`` (or ``<result>error:
REASON</result>``) is appended as context tokens (mask 0); the model then continues the same
answer. A turn without a call is the final answer and ends the episode, as do ``max_turns`` calls
or a prompt that would no longer fit ``Context.max_prompt_len``.

Reward: the task's reward on the final turn's text (the answer after the last tool result).
"""

from __future__ import annotations

import re

from areal_jax.rollout_api import SamplingParams
from areal_jax.workflows import calculator
from areal_jax.workflows.base import Client, Context, Episode, Trajectory, Workflow, turn_params

OPEN, CLOSE = "<calc>", "</calc>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)
INSTRUCTION = ("You may use a calculator: write <calc>EXPRESSION</calc> (numbers and + - * / "
               "only) and the result follows as <result>VALUE</result>. Put your final answer "
               "within \\boxed{}.")


def first_call(text: str) -> str | None:
  """The expression of the first complete ``<calc>...</calc>`` call in ``text``, if any."""
  m = _CALL.search(text)
  return None if m is None else m.group(1)


def tool_result(expression: str) -> str:
  """The text appended after a call: ``<result>VALUE</result>`` or ``<result>error: ...</result>``."""
  try:
    value = calculator.format_value(calculator.evaluate(expression))
  except calculator.CalcError as e:
    value = f"error: {e}"
  return f"<result>{value}</result>"


def cut_after_call(tokenizer, tokens: list[int], find=first_call) -> int | None:
  """The number of leading tokens whose text first contains a complete call, or None.
  ``find(text)`` is the call in a text or None (default: a calculator call)."""
  if find(tokenizer.decode(tokens)) is None:
    return None
  lo, hi = 1, len(tokens)  # the smallest prefix containing a call (a call stays once it appears)
  while lo < hi:
    mid = (lo + hi) // 2
    if find(tokenizer.decode(tokens[:mid])) is None:
      lo = mid + 1
    else:
      hi = mid
  return lo


class ToolUse(Workflow):

  name = "tool"

  def __init__(self, max_turns: int):
    if max_turns < 1:
      raise ValueError(f"rollout.max_turns={max_turns} must be >= 1")
    self.max_turns = int(max_turns)

  def run(self, example: dict, ctx: Context, client: Client, params: SamplingParams) -> Episode:
    traj = Trajectory(ctx.task.prompt_ids(example, ctx.tokenizer))
    turns, calls, end, text, finish = 0, 0, "answered", "", "stop"
    while True:
      sample = client.generate(traj.context, turn_params(params, turns))
      turns += 1
      if sample.finish_reason == "error":
        return traj.failed(sample, turns)
      cut = cut_after_call(ctx.tokenizer, sample.tokens)
      traj.add_turn(sample, keep=cut)
      kept = sample.tokens if cut is None else sample.tokens[:cut]
      text = ctx.tokenizer.decode(kept)
      finish = sample.finish_reason if cut is None else "stop"
      if cut is None:
        end = "answered"
        break
      calls += 1
      if turns >= self.max_turns:
        end = "max_turns"
        break
      insert = list(ctx.tokenizer.encode(tool_result(first_call(text))))
      if len(traj.context) + len(insert) > ctx.max_prompt_len:
        end = "context"
        break
      traj.add_context(insert, traj.last_version(default=0))
    reward = float(ctx.reward(text, example))
    meta = dict(turns=turns, end=end, calls=calls)
    return Episode(traj.sample(-1, -1, finish, metadata=meta), reward, reward > 0.5, turns, end)
