"""The rollout service's bookkeeping of a request: a group waiting or admitted, each of its
sequences (slot, tokens so far, their logprobs and versions), and the samples it becomes."""

from __future__ import annotations

import dataclasses
import functools
import time

from areal_jax.rollout_api import GroupRequest, Sample


@dataclasses.dataclass
class Group:
  request: GroupRequest
  submitted_s: float
  stop_ids: tuple[int, ...]
  seqs: list["Seq"] = dataclasses.field(default_factory=list)
  bypassed: int = 0  # later groups admitted while this one waited at the head of the queue

  @functools.cached_property
  def prefill_key(self) -> tuple[int, ...]:
    """The tokens its prefill covers (the prompt but its last token, which the first decode step
    feeds), as the prefix memo keys them."""
    return tuple(int(t) for t in self.request.prompt_tokens[:-1])


@dataclasses.dataclass
class Seq:
  group: Group
  index: int
  slot: int
  started_s: float
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  done: bool = False
  kv_version: int = -1  # the weights that computed the prompt's KV
  end: int = 0  # the length it stops at (max_new_tokens or the cache)
  admitted: int = 0  # admission order (a paged cache preempts the latest first)
  # its re-prefill runs in chunks (``chunked_prefill``): its slot, inactive, waits for the row
  prefilling: bool = False

  @property
  def length(self) -> int:
    return len(self.group.request.prompt_tokens) + len(self.tokens)

  def fed(self) -> list[int]:
    """The tokens whose KV the sequence's cache holds: the prompt and all but the last token."""
    return [int(t) for t in self.group.request.prompt_tokens] + self.tokens[:-1]

  def finish_reason(self, token: int, eos_token_ids, max_len: int) -> str | None:
    """Why the sequence ends with its new ``token`` (None: it goes on)."""
    if token in self.group.stop_ids:  # the EOS ids too, unless the request ignores them
      return "eos" if token in eos_token_ids else "stop"
    if len(self.tokens) >= self.group.request.params.max_new_tokens:
      return "length"
    if self.length >= max_len:
      return "cache_full"
    return None

  def sample(self, reason: str, error: str | None = None) -> Sample:
    """This sequence as it stands, finished for ``reason``."""
    r = self.group.request
    return Sample(r.group_id, self.index, list(r.prompt_tokens), self.tokens, self.logprobs,
                  self.versions, reason, self.group.submitted_s, self.started_s, time.time(),
                  error, dict(r.metadata))


def unstarted(group: Group, reason: str, error: str | None = None) -> list[Sample]:
  """A group that never started (rejected, aborted or failed while waiting): empty samples."""
  r, now = group.request, time.time()
  return [Sample(r.group_id, i, list(r.prompt_tokens), [], [], [], reason, group.submitted_s,
                 now if reason == "error" else 0.0, now, error, dict(r.metadata))
          for i in range(r.n)]
