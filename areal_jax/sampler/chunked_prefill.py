"""Chunked prefill: a long prompt's KV built a chunk at a time between decode calls.

Prefilled in one call, a prompt of tens of thousands of tokens holds every running slot's next
decode step for as long as the whole prompt takes. Instead, a prefill of more than ``chunk``
positions (a waiting group's prompt; after a weight swap with ``continuation="reprefill"``, or a
paged cache's preemption, a sequence's prompt and generated tokens) runs as ``extend`` calls of
``chunk`` tokens over a row of the prefill bucket that holds it (``row_programs``), one before
each decode call of the rollout service's loop, so no decode step of the running slots waits
longer than one chunk. The row is the prefix a prefill of that bucket returns (positions, layout,
shardings), so the insert is the one prefill compiled, and the tokens and logprobs are a
prefill's up to float rounding (each chunk attends to the row up to its bucket, as the dense
prefill does over the whole bucket).

One row at a time: each loop the service names the most urgent sequence or group whose prefill
runs in chunks (``step``); a row held for another one is dropped (its owner was admitted another
way, aborted, or overtaken by a preempted sequence), and a finished row waits until its owner
takes it (``take``). The positions held count against the prefix memo's (``prefix_memo``), so the
memo and the row together hold no more than the memory plan counts for the memo. A weight swap
drops the row (``clear``).

Every chunk feeds ``chunk`` tokens (one program per row length); the last starts early enough to
end inside the row, re-running a few positions already written, from the same tokens.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from areal_jax.sampler import row_programs

# Positions per chunk by platform (rollout.prefill_chunk = -1). GPU and TPU: the longest piece the
# continuation's extend runs (continuation.MAX_PIECE: compiled at the Qwen2.5-1.5B shape, a
# 256-token piece over a long row held less than that row's prefill); CPU: of 256, 512 and 1024,
# the one whose running sequences waited least (and whose 16k-token prompt was done soonest) in
# bench/results/long-prefill-2026-12-05-e151d9f.
DEFAULT = {"cpu": 256, "gpu": 256, "tpu": 256}


def chunk_size(requested: int, platform: str) -> int:
  """Positions per chunk: ``requested`` (0: prompts are prefilled whole), -1: ``DEFAULT``'s."""
  if requested < -1:
    raise ValueError(f"prefill_chunk={requested} must be >= 0, or -1 (per platform)")
  return DEFAULT.get(platform, 256) if requested == -1 else requested


def starts(n: int, chunk: int, length: int) -> list[int]:
  """Positions the chunks of an ``n``-token prefill start at, over a row of ``length >= chunk``
  positions: every ``chunk``, the last moved back so that it ends inside the row."""
  return [min(s, length - chunk) for s in range(0, n, chunk)]


@dataclasses.dataclass(eq=False)
class _Job:
  owner: object
  tokens: np.ndarray
  length: int  # the row's positions (a prefill bucket)
  starts: list[int]
  row: object = None
  done: int = 0  # chunks run

  @property
  def finished(self) -> bool:
    return self.done == len(self.starts)


class ChunkedPrefill:
  """The row being prefilled in chunks of ``chunk`` positions (0: none ever) for ``engine``;
  counts ``"prefill_chunks"`` and, per row finished, ``"prefills"`` in ``stats``."""

  def __init__(self, engine, chunk: int, stats: collections.Counter):
    self.engine, self.chunk, self.stats = engine, int(chunk), stats
    self._job: _Job | None = None

  def long(self, n: int) -> bool:
    """Whether a prefill of ``n`` positions runs in chunks."""
    return 0 < self.chunk < n

  def ready(self, owner) -> bool:
    """Whether ``owner``'s row is finished (``take`` it)."""
    return self._job is not None and self._job.owner is owner and self._job.finished

  def pending(self, owner, n: int) -> bool:
    """Whether ``owner``'s prefill of ``n`` positions runs in chunks and is not finished yet."""
    return self.long(n) and not self.ready(owner)

  def take(self, owner):
    """``owner``'s finished row (a prefix, as ``DecodeEngine.prefill`` gives), let go here; None
    when there is none."""
    if not self.ready(owner):
      return None
    row, self._job = self._job.row, None
    return row

  def positions(self) -> int:
    """Positions the row held holds (0: none)."""
    return 0 if self._job is None else self._job.length

  def clear(self) -> None:
    """Drops the row (a weight swap: it holds the old weights' KV; the service stopped)."""
    self._job = None

  def step(self, params, owner=None, tokens=None) -> bool:
    """Runs the next chunk of ``owner``'s prefill of ``tokens()`` (the most urgent one that runs
    in chunks; None: there is none; ``tokens`` is called once, as its row starts), first
    dropping a row held for another; nothing once its row is finished. Dispatches only (the
    call runs on the device before the decode call the service dispatches next). Returns
    whether a chunk ran."""
    job = self._job
    if job is not None and job.owner is not owner:
      self._job = job = None
    if owner is None:
      return False
    if job is None:
      tokens = np.asarray(tokens(), np.int32)
      length = self.engine.prefill_bucket(len(tokens))
      self._job = job = _Job(owner, tokens, length, starts(len(tokens), self.chunk, length))
    if job.finished:
      return False
    if job.row is None:
      job.row = row_programs.empty(self.engine, job.length)()
    start = job.starts[job.done]
    piece = np.zeros((1, self.chunk), np.int32)
    fed = job.tokens[start:start + self.chunk]
    piece[0, :len(fed)] = fed
    job.row = row_programs.extend(self.engine, job.length)(params, job.row, piece,
                                                           np.full((1,), start, np.int32))
    job.done += 1
    self.stats["prefill_chunks"] += 1
    if job.finished:
      self.stats["prefills"] += 1
    return True

  # ---- compiling up front -----------------------------------------------------------------------
  def lengths(self) -> list[int]:
    """The row lengths a chunked prefill works on: the prefill buckets past one chunk."""
    return [b for b in self.engine.prefill_buckets if self.long(b)]

  def warmup_count(self) -> int:
    """Programs ``warmup`` compiles: a row's maker and a chunk's extend per row length."""
    return 2 * len(self.lengths())

  def warmup(self, params, progress=None, before: int = 0, total: int = 0) -> None:
    """Compiles every program a chunked prefill runs, on throwaway rows, calling
    ``progress(before + done, total, what)`` after each."""
    done = before
    for length in self.lengths():
      row = row_programs.empty(self.engine, length)()
      done += 1
      if progress is not None:
        progress(done, total, f"chunked prefill row {length}")
      row_programs.extend(self.engine, length)(params, row, np.zeros((1, self.chunk), np.int32),
                                               np.zeros((1,), np.int32))
      done += 1
      if progress is not None:
        progress(done, total, f"chunked prefill chunk {self.chunk} over {length}")
