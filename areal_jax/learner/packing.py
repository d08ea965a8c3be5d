"""Sequence packing and micro-batching, host side (NumPy).

Each row holds whole sequences (prompt + completion) one after another; ``segment_ids`` keep
attention inside a sequence (0 = padding) and ``positions`` restart at 0 for each. Per-token
training arrays are aligned to the position that *scores* the token (position t scores token t+1):
the ``c`` completion tokens of a sequence starting at offset ``o`` with a prompt of ``p`` tokens are
scored at positions ``o + p - 1 .. o + p + c - 2``.

Shapes are bucketed (row length and rows per micro-batch come from a short geometric list), so the
train step compiles a handful of shapes at most.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np

FIELDS = ("tokens", "positions", "segment_ids", "mask", "behav_logp", "adv")


@dataclasses.dataclass
class Seq:
  """One training sequence: prompt + completion, the completion's behaviour logprobs, advantage."""
  tokens: list[int]
  prompt_len: int
  behav_logp: list[float]  # one per completion token
  adv: float
  # One per completion token: 1 trains the token, 0 makes it context (tokens a multi-turn
  # environment inserted: no loss, entropy or KL, not counted in the token mean). None: all 1.
  loss_mask: list[int] | None = None


@dataclasses.dataclass
class Packed:
  """``[R, L]`` arrays of packed rows (see the module docstring for the alignment)."""
  tokens: np.ndarray  # int32
  positions: np.ndarray  # int32, restart at 0 in every segment
  segment_ids: np.ndarray  # int32, 1, 2, ... within a row; 0 = padding
  mask: np.ndarray  # float32, 1 where the position scores a trained completion token
  behav_logp: np.ndarray  # float32
  adv: np.ndarray  # float32
  seq: np.ndarray  # int32, index of the sequence whose token is scored there, -1 = none

  @property
  def real_tokens(self) -> int:
    return int(np.sum(self.segment_ids > 0))

  @property
  def efficiency(self) -> float:
    """Real tokens over computed positions (rows x row length)."""
    return self.real_tokens / max(self.tokens.size, 1)

  def arrays(self) -> dict[str, np.ndarray]:
    return {f: getattr(self, f) for f in FIELDS}


def bucket(n: int, minimum: int = 16) -> int:
  """The smallest of ``minimum`` x (1, 1.5, 2, 3, 4, 6, 8, ...) that is >= ``n``."""
  b = minimum
  while True:
    if b >= n:
      return b
    if b * 3 // 2 >= n:
      return b * 3 // 2
    b *= 2


def row_bucket(n: int, multiple: int = 1) -> int:
  """``bucket(n)`` rounded up to a multiple of ``multiple``."""
  return -(-bucket(n) // multiple) * multiple


def assign_rows(lengths: list[int], row_len: int) -> list[list[int]]:
  """First-fit decreasing: indices of the sequences placed in each row."""
  order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  rows: list[list[int]] = []
  free: list[int] = []
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
         num_rows: int | None = None) -> Packed:
  """Packs ``seqs`` into ``num_rows`` rows of ``row_len``; ``rows`` lists each row's sequences
  (default: first-fit decreasing). Rows beyond ``rows`` are all padding."""
  lengths = [len(s.tokens) for s in seqs]
  too_long = [i for i, n in enumerate(lengths) if n > row_len]
  if too_long:
    raise ValueError(f"sequences {too_long} are longer than the row length {row_len}")
  if rows is None:
    rows = assign_rows(lengths, row_len)
  num_rows = len(rows) if num_rows is None else num_rows
  if num_rows < len(rows):
    raise ValueError(f"{len(rows)} rows needed, only {num_rows} allowed")
  shape = (num_rows, row_len)
  out = Packed(np.zeros(shape, np.int32), np.zeros(shape, np.int32), np.zeros(shape, np.int32),
               np.zeros(shape, np.float32), np.zeros(shape, np.float32),
               np.zeros(shape, np.float32), np.full(shape, -1, np.int32))
  for r, members in enumerate(rows):
    offset = 0
    for k, i in enumerate(members):
      s, n = seqs[i], lengths[i]
      c = n - s.prompt_len
      if s.prompt_len < 1:
        raise ValueError(f"sequence {i}: the prompt must have at least one token")
      if len(s.behav_logp) != c:
        raise ValueError(f"sequence {i}: {len(s.behav_logp)} behaviour logprobs for {c} tokens")
      if s.loss_mask is not None and len(s.loss_mask) != c:
        raise ValueError(f"sequence {i}: a loss mask of {len(s.loss_mask)} for {c} tokens")
      if offset + n > row_len:
        raise ValueError(f"row {r} overflows: {offset + n} tokens > row length {row_len}")
      sl = slice(offset, offset + n)
      out.tokens[r, sl] = s.tokens
      out.positions[r, sl] = np.arange(n)
      out.segment_ids[r, sl] = k + 1
      score = slice(offset + s.prompt_len - 1, offset + n - 1)
      out.seq[r, score] = i
      out.mask[r, score] = 1.0 if s.loss_mask is None else np.asarray(s.loss_mask, np.float32)
      out.behav_logp[r, score] = s.behav_logp
      out.adv[r, score] = s.adv
      offset += n
  return out


@dataclasses.dataclass
class Layout:
  """How a batch of sequences becomes ``ppo_n_minibatches`` lists of micro-batches.

  ``minibatches[k][m]`` lists the rows of micro-batch ``m`` of minibatch ``k``, each row a list of
  sequence indices; every micro-batch has exactly ``micro_rows`` rows (padding rows are empty).
  """
  row_len: int
  micro_rows: int
  minibatches: list[list[list[list[int]]]]

  @property
  def computed_tokens(self) -> int:
    return sum(len(mbs) for mbs in self.minibatches) * self.micro_rows * self.row_len

  def cost(self, attn: float = 0.0) -> float:
    """Compute of the layout in token units: each row costs ``row_len`` tokens of matmuls plus
    causal attention over it, ``attn * row_len**2 / 2`` (``attn``: one (query, key) pair's
    attention relative to one token's matmuls, :func:`attention_cost`)."""
    return self.computed_tokens * (1.0 + attn * self.row_len / 2)

  @property
  def used_rows(self) -> int:
    return sum(1 for mbs in self.minibatches for mb in mbs for row in mb if row)


LONGER_ROWS_GAIN = 0.85  # doubled rows are taken when they cost at most this share
REUSE_COST = 1.5  # a known shape is taken when it costs at most this many times the new one


def attention_cost(cfg) -> float:
  """One (query, key) pair's attention FLOPs (QK and AV over every head and layer) relative to one
  token's matmul FLOPs (projections, MLP, LM head), for a model config: what makes long rows
  dearer per token. The tiny test model: 2.8e-3 (in rows of 1536, attention costs 2.2x the
  matmuls); SmolLM2-135M: 2.6e-4 (+20% in rows of 1536); Qwen2.5-1.5B: 5.6e-5 (+4%)."""
  d, hd = cfg.d_model, cfg.head_dim
  per_layer = d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * d * cfg.d_ff
  matmul = cfg.n_layers * per_layer + cfg.vocab_size * d
  return 2.0 * cfg.n_layers * cfg.n_heads * hd / matmul


def plan(lengths: list[int], n_minibatches: int, micro_batch_tokens: int, dp: int = 1,
         min_row_len: int = 0, packed: bool = True,
         known: Iterable[tuple[int, int]] = (), attn: float = 0.0, multiple: int = 1) -> Layout:
  """Splits sequences (in order) into ``n_minibatches`` equal parts, packs each into rows, and cuts
  the rows into micro-batches of at most ``micro_batch_tokens`` tokens (but at least ``dp`` rows).

  Costs are ``Layout.cost(attn)``: computed tokens, plus the attention over each row, whose share
  grows with the row length (``attn``: :func:`attention_cost` of the model; 0 counts tokens only).
  Row length is ``bucket(max(longest, min_row_len))``, or twice that (within
  ``micro_batch_tokens``) when packing into the longer rows costs at most ``LONGER_ROWS_GAIN``
  of the shorter rows' cost: sequences well under the row length then share rows instead of one per row
  (the CPU demo's ~110-token sequences in rows of 192: 58% -> 78% real, 108 -> 148 trained tokens/s
  on SmolLM2), while the attention cost of longer rows (causal over the row, masked between
  segments; rows of 768 instead of 384 cost ~14% more per position) keeps the shorter rows when
  packing gains little. Rows per micro-batch are a multiple of ``dp`` from a bucketed list,
  chosen to leave as few padding rows as possible.

  ``known``: ``(row_len, micro_rows)`` shapes the train step has already compiled. When the layout
  above has a new shape, the cheapest known shape that holds the batch (within the token budget)
  is taken instead if it costs at most ``REUSE_COST`` times as much: a compilation costs more
  than a few steps' padding, and a steady workload then stops compiling once its shapes have been
  seen. (Counting attention matters here: a batch of short sequences packed into a known shape of
  twice the row length computes the same tokens, but for the tiny model at 768 -> 1536 it measured
  1.8x slower per step.)

  ``multiple``: row lengths are rounded up to a multiple of it (the devices a row's positions are
  split over, ``mesh.learner.context``).
  """
  if not lengths:
    raise ValueError("no sequences to pack")
  if n_minibatches < 1 or n_minibatches > len(lengths):
    raise ValueError(f"ppo_n_minibatches={n_minibatches} must be in [1, {len(lengths)}] "
                     f"(the number of sequences)")
  row_len = row_bucket(max(max(lengths), min_row_len), multiple)
  layout = _layout(lengths, n_minibatches, micro_batch_tokens, dp, row_len, packed)
  longer = row_bucket(2 * row_len, multiple)
  if packed and longer <= micro_batch_tokens:
    other = _layout(lengths, n_minibatches, micro_batch_tokens, dp, longer, packed)
    if other.cost(attn) <= LONGER_ROWS_GAIN * layout.cost(attn):
      layout = other
  known = set(known)
  if (layout.row_len, layout.micro_rows) in known:
    return layout
  reuse = [_layout(lengths, n_minibatches, micro_batch_tokens, dp, row_len, packed, rows)
           for row_len, rows in sorted(known)
           if row_len >= max(lengths) and rows % dp == 0 and row_len % multiple == 0
           and rows * row_len <= max(micro_batch_tokens, dp * row_len)]
  reuse = [r for r in reuse if r.cost(attn) <= REUSE_COST * layout.cost(attn)]
  return min(reuse, key=lambda r: (r.cost(attn), r.row_len), default=layout)


def _layout(lengths, n_minibatches, micro_batch_tokens, dp, row_len, packed,
            micro_rows: int | None = None) -> Layout:
  parts = np.array_split(np.arange(len(lengths)), n_minibatches)
  mb_rows = []
  for idx in parts:
    idx = [int(i) for i in idx]
    if packed:
      local = assign_rows([lengths[i] for i in idx], row_len)
      mb_rows.append([[idx[j] for j in row] for row in local])
    else:
      mb_rows.append([[i] for i in idx])
  budget = max(1, micro_batch_tokens // row_len // dp)  # in units of dp rows
  most = max(math.ceil(len(r) / dp) for r in mb_rows)
  n_micro = math.ceil(most / budget)
  if micro_rows is None:
    micro_rows = dp * min(bucket(math.ceil(most / n_micro), 1), max(budget, 1))
  minibatches = []
  for rows in mb_rows:
    rows = rows + [[] for _ in range(-len(rows) % micro_rows)]
    minibatches.append([rows[i:i + micro_rows] for i in range(0, len(rows), micro_rows)])
  return Layout(row_len, micro_rows, minibatches)
