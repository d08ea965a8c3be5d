"""The rollout engine interface: what the runtime programs against.

The JAX sampler (``areal_jax.sampler``) implements it; the vLLM backend and remote engines stand in
for it. Everything that crosses it is plain data (token ids, floats, ints), so an engine can live in
another process or on another host.

One request is a *group*: one prompt sampled ``n`` times (GRPO). The engine streams each finished
sequence out as soon as it ends, as a ``Sample``; every generated token carries the behaviour
logprob it was drawn with and the policy version that produced it.

Logprob convention: the behaviour logprob of a token is ``log softmax(logits / temperature)`` at that
token, i.e. the temperature-scaled distribution it was sampled from, before top-k / top-p truncation.
The learner recomputes exactly this quantity at the same temperature.
"""

from __future__ import annotations

import abc
import dataclasses
import queue
from typing import Any


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0  # 0: off
  greedy: bool = False
  max_new_tokens: int = 256
  stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS ids
  # True: the model's EOS ids do not end a sequence (only max_new_tokens and stop_token_ids do):
  # benchmarks that impose a length distribution on a model whose EOS would cut it short
  ignore_eos: bool = False
  seed: int = 0


@dataclasses.dataclass
class GroupRequest:
  group_id: int
  prompt_tokens: list[int]
  n: int
  params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
  # Passed through to samples. ``"continue": True`` asks an engine that can (the JAX sampler) to
  # keep the finished sequences' KV cache for a follow-up request that extends the conversation.
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Sample:
  """One finished (or aborted) sequence of a group."""

  group_id: int
  index: int  # 0 .. n-1 within the group
  prompt_tokens: list[int]
  tokens: list[int]  # generated tokens (the stop token included when it ended the sequence)
  logprobs: list[float]  # behaviour logprob per generated token
  versions: list[int]  # policy version that produced each generated token
  finish_reason: str  # "eos" | "stop" | "length" | "cache_full" | "abort" | "error"
  submitted_s: float = 0.0  # time.time() stamps
  started_s: float = 0.0
  finished_s: float = 0.0
  error: str | None = None
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
  # Multi-turn trajectories (areal_jax/workflows/): 1 on the policy's own tokens, 0 on tokens the
  # environment inserted (user feedback, tool results, chat-template turn markers), which are
  # context only: they carry logprob 0.0 and the policy version of the turn before them, so
  # ``min(versions)`` is still the version of the oldest policy token. None: every token is 1.
  loss_mask: list[int] | None = None

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


class RolloutEngine(abc.ABC):
  """Asynchronous generation service. Thread-safe; ``start`` runs it in the background."""

  @abc.abstractmethod
  def start(self) -> None:
    """Starts serving requests (in a background thread or process)."""

  @abc.abstractmethod
  def stop(self) -> None:
    """Stops serving; unfinished requests are aborted and returned by ``poll``."""

  @abc.abstractmethod
  def submit(self, request: GroupRequest) -> None:
    """Queues a group. A bad request yields ``n`` samples with ``finish_reason='error'``."""

  @abc.abstractmethod
  def poll(self, timeout: float | None = 0.0) -> list[Sample]:
    """Returns finished samples, waiting up to ``timeout`` seconds for at least one."""

  @abc.abstractmethod
  def update_params(self, params: Any, version: int) -> None:
    """Swaps weights; takes effect between two decode steps, in-flight sequences continue."""

  @abc.abstractmethod
  def pause(self) -> None:
    """Stops decoding after the current step (requests stay in their slots)."""

  @abc.abstractmethod
  def resume(self) -> None:
    """Continues decoding after ``pause``."""

  @abc.abstractmethod
  def abort(self, group_id: int) -> None:
    """Ends a group's sequences now; they are returned with what they have."""

  @property
  @abc.abstractmethod
  def version(self) -> int:
    """The policy version of the weights in use."""

  def compile_stats(self) -> dict[str, float]:
    """``{"compiles", "compile_s"}``: the programs this engine compiled so far and the seconds
    their first calls took; {} from engines that do not count them."""
    return {}


def drain(samples: queue.Queue, timeout: float | None = 0.0) -> list:
  """``RolloutEngine.poll`` over a queue of samples: everything queued, after waiting up to
  ``timeout`` seconds (None: without limit) for the first."""
  out = []
  try:
    if timeout is None or timeout > 0:
      out.append(samples.get(timeout=timeout))
    while True:
      out.append(samples.get_nowait())
  except queue.Empty:
    pass
  return out
