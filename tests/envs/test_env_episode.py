"""The generic environment workflow: the trajectory layout, and an environment failure ends its
episode with a reason (reported, counted) while the run goes on."""

import asyncio

import pytest

from areal_jax import config as config_lib
from areal_jax.envs.base import InProcessEnvs
from areal_jax.envs.pool import EnvPool
from areal_jax.envs.remote import RemoteEnvs
from areal_jax.rollout_api import Sample, SamplingParams
from areal_jax.workflows.base import Context
from areal_jax.workflows.env_episode import EnvEpisode

SYNTHETIC = "areal_jax.envs.synthetic:SyntheticEnv"
GUARD_S = 60


class Bytes:
  """A byte-level tokenizer: enough for the trajectory layout."""

  def encode(self, text):
    return list(text.encode())

  def decode(self, tokens):
    return bytes(tokens).decode(errors="replace")


class Task:
  def prompt_ids(self, example, tokenizer):
    return tokenizer.encode("Q?")


class Client:
  """Turn k answers ``texts[k]`` with policy version k + 1."""

  def __init__(self, texts):
    self.texts, self.prompts = list(texts), []

  async def generate(self, prompt_tokens, params):
    k = len(self.prompts)
    self.prompts.append(list(prompt_tokens))
    tokens = list(self.texts[k].encode())
    return Sample(0, 0, list(prompt_tokens), tokens, [-0.5] * len(tokens), [k + 1] * len(tokens),
                  "stop")


def context(reports, max_prompt_len=4096):
  return Context(Task(), Bytes(), lambda t, e: 0.0, max_prompt_len,
                 report_env=lambda s, kind: reports.append(kind))


def play(workflow, texts, reports, example=None, **kw):
  client = Client(texts)
  run = workflow.run(example or {}, context(reports, **kw), client, SamplingParams(seed=3))
  return asyncio.run(asyncio.wait_for(run, GUARD_S)), client


@pytest.fixture(scope="module")
def inprocess():
  envs = InProcessEnvs(SYNTHETIC, {"turns": 2}, threads=1)
  yield EnvEpisode(envs, max_turns=4)
  envs.close()


def test_observations_are_environment_tokens_between_turns(inprocess):
  reports = []
  ep, client = play(inprocess, ["ab", "cd"], reports)
  s = ep.sample
  assert (ep.end, ep.turns, ep.reward, ep.correct) == ("done", 2, 1.0, True)
  assert bytes(s.prompt_tokens) == b"Q?"
  assert bytes(s.tokens) == b"obs 0ab" + b"obs 1cd"
  assert s.loss_mask == [0] * 5 + [1] * 2 + [0] * 5 + [1] * 2
  # inserted: the turn before's version; before the first turn: the first turn's
  assert s.versions == [1] * 5 + [1] * 2 + [1] * 5 + [2] * 2
  assert s.logprobs[:5] == [0.0] * 5 and s.logprobs[5:7] == [-0.5] * 2
  assert client.prompts[1] == list(b"Q?obs 0abobs 1")  # each turn sees the whole conversation
  assert reports == [None, None, None]  # reset + two steps


def test_max_turns_and_context_end_an_episode(inprocess):
  ep, _ = play(EnvEpisode(inprocess.envs, max_turns=1), ["ab"], [])
  assert (ep.end, ep.turns, ep.reward) == ("max_turns", 1, 0.0)
  ep, _ = play(inprocess, ["ab"], [], max_prompt_len=10)  # "Q?obs 0ab" + "obs 1" > 10
  assert (ep.end, ep.turns) == ("context", 1)


@pytest.fixture(scope="module")
def pooled():
  pool = EnvPool(SYNTHETIC, {"turns": 3}, workers=1, timeout_s=1.0, max_response_bytes=1 << 20)
  yield EnvEpisode(pool, max_turns=4)
  pool.close()


@pytest.mark.parametrize("fault,kind", [("hang", "timeout"), ("exit", "crashed"),
                                        ("garbage", "garbage"), ("huge", "too_large")])
def test_a_failing_environment_ends_only_its_episode(pooled, fault, kind):
  reports = []
  ep, _ = play(pooled, ["ab", f"fault:{fault}", "never"], reports)
  assert (ep.end, ep.turns, ep.reward, ep.correct) == (f"env_{kind}", 2, 0.0, False)
  assert ep.sample.error and bytes(ep.sample.tokens).endswith(b"obs 1fault:" + fault.encode())
  assert reports == [None, None, kind]
  ep, _ = play(pooled, ["a", "b", "c"], [])  # the next episode plays in full
  assert (ep.end, ep.reward) == ("done", 1.0)
  assert pooled.envs.stats()["episodes"] == 0  # every environment was closed


def test_episodes_beyond_the_pool_places_wait_their_turn(pooled):
  async def both():
    runs = [pooled.run({}, context([]), Client(["a", "b", "c"]), SamplingParams()) for _ in "xy"]
    return await asyncio.gather(*runs)
  eps = asyncio.run(asyncio.wait_for(both(), GUARD_S))  # one place, two episodes
  assert [(ep.end, ep.reward) for ep in eps] == [("done", 1.0)] * 2


def test_a_failed_reset_ends_the_episode_before_any_turn(pooled):
  reports = []
  ep, client = play(pooled, [], reports, example={"fault": "raise"})
  assert (ep.end, ep.turns, ep.sample.tokens, client.prompts) == ("env_crashed", 0, [], [])
  assert reports == ["crashed"]


def test_built_from_the_config():
  c = config_lib.base_config()
  c.rollout.max_turns = 3
  c.rollout.env.class_path = SYNTHETIC
  c.rollout.env.args = '{"turns": 1}'
  wf = EnvEpisode.from_config(c)
  assert isinstance(wf.envs, InProcessEnvs) and wf.max_turns == 3
  wf.close()
  c.rollout.env.kind, c.rollout.env.url = "remote", "http://127.0.0.1:1"
  wf = EnvEpisode.from_config(c)
  assert isinstance(wf.envs, RemoteEnvs)
  wf.close()
  c.rollout.env.url = ""
  with pytest.raises(ValueError, match="rollout.env.url"):
    EnvEpisode.from_config(c)
  c.rollout.env.kind, c.rollout.env.class_path = "pool", "areal_jax.envs.nowhere:Env"
  with pytest.raises(ValueError, match="rollout.env.class_path='areal_jax.envs.nowhere:Env'"):
    EnvEpisode.from_config(c)
  c.rollout.env.kind, c.rollout.env.class_path = "ray", SYNTHETIC
  with pytest.raises(ValueError, match="rollout.env.kind='ray' .* needs runtime.mode='ray'"):
    EnvEpisode.from_config(c)
  c.rollout.env.kind = "docker"
  with pytest.raises(ValueError, match="rollout.env.kind='docker'"):
    EnvEpisode.from_config(c)
