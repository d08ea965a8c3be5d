"""The workflow interface: one episode of one example, as many engine turns as it needs.

A workflow talks to the rollout engine through a small ``Client`` (``generate(prompt, params) ->
Sample``, one sequence per call) and returns an ``Episode``: a single ``Sample`` holding the whole
trajectory and its reward. Its ``run`` is either blocking (``def run``: the runtime gives each
running episode a thread of its own and a blocking ``Client``) or a coroutine (``async def run``:
every episode runs on one event loop and gets an ``AsyncClient``, so thousands can wait on their
environments at once; ``is_async``). An async episode never blocks: it awaits the engine
(``client.generate``), its environment and its reward (``Context.areward``).

Trajectory layout. ``sample.prompt_tokens`` is the example's first prompt; ``sample.tokens`` is
everything after it, in order: the policy's tokens of every turn and the tokens the environment
inserted between turns (user feedback, tool results, chat-template turn markers).
``sample.loss_mask`` is 1 on the policy's tokens and 0 on inserted ones; inserted tokens carry
logprob 0.0 and the policy version of the last policy token before them, so ``min(versions)`` is
the version of the trajectory's oldest policy token (the staleness bound counts it).

Workflows know nothing of the runtime: the controller supplies the client and the ``Context``.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Protocol

from areal_jax.rollout_api import Sample, SamplingParams

# Finish reasons of a turn after which the policy's text is complete (not cut off).
ENDED = ("eos", "stop")


class Client(Protocol):
  """What an episode sees of the rollout engine."""

  def generate(self, prompt_tokens: list[int], params: SamplingParams) -> Sample:
    """One sequence continuing ``prompt_tokens`` (blocking); errors come back as finish 'error'."""


class AsyncClient(Protocol):
  """What an async episode sees of the rollout engine."""

  async def generate(self, prompt_tokens: list[int], params: SamplingParams) -> Sample:
    """One sequence continuing ``prompt_tokens``; errors come back as finish 'error'. When the run
    stops, the wait raises (and any other await of the episode may be cancelled)."""


def _no_report(seconds: float, failure: str | None = None) -> None:
  del seconds, failure


@dataclasses.dataclass
class Context:
  """What an episode needs besides the engine: the task (prompts), the tokenizer, a reward.

  ``reward(completion_text, example) -> float`` never raises (the controller's is time-limited in
  the reward pool; tests pass ``task.reward``); it blocks, so an async episode awaits
  ``areward`` instead. ``max_prompt_len``: no turn's prompt (the whole conversation so far) may be
  longer; an episode that would need one ends there. ``report_env(seconds, failure)``: an episode
  reports each call of its environment (``reset`` or ``step``): the wall seconds it took, and
  ``failure`` None, or the kind of failure ("timeout", "crash", ...); the run's metrics count them
  (thread-safe, never blocks; a no-op outside a run).
  """

  task: Any
  tokenizer: Any
  reward: Callable[[str, dict], float]
  max_prompt_len: int
  report_env: Callable[[float, str | None], None] = _no_report

  async def areward(self, text: str, example: dict) -> float:
    """``reward(text, example)`` on a worker thread, so the event loop goes on meanwhile."""
    return await asyncio.to_thread(self.reward, text, example)


@dataclasses.dataclass
class Episode:
  """A finished episode: the trajectory as one ``Sample``, its reward, and how it went.

  ``correct``: the final answer is right (before any per-turn discount); evaluation counts it.
  ``turns``: engine calls made. ``end``: why it ended ("answered", "max_turns", "context",
  "length", "error", ...).
  """

  sample: Sample
  reward: float
  correct: bool
  turns: int
  end: str


class Trajectory:
  """Builds an episode's ``Sample``: policy turns (mask 1) and inserted context (mask 0)."""

  def __init__(self, prompt_tokens: list[int]):
    self.prompt_tokens = list(prompt_tokens)
    self.tokens: list[int] = []
    self.logprobs: list[float] = []
    self.versions: list[int] = []
    self.loss_mask: list[int] = []
    self.started_s = 0.0
    self.finished_s = 0.0

  @property
  def context(self) -> list[int]:
    """The whole conversation so far: the next turn's prompt."""
    return self.prompt_tokens + self.tokens

  def add_turn(self, sample: Sample, keep: int | None = None) -> None:
    """Appends the first ``keep`` (default all) generated tokens of a turn as policy tokens."""
    keep = len(sample.tokens) if keep is None else keep
    self.tokens += list(sample.tokens[:keep])
    self.logprobs += [float(x) for x in sample.logprobs[:keep]]
    self.versions += [int(v) for v in sample.versions[:keep]]
    self.loss_mask += [1] * keep
    self.started_s = self.started_s or sample.started_s
    self.finished_s = sample.finished_s

  def add_context(self, tokens: list[int], version: int) -> None:
    """Appends environment tokens: no loss, logprob 0.0, the version of the turn before them."""
    n = len(tokens)
    self.tokens += list(tokens)
    self.logprobs += [0.0] * n
    self.versions += [int(version)] * n
    self.loss_mask += [0] * n

  def last_version(self, default: int) -> int:
    return self.versions[-1] if self.versions else default

  def failed(self, sample: Sample, turns: int) -> Episode:
    """The episode ended by an engine error in turn ``turns`` (``sample``): kept, reward 0."""
    self.add_turn(sample)
    return Episode(self.sample(-1, -1, "error", sample.error, dict(turns=turns)), 0.0, False,
                   turns, "error")

  def sample(self, group_id: int, index: int, finish_reason: str, error: str | None = None,
             metadata: dict | None = None) -> Sample:
    return Sample(group_id, index, list(self.prompt_tokens), list(self.tokens),
                  list(self.logprobs), list(self.versions), finish_reason,
                  started_s=self.started_s, finished_s=self.finished_s, error=error,
                  metadata=dict(metadata or {}), loss_mask=list(self.loss_mask))


class Workflow(abc.ABC):
  """Runs one episode of an example. Thread-safe: many episodes run at once on one instance.

  A subclass defines ``run`` either blocking or as ``async def run(example, ctx, client, params)
  -> Episode`` with an ``AsyncClient`` (``is_async``)."""

  name = "workflow"

  @abc.abstractmethod
  def run(self, example: dict, ctx: Context, client: Client, params: SamplingParams) -> Episode:
    """Plays one episode; ``params.seed`` is the episode's seed (each turn derives its own)."""


def is_async(workflow: Workflow) -> bool:
  """Whether ``workflow.run`` is a coroutine function (its episodes run on the event loop)."""
  return inspect.iscoroutinefunction(workflow.run)


def turn_params(params: SamplingParams, turn: int) -> SamplingParams:
  """The sampling parameters of turn ``turn`` (0-based): a seed of its own per turn (turn 0 keeps
  the episode's, so a one-turn episode samples exactly what a plain request would)."""
  if turn == 0:
    return params
  return dataclasses.replace(params, seed=(params.seed * 7919 + turn) % (2**31 - 1))
