"""The calculator tool as an environment (``rollout.workflow="tool"`` plays the same game inline).

``step(text)`` evaluates the first ``<calc>EXPRESSION</calc>`` of the model's text with the safe
evaluator (``areal_jax.workflows.calculator``) and answers ``<result>VALUE</result>``; a text
without a call is the final answer: the episode is done and scored by ``reward(text, example)``
(default: the tasks' boxed-answer reward, ``areal_jax.tasks.reward.reward``). After ``max_calls``
calls the next text is final whatever it holds. Blocking and cheap: ``base.InProcessEnv`` runs it
in process, and it takes no arguments a pool worker could not build it with.
"""

from __future__ import annotations

from collections.abc import Callable

from areal_jax.workflows.tool import first_call, tool_result


def _task_reward(text: str, example: dict) -> float:
  from areal_jax.tasks.reward import reward  # imported at the first final answer only
  return float(reward(text, example))


class CalculatorEnv:

  def __init__(self, max_calls: int = 4, reward: Callable[[str, dict], float] | None = None):
    if max_calls < 0:
      raise ValueError(f"max_calls={max_calls} must be >= 0")
    self.max_calls, self.reward = int(max_calls), reward or _task_reward
    self.example: dict | None = None
    self.calls = 0

  def reset(self, example: dict) -> str:
    self.example, self.calls = example, 0
    return ""

  def step(self, action: str) -> tuple[str, float, bool, dict]:
    if self.example is None:
      raise RuntimeError("CalculatorEnv.step before reset")
    expression = first_call(action)
    if expression is None or self.calls >= self.max_calls:
      end = "answered" if expression is None else "max_turns"
      return "", float(self.reward(action, self.example)), True, dict(end=end, calls=self.calls)
    self.calls += 1
    return tool_result(expression), 0.0, False, dict(calls=self.calls)

  def close(self) -> None:
    self.example = None
