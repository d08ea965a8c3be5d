"""Sequence packing: several sequences per row, so padding is not computed.

Each row holds whole sequences (prompt + completion) one after another; ``segment_ids`` keep
attention inside a sequence and ``positions`` restart at 0 for each. Per-token training arrays are
aligned to the position that *scores* the token (t scores t+1). Row length and row count come from
a few buckets, so the train step compiles a handful of shapes at most.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Seq:
  tokens: list[int]  # prompt + completion
  prompt_len: int
  behav_logp: list[float]  # one per completion token
  adv: float


@dataclasses.dataclass
class Packed:
  tokens: np.ndarray  # [R, L] int32
  positions: np.ndarray  # [R, L] int32
  segment_ids: np.ndarray  # [R, L] int32, 0 = padding
  seq: np.ndarray  # [R, L] int32, sequence index of the scored token, -1 = none
  mask: np.ndarray  # [R, L] float32, 1 where the position scores a completion token
  behav_logp: np.ndarray  # [R, L] float32
  adv: np.ndarray  # [R, L] float32
  real_tokens: int

  @property
  def efficiency(self) -> float:
    return self.real_tokens / self.tokens.size


def bucket(n: int, minimum: int = 16) -> int:
  """The smallest of 16, 24, 32, 48, 64, 96, ... (powers of two and 1.5x) that is >= ``n``."""
  b = minimum
  while True:
    if b >= n:
      return b
    if b * 3 // 2 >= n:
      return b * 3 // 2
    b *= 2


def assign_rows(lengths: list[int], row_len: int) -> list[list[int]]:
  """First-fit decreasing: indices of the sequences placed in each row."""
  order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
  rows, free = [], []
  for i in order:
    for r, room in enumerate(free):
      if lengths[i] <= room:
        rows[r].append(i)
        free[r] -= lengths[i]
        break
    else:
      rows.append([i])
      free.append(row_len - lengths[i])
  return rows


def pack(seqs: list[Seq], row_len: int, rows: list[list[int]] | None = None,
         num_rows: int | None = None, packed: bool = True) -> Packed:
  """Packs ``seqs`` into ``num_rows`` rows of ``row_len`` (one sequence per row if not ``packed``)."""
  lengths = [len(s.tokens) for s in seqs]
  too_long = [i for i, n in enumerate(lengths) if n > row_len]
  if too_long:
    raise ValueError(f"sequences {too_long} are longer than the row length {row_len}")
  if rows is None:
    rows = assign_rows(lengths, row_len) if packed else [[i] for i in range(len(seqs))]
  num_rows = len(rows) if num_rows is None else num_rows
  if num_rows < len(rows):
    raise ValueError(f"{len(rows)} rows needed, only {num_rows} allowed")
  shape = (num_rows, row_len)
  out = Packed(np.zeros(shape, np.int32), np.zeros(shape, np.int32), np.zeros(shape, np.int32),
               np.full(shape, -1, np.int32), np.zeros(shape, np.float32),
               np.zeros(shape, np.float32), np.zeros(shape, np.float32), sum(lengths))
  for r, members in enumerate(rows):
    offset = 0
    for k, i in enumerate(members):
      s, n = seqs[i], lengths[i]
      sl = slice(offset, offset + n)
      out.tokens[r, sl] = s.tokens
      out.positions[r, sl] = np.arange(n)
      out.segment_ids[r, sl] = k + 1
      c = n - s.prompt_len
      if len(s.behav_logp) != c:
        raise ValueError(f"sequence {i}: {len(s.behav_logp)} behaviour logprobs for {c} tokens")
      score = slice(offset + s.prompt_len - 1, offset + n - 1)
      out.seq[r, score] = i
      out.mask[r, score] = 1.0
      out.behav_logp[r, score] = s.behav_logp
      out.adv[r, score] = s.adv
      offset += n
  return out
