"""The Python tool as an environment: the model's Python blocks run in the sandbox.

A program is a fenced block in the model's text, ``CALL_OPEN`` (three backticks and ``python``,
or ``py``, then a newline) up to the next three backticks. ``step(text)`` runs the first block of
the text in the ``Sandbox`` and returns its output as the observation, fenced as ``output``;
a text without a block is the final answer: the episode is done and scored by the task's reward.
After ``max_calls`` programs the next text is final whatever it holds.

The interface is the one every environment of ``areal_jax.envs`` follows: ``reset(example) ->
observation``, ``step(action) -> (observation, reward, done, info)``, ``close()``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from areal_jax.envs.python_sandbox import Result, Sandbox

_BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.S)
CALL_OPEN = "```python\n"
INSTRUCTION = ("You may run Python: write a program in a ```python block; what it prints "
               "follows in an ```output block. Put your final answer within \\boxed{}.")


def find_block(text: str) -> str | None:
  """The code of the first complete Python block in ``text``, if any."""
  m = _BLOCK.search(text)
  return None if m is None else m.group(1)


def observation(result: Result, wall_s: float, cpu_s: float) -> str:
  """What the model reads after its program: the output kept, and why it stopped if it failed."""
  text = result.stdout.rstrip("\n")
  note = {"timeout": f"stopped: ran past {wall_s:g} s",
          "cpu_limit": f"stopped: used {cpu_s:g} s of CPU",
          "output_limit": "stopped: too much output",
          "sandbox_error": "the sandbox failed"}.get(result.reason)
  if note is None and not result.ok:  # the program failed: the last line of its traceback
    note = (result.stderr.strip().splitlines() or [f"exit status {result.exit_code}"])[-1]
  if note:
    text = f"{text}\n{note}" if text else note
  return f"\n```output\n{text}\n```\n"


class PythonEnv:
  """One episode with the Python tool. ``reward(text, example) -> float`` scores the final text."""

  def __init__(self, sandbox: Sandbox, reward: Callable[[str, dict], float], max_calls: int):
    if max_calls < 0:
      raise ValueError(f"max_calls={max_calls} must be >= 0")
    self.sandbox, self.reward, self.max_calls = sandbox, reward, int(max_calls)
    self.example: dict | None = None
    self.calls = 0
    self.reasons: list[str] = []

  def reset(self, example: dict) -> str:
    """Starts an episode of ``example``; the first observation is empty (the task's prompt is)."""
    self.example, self.calls, self.reasons = example, 0, []
    return ""

  def step(self, action: str) -> tuple[str, float, bool, dict]:
    """Runs the program in ``action`` (the model's turn), or scores it if it is the final one."""
    if self.example is None:
      raise RuntimeError("PythonEnv.step before reset")
    code = find_block(action)
    if code is None or self.calls >= self.max_calls:
      end = "answered" if code is None else "max_turns"
      return "", float(self.reward(action, self.example)), True, dict(end=end, calls=self.calls)
    result = self.sandbox.run(code)
    self.calls += 1
    self.reasons.append(result.reason)
    lim = self.sandbox.limits
    info = dict(calls=self.calls, reason=result.reason, wall_s=result.wall_s)
    return observation(result, lim.wall_s, lim.cpu_s), 0.0, False, info

  def close(self) -> None:
    """Nothing is held between calls: every program ran in a process of its own, now gone."""
