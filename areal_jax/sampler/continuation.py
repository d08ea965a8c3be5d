"""Continuing a conversation without re-prefilling its history: a finished sequence's KV row kept.

A multi-turn episode's next prompt is the previous turn's prompt, its generated tokens, and a few
inserted tokens (feedback, a tool result). When a request asks for it (``metadata["continue"]``),
the sampler copies the finished sequence's cache row out of its slot (``keep``): it holds the KV of
``prompt + generated[:-1]`` (the last generated token was sampled, never fed). A later request
whose ``prompt[:-1]`` shares a long enough start with those tokens (at least half of it) takes the
row (``take``) and runs only the rest (for the next turn: the last generated token and the inserted
ones) through the model on top of it, ``extend`` calls of padded chunks (pieces of at most
``MAX_PIECE`` tokens), instead of prefilling the whole conversation. The shared start need not be
the whole kept sequence: a tool call cuts a turn short, and the KV of the positions before the cut
is still that of the new prompt (positions past it are overwritten before anything attends to
them). The row sharing the longest start wins.

A row is kept only if the whole sequence, prompt KV included, came from the weights in use, and
every weight swap drops all kept rows, so a continuation gives the tokens and logprobs of a full
re-prefill (up to float rounding between the decode and prefill paths). A row is used up by the
turn that continues its conversation (its prompt shares some of the kept turn's generated tokens);
a prompt that shares only the kept turn's prompt with it (at least half its own tokens: another
conversation with the same system prompt or question) runs on a copy and leaves it kept. The
kept ones hold at most ``capacity`` rows of ``max_len`` positions (least recently kept dropped
first). A row cache keeps a copy of the slot's row up to the prefill bucket that holds the tokens
(layers x 2 x bucket x kv heads x head dim, beside the cache: the sampler's memory plan counts
``capacity`` rows of ``max_len``, what it leaves room for, so short turns keep more conversations
in the same memory). A paged cache keeps the slot's
pages themselves (``pages.PageTable.keep``: no copy, no memory beside the pool the plan sized),
read out into a row only when a turn continues from them; the pool takes kept pages back,
least recently kept first, whenever live sequences need pages (before any waits or is preempted).

The continuing turn works on a row of the smallest prefill bucket that holds the shared start and
the padded chunk (``row_length``), not of ``max_len``: only those positions are read out of the
kept row or pages, run over, and written into the new slot, so a continuation holds no more than
a prefill of the same prompt would (what the memory plan counts), and its insert is one the
prefill compiled already.
"""

from __future__ import annotations

import bisect
import collections

import jax
import numpy as np

from areal_jax.sampler import row_programs, slot_cache

MIN_CHUNK = 16
# the most new tokens one extend call runs: its attention holds float32 scores of heads x tokens x
# the row's positions, where a prefill's causal kernel holds a block at a time. Compiled for an
# H100 or a TPU v5e at the Qwen2.5-1.5B shape, a chunk of 256 over a long row held less than the
# prefill of that row and chunks of 1024 or more held more
# (bench/results/cpu-aot-h100-continuation-2026-11-30-8d1472a): longer chunks run as pieces of this
# many.
MAX_PIECE = 256


def wanted(metadata: dict, finish_reason: str) -> bool:
  """Whether a finished sequence's KV row is kept for its request's next turn (it asked, and it
  ended on its own; the service also needs every position from the weights in use)."""
  return bool(metadata.get("continue")) and finish_reason in ("eos", "stop", "length")


def chunk_bucket(n: int) -> int:
  """Padded length of an ``n``-token continuation chunk: a power of two, at least ``MIN_CHUNK``."""
  return max(MIN_CHUNK, 1 << max(n - 1, 0).bit_length())


def pieces(n: int) -> list[tuple[int, int, int]]:
  """``(start, tokens, padded)`` of the extend calls that run ``n`` new tokens: pieces of
  ``MAX_PIECE`` (the last one shorter, padded to its ``chunk_bucket``)."""
  return [(i, min(MAX_PIECE, n - i), chunk_bucket(min(MAX_PIECE, n - i)))
          for i in range(0, n, MAX_PIECE)]


def shared_start(a, b) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def longest_match(keys, tokens) -> tuple[tuple[int, ...] | None, int]:
  """``(key, shared)``: the key of ``keys`` sharing the longest start with ``tokens`` and the
  length of that start, if at least half of ``tokens`` (a continuation then pays); else
  ``(None, 0)``."""
  best, shared = None, 0
  for key in keys:
    n = shared_start(key, tokens)
    if n > shared:
      best, shared = key, n
  if best is None or 2 * shared < len(tokens):
    return None, 0
  return best, shared


class Continuations:
  """Kept KV rows of finished sequences, keyed by the tokens whose KV they hold, at most
  ``capacity`` rows of ``max_len`` positions' worth (each kept row costs the positions it holds:
  a row cache's copy is the prefill bucket holding its tokens, a paged cache's its pages), and
  at most ``MAX_ROWS_PER_CAPACITY`` rows per unit of capacity (each admission compares a prompt
  with every kept row's tokens)."""

  MAX_ROWS_PER_CAPACITY = 4

  def __init__(self, engine, capacity: int, table=None):
    """``table``: a paged cache's ``pages.PageTable`` (kept rows are its pages; the table evicts
    them when it needs pages)."""
    self.engine, self.capacity, self.table = engine, int(capacity), table
    # tokens -> (a row cache's copied row, or a paged cache's kept pages; positions it holds;
    # the kept turn's prompt length)
    self._rows: collections.OrderedDict[tuple[int, ...], tuple[object, int, int]] = \
        collections.OrderedDict()
    self._fns = engine._fns.setdefault("continuation", {})  # shared like the engine's own
    self.stats = collections.Counter()
    if table is not None:
      table.evict = self._evict

  def __len__(self) -> int:
    return len(self._rows)

  @property
  def kept_positions(self) -> int:
    """Positions the kept rows hold (at most ``capacity`` x ``max_len``)."""
    return sum(positions for _, positions, _ in self._rows.values())

  def clear(self) -> None:
    while self._rows:
      self._drop_oldest()

  def _drop_oldest(self) -> int:
    """Lets go of the least recently kept row; returns the positions it held."""
    _, (row, positions, _) = self._rows.popitem(last=False)
    if self.table is not None:
      self.table.drop(row)
    return positions

  def _evict(self) -> bool:
    """The page table needs pages: the least recently kept row's go back (False: none kept)."""
    if not self._rows:
      return False
    self._drop_oldest()
    self.stats["evicted"] += 1
    return True

  def keep(self, state, slot: int, tokens: list[int], prompt_len: int | None = None) -> None:
    """Keeps slot ``slot``'s cache row, which holds the KV of ``tokens`` (positions 0..; the
    turn's prompt its first ``prompt_len``, default all): a copy of the prefill bucket that holds
    them, or a paged cache's slot's pages themselves (the slot then holds none). The least
    recently kept rows go while the kept ones hold more than ``capacity`` rows of ``max_len``
    positions."""
    if not tokens or self.capacity < 1:
      return
    key = tuple(int(t) for t in tokens)
    if key in self._rows:  # (the same tokens kept again: the newer row replaces it)
      self._rows.move_to_end(key, last=False)
      self._drop_oldest()
    prompt_len = len(key) if prompt_len is None else int(prompt_len)
    if self.table is not None:
      pages = self.table.keep(slot)
      self._rows[key] = pages, len(pages) * self.table.page_size, prompt_len
    else:
      length = self.row_length(len(key))
      self._rows[key] = (self._take_fn(length)(state["cache"], np.int32(slot)), length,
                         prompt_len)
    self.stats["kept"] += 1
    positions, most = self.kept_positions, self.capacity * self.engine.config.max_len
    while positions > most or len(self._rows) > self.MAX_ROWS_PER_CAPACITY * self.capacity:
      positions -= self._drop_oldest()
      self.stats["dropped"] += 1

  def match(self, tokens: list[int]) -> tuple[tuple[int, ...] | None, int]:
    """``longest_match`` among the kept rows' keys."""
    return longest_match(self._rows, tokens)

  def take(self, params, tokens: list[int], state=None):
    """A KV prefix of ``tokens`` (as ``DecodeEngine.prefill`` gives: a row of the prefill bucket
    that holds them and the padded chunk) built on a kept row; None when no kept row fits (prefill
    as usual then). The row is used up when ``tokens`` share some of its turn's generated tokens
    (the conversation's next turn, or a turn cut short); one that shares only (part of) the kept
    turn's prompt (another conversation with the same system prompt or question) reads it and
    leaves it kept for its own conversation. A paged cache's kept pages are read out of
    ``state``'s pool, as many as the row holds (then, used up, go back to it)."""
    key, shared = self.match(tokens)
    if key is None:
      return None
    kept, _, prompt_len = self._rows[key]
    used_up = shared > prompt_len
    if used_up:
      del self._rows[key]
    else:
      self.stats["shared_prompt"] += 1
    rest = [int(t) for t in tokens[shared:]]
    calls = pieces(len(rest))
    length = self.row_length(shared + (calls[-1][0] + calls[-1][2] if calls else 0))
    if length is None:
      self.stats["too_long"] += 1
      if self.table is not None and used_up:
        self.table.drop(kept)
      return None
    if self.table is not None:  # (writes into the pages, later, are ordered after this read)
      pages = self.table.padded(kept)[:self.table.pages_for(length)]
      row = self._take_fn(length)(state["cache"], pages)
      if used_up:
        self.table.drop(kept)
    else:
      row = self._take_fn(length)(kept)
    self.stats["continued"] += 1
    self.stats["tokens_saved"] += shared
    for start, n, padded in calls:  # (each call donates the row to the next)
      chunk = np.zeros((1, padded), np.int32)
      chunk[0, :n] = rest[start:start + n]
      row = row_programs.extend(self.engine, length)(params, row, chunk,
                                                     np.full((1,), shared + start, np.int32))
    return row

  def row_length(self, positions: int) -> int | None:
    """Positions of the row a continuation over ``positions`` works on: the smallest prefill
    bucket that holds them (so no more than a prefill of the same prompt holds, and the insert is
    one the prefill already compiled), else ``max_len``; None past ``max_len``."""
    max_len = self.engine.config.max_len
    if positions > max_len:
      return None
    buckets = self.engine.prefill_buckets
    i = bisect.bisect_left(buckets, positions)
    return buckets[i] if i < len(buckets) else max_len

  # ---- compiling up front -----------------------------------------------------------------------
  def _lengths(self) -> list[int]:
    """Every row length a continuation works on (``row_length``'s values)."""
    return sorted(set(self.engine.prefill_buckets) | {self.engine.config.max_len})

  def _warmup_steps(self) -> list[tuple[str, int, int]]:
    """``(what, length, size)`` of every program a turn can run: a row cache's read of a slot's
    row (``keep``) and of a kept row of each length (``size``) into a row of ``length``, a paged
    cache's read of its pages, and an extend of each chunk bucket (``size``) shorter than the
    row; none for a row cache that keeps no row (``capacity`` 0: a memory plan with no room for
    them), whose turns are all prefilled whole."""
    if self.table is None and self.capacity < 1:
      return []
    lengths = self._lengths()
    chunks = sorted({chunk_bucket(n) for n in range(1, MAX_PIECE + 1)})  # (what pieces() pads to)
    if self.table is None:  # (the kept rows first: the reads take them)
      steps = [("keep", length, 0) for length in lengths]
      steps += [("take", length, kept) for length in lengths for kept in lengths]
    else:
      steps = [("take", length, 0) for length in lengths]
    return steps + [("extend", length, c) for length in lengths for c in chunks if c < length]

  def warmup_count(self) -> int:
    """Programs ``warmup`` compiles."""
    return len(self._warmup_steps())

  def warmup(self, params, state, progress=None) -> None:
    """Compiles every continuation program (``_warmup_steps``) on throwaway rows (no kept row
    changes), calling ``progress(done, total, what)`` after each: so a served conversation's
    next turn does not stall on a compile (a row length or chunk bucket first seen)."""
    steps = self._warmup_steps()
    rows = {}

    def read_pages(length):  # a paged cache: pages read into a row, as a turn starts
      return self._take_fn(length)(state["cache"],
                                   self.table.padded([])[:self.table.pages_for(length)])

    for done, (what, length, size) in enumerate(steps, 1):
      if what == "keep":
        rows[length] = self._take_fn(length)(state["cache"], np.int32(0))
      elif what == "take" and self.table is None:
        self._take_fn(length)(rows[size])
      elif what == "take":
        read_pages(length)
      else:
        row = rows.pop(length, None)
        row = read_pages(length) if row is None else row
        rows[length] = row_programs.extend(self.engine, length)(
            params, row, np.zeros((1, size), np.int32), np.zeros((1,), np.int32))
      if progress is not None:
        progress(done, len(steps),
                 f"continuation {what} {length}" + (f" of {size}" if size else ""))
    jax.block_until_ready(rows)

  # ---- device functions ------------------------------------------------------------------------
  def _take_fn(self, length: int):
    """The compiled read of ``length`` positions: out of a slot's row of the cache (``keep``, the
    slot given), out of a kept row, or a paged cache's out of a kept page list."""
    if ("take", length) not in self._fns:
      self._fns["take", length] = self._make_take(length)
    return self._fns["take", length]

  def _make_take(self, length: int):
    paged, layout = self.engine.paged, self.engine.cache_layout
    axis = 1 if layout == slot_cache.STACKED else 0

    def fn(source, slot=None):
      if paged:  # slot: the kept pages of the row
        return slot_cache.read_pages(source, slot, length)
      if slot is not None:  # a slot's row out of the cache
        source = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=axis),
                              source)
      return slot_cache.prefix_head(source, length, layout)

    return jax.jit(fn, out_shardings=row_programs.shardings(self.engine, length))
