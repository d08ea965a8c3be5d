"""Program-aided answers: the policy writes Python, a sandbox runs it, the output comes back.

Each turn generates until the model stops or closes a Python block (three backticks and
``python``, the code, three backticks; ``areal_jax.envs.python_env``). If the turn's text holds a
complete block, the turn is cut right after the token that closed it (the tokens sampled past it
are dropped), the program runs in the ``Sandbox`` (``areal_jax.envs.python_sandbox``: its own
namespaces, resource limits, killed with its process group) and its output, fenced as
``output``, is appended as context tokens (mask 0); the model then continues the same answer. A
turn without a block is the final answer and ends the episode, as do ``max_turns`` turns (the
last one's program is not run) or a prompt that would no longer fit ``Context.max_prompt_len``.

Reward: the task's reward on the final turn's text, as with the calculator (``tool.py``).
The episode's ``sample.metadata`` counts the programs run (``calls``) and those that did not end
"ok" (``call_failures``).
"""

from __future__ import annotations

import time

from areal_jax.envs.python_env import PythonEnv, find_block
from areal_jax.envs.python_sandbox import Sandbox
from areal_jax.rollout_api import SamplingParams
from areal_jax.workflows.base import Client, Context, Episode, Trajectory, Workflow, turn_params
from areal_jax.workflows.tool import cut_after_call


class PythonTool(Workflow):

  name = "python_tool"

  def __init__(self, max_turns: int, sandbox: Sandbox):
    if max_turns < 1:
      raise ValueError(f"rollout.max_turns={max_turns} must be >= 1")
    sandbox.check()  # no isolation and no opt-in: refuse now, at start, not in every episode
    self.max_turns, self.sandbox = int(max_turns), sandbox

  def run(self, example: dict, ctx: Context, client: Client, params: SamplingParams) -> Episode:
    env = PythonEnv(self.sandbox, ctx.reward, max_calls=self.max_turns - 1)
    env.reset(example)
    traj = Trajectory(ctx.task.prompt_ids(example, ctx.tokenizer))
    turns, end, finish, reward = 0, "answered", "stop", 0.0
    try:
      while True:
        sample = client.generate(traj.context, turn_params(params, turns))
        turns += 1
        if sample.finish_reason == "error":
          return traj.failed(sample, turns)
        cut = cut_after_call(ctx.tokenizer, sample.tokens, find_block)
        traj.add_turn(sample, keep=cut)
        text = ctx.tokenizer.decode(sample.tokens if cut is None else sample.tokens[:cut])
        finish = sample.finish_reason if cut is None else "stop"
        t0 = time.monotonic()
        obs, reward, done, info = env.step(text)
        if not done:  # a program ran (how it ended is the model's doing, not an env failure)
          ctx.report_env(time.monotonic() - t0, None)
        if done:
          end = info["end"]
          break
        insert = list(ctx.tokenizer.encode(obs))
        if len(traj.context) + len(insert) > ctx.max_prompt_len:
          end, reward = "context", float(ctx.reward(text, example))
          break
        traj.add_context(insert, traj.last_version(default=0))
    finally:
      env.close()
    failures = sum(r != "ok" for r in env.reasons)
    meta = dict(turns=turns, end=end, calls=env.calls, call_failures=failures)
    return Episode(traj.sample(-1, -1, finish, metadata=meta), reward, reward > 0.5, turns, end)
