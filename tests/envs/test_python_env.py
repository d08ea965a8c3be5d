"""The Python tool as an environment: blocks found, programs run, the final text scored."""

import pytest

from areal_jax.envs import python_env
from areal_jax.envs.python_env import PythonEnv
from areal_jax.envs.python_sandbox import Limits, Result, Sandbox

EXAMPLE = {"id": "x", "question": "3 * 4 + 1?", "answer": "#### 13"}


@pytest.fixture(scope="module")
def box():
  s = Sandbox(Limits(wall_s=20.0, cpu_s=2))
  if not s.isolated:
    pytest.skip(f"no namespaces on this machine: {s.unavailable}")
  return s


def reward(text, example):
  return float("\\boxed{13}" in text)


@pytest.mark.parametrize("text,code", [
    ("x ```python\nprint(1)\n``` y", "print(1)\n"), ("```py\na = 2\n```", "a = 2\n"),
    ("```python\nprint(1)\n", None), ("```\nprint(1)\n```", None), ("no code", None),
    ("```python\nA\n``` ```python\nB\n```", "A\n")])
def test_find_block(text, code):
  assert python_env.find_block(text) == code


def test_observation_says_why_a_program_stopped():
  obs = python_env.observation
  assert obs(Result("13\n", "", "ok", 0), 5, 2) == "\n```output\n13\n```\n"
  assert obs(Result("", "Traceback...\nNameError: x", "error", 1), 5, 2) == \
      "\n```output\nNameError: x\n```\n"
  assert "ran past 5 s" in obs(Result("", "", "timeout", -9), 5, 2)
  assert obs(Result("part", "", "output_limit", -9, True), 5, 2).startswith(
      "\n```output\npart\nstopped: too much output")


def test_steps_run_programs_then_score_the_answer(box):
  env = PythonEnv(box, reward, max_calls=1)
  with pytest.raises(RuntimeError, match="before reset"):
    env.step("x")
  assert env.reset(EXAMPLE) == ""
  obs, r, done, info = env.step("Compute: ```python\nprint(3 * 4 + 1)\n```")
  assert (obs, r, done) == ("\n```output\n13\n```\n", 0.0, False)
  assert info["calls"] == 1 and info["reason"] == "ok"
  # Calls used up: the next text is final even with a block in it (not run).
  obs, r, done, info = env.step("```python\nprint(1)\n``` \\boxed{13}")
  assert (obs, r, done, info["end"], env.calls) == ("", 1.0, True, "max_turns", 1)
  env.reset(EXAMPLE)
  assert env.step("\\boxed{12}")[1:3] == (0.0, True) and env.calls == 0
  env.close()
