"""A generic environment episode (``rollout.workflow="env"``): the policy acts, the environment
answers, for up to ``max_turns`` turns.

The environment comes from ``rollout.env`` (``areal_jax.envs.factory``: in process, a pool of
worker processes, or a server over HTTP) and follows ``areal_jax.envs.base.Env``. The episode:
``reset(example)``; then each turn the policy generates, the turn's whole text is the action of
``step``, and the observation's tokens (``tokenizer.encode``, as they are) follow as environment
tokens (mask 0, ``workflows.base`` trajectory layout) before the next turn; the reset's
observation, before any policy token, carries the first turn's policy version. It ends when the
environment says done (``end`` is its ``info["end"]`` if a string, else "done"), after
``max_turns`` turns ("max_turns"), when the next prompt would not fit ``Context.max_prompt_len``
("context"), or on an engine error ("error").

Reward: the sum of the environment's rewards. An environment call that fails (``EnvError``) ends
the episode with reward 0 and ``end="env_<kind>"`` (kind: timeout, crashed, garbage, too_large),
the trajectory so far kept as the sample; the run goes on. Every ``reset`` and ``step`` is timed
and reported with its failure kind (``Context.report_env``), the wait for a pool's place
(``Env.acquire``) not included; the environment is always closed.
"""

from __future__ import annotations

import time

from areal_jax.envs.base import EnvError
from areal_jax.envs.factory import EnvSettings, open_envs
from areal_jax.rollout_api import SamplingParams
from areal_jax.workflows.base import Context, Episode, Trajectory, Workflow, turn_params


async def _timed(ctx: Context, call):
  """Awaits an environment call, reporting its wall time and its failure kind, if any."""
  t0 = time.monotonic()
  try:
    result = await call
  except EnvError as e:
    ctx.report_env(time.monotonic() - t0, e.kind)
    raise
  ctx.report_env(time.monotonic() - t0, None)
  return result


class EnvEpisode(Workflow):

  name = "env"

  def __init__(self, envs, max_turns: int):
    if max_turns < 1:
      raise ValueError(f"rollout.max_turns={max_turns} must be >= 1")
    self.envs, self.max_turns = envs, int(max_turns)

  @classmethod
  def from_config(cls, config=None) -> EnvEpisode:
    """The workflow with ``rollout.env`` and ``rollout.max_turns`` of ``config``."""
    max_turns = 1 if config is None else int(config.rollout.max_turns)
    return cls(open_envs(EnvSettings.from_config(config)), max_turns)

  def close(self) -> None:
    """Stops what the environments hold (a pool's worker processes)."""
    self.envs.close()

  async def run(self, example: dict, ctx: Context, client, params: SamplingParams) -> Episode:
    traj = Trajectory(ctx.task.prompt_ids(example, ctx.tokenizer))
    turns, reward, end, finish, error = 0, 0.0, "max_turns", "stop", None
    env = None
    try:
      env = self.envs.env()
      await env.acquire()  # a pool's place: back-pressure, not the environment's latency
      obs = await _timed(ctx, env.reset(example))
      while True:
        if obs:
          insert = list(ctx.tokenizer.encode(obs))
          if len(traj.context) + len(insert) > ctx.max_prompt_len:
            end = "context"
            break
          traj.add_context(insert, traj.last_version(default=0))
        sample = await client.generate(traj.context, turn_params(params, turns))
        turns += 1
        if sample.finish_reason == "error":
          return traj.failed(sample, turns)
        if turns == 1 and traj.tokens and sample.versions:
          # The reset's observation came before any policy token: it takes the first turn's
          # version (not 0), so min(versions) stays the oldest policy token's.
          traj.versions = [int(sample.versions[0])] * len(traj.tokens)
        traj.add_turn(sample)
        finish = sample.finish_reason
        obs, r, done, info = await _timed(ctx, env.step(ctx.tokenizer.decode(sample.tokens)))
        reward += r
        if done:
          end = info.get("end") if isinstance(info.get("end"), str) else "done"
          break
        if turns >= self.max_turns:
          end = "max_turns"
          break
    except EnvError as e:
      reward, end, error = 0.0, f"env_{e.kind}", e.message
    finally:
      if env is not None:
        await env.close()
    meta = dict(turns=turns, end=end)
    sample = traj.sample(-1, -1, finish, error=error, metadata=meta)
    return Episode(sample, reward, reward > 0.5, turns, end)
