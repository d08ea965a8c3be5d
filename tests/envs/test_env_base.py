"""The awaitable environment interface in process: blocking environments off the event loop,
their failures mapped to the four kinds, the calculator and the Python tool behind it."""

import asyncio
import threading

import pytest

from areal_jax.envs import base
from areal_jax.envs.base import EnvError, InProcessEnv, InProcessEnvs
from areal_jax.envs.calculator import CalculatorEnv
from areal_jax.envs.python_env import PythonEnv
from areal_jax.envs.synthetic import AsyncSyntheticEnv, SyntheticEnv

GUARD_S = 30  # a stalled test fails here instead of hanging the suite


def run(coro):
  return asyncio.run(asyncio.wait_for(coro, GUARD_S))


class WaitsForTheLoop:
  """Its step blocks until the event loop, meanwhile free, sets the flag."""

  def __init__(self):
    self.flag = threading.Event()

  def reset(self, example):
    return ""

  def step(self, action):
    assert self.flag.wait(GUARD_S), "the event loop was blocked"
    return "ok", 1.0, True, {}


def test_a_blocking_environment_never_holds_the_event_loop():
  async def main():
    inner = WaitsForTheLoop()
    env = InProcessEnv(inner, timeout_s=GUARD_S)
    step = asyncio.ensure_future(env.step("a"))
    await asyncio.sleep(0.01)
    inner.flag.set()  # runs only because the loop is free while the step blocks
    return await step
  assert run(main()) == ("ok", 1.0, True, {})


@pytest.mark.parametrize("cls", [SyntheticEnv, AsyncSyntheticEnv])
def test_episode_through_the_interface(cls):
  async def main():
    env = InProcessEnv(cls(turns=2))
    obs0 = await env.reset({})
    steps = [await env.step("a"), await env.step("b")]
    await env.close()
    return obs0, steps
  obs0, steps = run(main())
  assert obs0 == "obs 0"
  assert steps == [("obs 1", 0.0, False, {"t": 1}), ("obs 2", 1.0, True, {"t": 2})]


@pytest.mark.parametrize("fault,kind", [("hang", "timeout"), ("raise", "crashed"),
                                        ("garbage", "garbage"), ("huge", "too_large")])
@pytest.mark.parametrize("cls", [SyntheticEnv, AsyncSyntheticEnv])
def test_faults_end_the_call_with_their_kind(cls, fault, kind):
  async def main():
    env = InProcessEnv(cls(hang_s=0.5, huge_bytes=10 * 1024 * 1024), timeout_s=0.1,
                       max_response_bytes=1 << 20)
    await env.reset({})
    with pytest.raises(EnvError) as e:
      await env.step(f"fault:{fault}")
    await env.close()
    return e.value
  assert run(main()).kind == kind


def test_validation_names_the_problem():
  with pytest.raises(EnvError, match="garbage: observation is a int"):
    base.check_observation(3, 100)
  with pytest.raises(EnvError, match="reward nan"):
    base.check_step(("o", float("nan"), False, {}), 100)
  with pytest.raises(EnvError, match="done 1 is not a bool"):
    base.check_step(("o", 0.0, 1, {}), 100)
  with pytest.raises(EnvError, match="too_large"):
    base.check_step(("é" * 60, 0.0, False, {}), 100)  # 120 bytes of UTF-8
  with pytest.raises(ValueError, match="must be 'package.module:Class'"):
    base.load_class("areal_jax.envs.synthetic.SyntheticEnv")
  with pytest.raises(ValueError, match="cannot be loaded"):
    base.load_class("areal_jax.envs.synthetic:Nope")
  with pytest.raises(ValueError, match="must be a JSON object"):
    base.parse_args("[1]")
  with pytest.raises(ValueError, match="not one of"):
    EnvError("oops", "x")


def test_provider_builds_each_episode_its_own_environment():
  envs = InProcessEnvs("areal_jax.envs.synthetic:SyntheticEnv", '{"turns": 1}', threads=1)
  try:
    a, b = envs.env(), envs.env()
    assert a.env is not b.env and a.env.turns == 1
    with pytest.raises(EnvError, match="crashed: SyntheticEnv"):
      InProcessEnvs(SyntheticEnv, {"nope": 1}).env()
  finally:
    envs.close()


EXAMPLE = {"id": "x", "question": "3 * 4 + 1?", "answer": "#### 13"}


def test_the_calculator_fits_the_interface():
  async def main():
    env = InProcessEnv(CalculatorEnv(max_calls=1))
    assert await env.reset(EXAMPLE) == ""
    first = await env.step("so <calc>3*4 + 1</calc>")
    last = await env.step("<calc>1+1</calc> \\boxed{13}")  # calls used up: final
    return first, last
  first, last = run(main())
  assert first == ("<result>13</result>", 0.0, False, {"calls": 1})
  assert last == ("", 1.0, True, {"end": "max_turns", "calls": 1})


def test_the_python_tool_fits_the_interface():
  class NoSandbox:  # the final answer needs no program run
    def run(self, code):
      raise AssertionError("no program here")

  async def main():
    env = InProcessEnv(PythonEnv(NoSandbox(), lambda t, e: float("13" in t), max_calls=2))
    await env.reset(EXAMPLE)
    return await env.step("It is \\boxed{13}")
  assert run(main()) == ("", 1.0, True, {"end": "answered", "calls": 0})
