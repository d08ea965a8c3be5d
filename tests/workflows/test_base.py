"""The workflow interface's async side: ``is_async`` and ``Context.areward`` off the event loop."""

import asyncio
import threading

from areal_jax.workflows import base


class Blocking(base.Workflow):
  def run(self, example, ctx, client, params):
    raise NotImplementedError


class Async(base.Workflow):
  async def run(self, example, ctx, client, params):
    raise NotImplementedError


def test_is_async_tells_coroutine_workflows_apart():
  assert base.is_async(Async()) and not base.is_async(Blocking())


def test_areward_runs_the_blocking_reward_on_another_thread():
  threads = []

  def reward(text, example):
    threads.append(threading.current_thread())
    return 1.0 if text == example["answer"] else 0.0

  ctx = base.Context(None, None, reward, 16)
  ctx.report_env(0.5, "timeout")  # outside a run: a no-op

  async def episode():
    return threading.current_thread(), await ctx.areward("4", {"answer": "4"})

  loop_thread, value = asyncio.run(episode())
  assert value == 1.0 and threads and threads[0] is not loop_thread
