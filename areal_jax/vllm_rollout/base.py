"""What both vLLM engines share: request validation, per-sequence bookkeeping, sampling settings,
finish reasons and the output queue.

Each sequence of a group is one vLLM request *attempt* at a time. An attempt generates with one
policy version; a weight update aborts it and the sequence continues in a new attempt whose prompt
is the original prompt plus everything generated so far, with the remaining token budget.

Logprob convention (``rollout_api``): ``log softmax(logits / T)`` at the sampled token, before top-k
/ top-p. vLLM returns this with ``logprobs_mode="processed_logprobs"`` when top-k and top-p are off.
With top-k or top-p on, vLLM computes the logprob *after* truncation, i.e. renormalised over the kept
tokens: ours minus ``log(kept mass)``, so never smaller than ours. Greedy requests (temperature 0 in
vLLM) report ``log softmax(logits)``, i.e. temperature 1.

Randomness: requests are unseeded by default and draw from vLLM's engine-wide generator (seeded with
the engine seed), so a run is not reproducible sample by sample. Per-request seeds
(``SamplingParams.seed`` mixed with the sample index and offset) are available with
``per_request_seeds=True`` but are off because vLLM 0.32 on CPU fails the whole step ("CPU Generator
does not use offset") when a seeded request's prefill is split across steps (chunked prefill of
long prompts, e.g. the GSM8K prompts of the tiny preset).
"""

from __future__ import annotations

import dataclasses
import hashlib
import queue
import time

from areal_jax.rollout_api import GroupRequest, RolloutEngine, Sample, SamplingParams, drain
from areal_jax.sampler import requests


def attempt_seed(seed: int, index: int, offset: int) -> int:
  """vLLM seed of sequence ``index`` of a request seeded ``seed``, continuing after ``offset`` tokens."""
  digest = hashlib.blake2b(f"{seed}:{index}:{offset}".encode(), digest_size=4).digest()
  return int.from_bytes(digest, "little") & 0x7FFFFFFF


def sampling_fields(p: SamplingParams, stop_ids: tuple[int, ...], max_tokens: int,
                    seed: int | None) -> dict:
  """vLLM sampling settings (``vllm.SamplingParams`` keywords, also valid completion-API fields).

  ``seed=None`` leaves the request unseeded (drawn from the engine's seeded generator).
  """
  fields = dict(max_tokens=int(max_tokens), logprobs=0, stop_token_ids=list(stop_ids),
                ignore_eos=bool(p.ignore_eos), top_p=1.0, top_k=-1)
  if seed is not None:
    fields["seed"] = int(seed)
  if p.greedy:
    fields["temperature"] = 0.0
  else:
    fields.update(temperature=float(p.temperature), top_p=float(p.top_p),
                  top_k=int(p.top_k) if p.top_k > 0 else -1)
  return fields


@dataclasses.dataclass
class Group:
  request: GroupRequest
  submitted_s: float
  stop_ids: tuple[int, ...] = ()
  aborted: bool = False


@dataclasses.dataclass
class Seq:
  """One sequence of a group, across its attempts."""

  group: Group
  index: int
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  started_s: float = 0.0
  attempts: int = 0
  done: bool = False

  @property
  def key(self) -> str:
    return f"g{self.group.request.group_id}-s{self.index}"

  def next_request_id(self) -> str:
    self.attempts += 1
    return f"{self.key}-a{self.attempts}"

  @property
  def prompt(self) -> list[int]:
    """Prompt of the next attempt: the request's prompt plus everything generated so far."""
    return [int(t) for t in self.group.request.prompt_tokens] + self.tokens

  @property
  def remaining(self) -> int:
    return self.group.request.params.max_new_tokens - len(self.tokens)

  def attempt_fields(self, seeded: bool = False) -> dict:
    """vLLM settings of the next attempt; ``seeded``: a per-request seed (see ``PER_REQUEST_SEEDS``)."""
    p = self.group.request.params
    seed = attempt_seed(p.seed, self.index, len(self.tokens)) if seeded else None
    return sampling_fields(p, self.group.stop_ids, self.remaining, seed)

  def add(self, tokens, logprobs, version: int) -> None:
    if len(tokens) != len(logprobs):
      raise RuntimeError(f"vLLM returned {len(tokens)} tokens but {len(logprobs)} logprobs")
    if tokens and not self.started_s:
      self.started_s = time.time()
    self.tokens += [int(t) for t in tokens]
    self.logprobs += [float(x) for x in logprobs]
    self.versions += [int(version)] * len(tokens)


class VllmEngineBase(RolloutEngine):
  """Validation, finish reasons and the output queue; subclasses drive vLLM."""

  def __init__(self, *, vocab_size: int, eos_token_ids: tuple[int, ...], max_model_len: int,
               num_slots: int, version: int = 0):
    self.vocab_size, self.max_model_len, self.num_slots = vocab_size, max_model_len, num_slots
    self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
    self._version = int(version)
    self._out: queue.Queue[Sample] = queue.Queue()

  @property
  def version(self) -> int:
    return self._version

  def poll(self, timeout: float | None = 0.0) -> list[Sample]:
    return drain(self._out, timeout)

  # ---- requests --------------------------------------------------------------------------------

  def validate(self, r: GroupRequest) -> tuple[int, ...]:
    """The request's stop ids (EOS first); raises ``ValueError`` for a bad request."""
    return requests.validate(r, max_len=self.max_model_len, vocab_size=self.vocab_size,
                             eos_token_ids=self.eos_token_ids,
                             room=f"within max_model_len={self.max_model_len}")

  def new_group(self, request: GroupRequest) -> tuple[Group, list[Seq]] | None:
    """Validates ``request``; a bad one is answered at once with ``n`` error samples (None)."""
    group = Group(request, time.time())
    try:
      group.stop_ids = self.validate(request)
    except ValueError as e:
      self.emit_group(group, "error", str(e))
      return None
    return group, [Seq(group, i) for i in range(request.n)]

  # ---- output ----------------------------------------------------------------------------------

  def finish_reason(self, seq: Seq, vllm_reason: str | None) -> str | None:
    """Our finish reason after an attempt ended with ``vllm_reason`` (None: not finished)."""
    if vllm_reason is None:
      return None
    last = seq.tokens[-1] if seq.tokens else None
    if vllm_reason == "stop" and last is not None:
      if last in seq.group.stop_ids:  # the EOS ids too, unless the request ignores them
        return "eos" if last in self.eos_token_ids else "stop"
    if vllm_reason in ("stop", "length"):
      if seq.remaining <= 0:
        return "length"
      return "cache_full" if len(seq.prompt) >= self.max_model_len else "length"
    if vllm_reason == "abort":
      return "abort"
    return "error"

  def emit_group(self, group: Group, reason: str, error: str | None = None) -> None:
    r, now = group.request, time.time()
    for i in range(r.n):
      self._out.put(Sample(r.group_id, i, list(r.prompt_tokens), [], [], [], reason,
                           group.submitted_s, now if reason == "error" else 0.0, now, error,
                           dict(r.metadata)))

  def emit(self, seq: Seq, reason: str, error: str | None = None) -> None:
    seq.done = True
    r = seq.group.request
    self._out.put(Sample(r.group_id, seq.index, list(r.prompt_tokens), list(seq.tokens),
                         list(seq.logprobs), list(seq.versions), reason, seq.group.submitted_s,
                         seq.started_s, time.time(), error, dict(r.metadata)))
