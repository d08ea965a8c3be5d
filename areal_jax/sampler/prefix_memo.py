"""KV prefixes by token sequence under the weights in use: samples of one prompt submitted as
separate requests (``n=1`` with per-sample budgets) share one prefill, and the prompts of the
groups admitted in one round are prefilled together (``DecodeEngine.prefill_batch``), a window
at a time (``windows``). Least recently used first out: a fill keeps the prefixes it was asked
for until ``trim`` (once they are inserted), which keeps at most ``SIZE`` prefixes of at most
``max_positions`` positions in all (the engine's largest planned prefill call's: what the
sampler's memory plan counts for the memo, ``sampler.memory``), less those a row held beside it
takes (``held_beside``: a chunked prefill's, ``chunked_prefill``); cleared by a weight swap."""

from __future__ import annotations

import collections

from areal_jax.sampler import slot_cache


class PrefixMemo:

  SIZE = 8

  def __init__(self, engine, stats: collections.Counter):
    self.engine, self.stats = engine, stats  # counts "prefills" and "prefix_hits"
    self.max_positions = engine.prefill_positions_to_plan()
    self._prefixes: collections.OrderedDict = collections.OrderedDict()  # tokens -> KV prefix
    self.held_beside = lambda: 0  # positions of a row held beside the memo, in its budget

  def __contains__(self, tokens) -> bool:
    return (tokens if isinstance(tokens, tuple) else tuple(int(t) for t in tokens)) in \
        self._prefixes

  def __len__(self) -> int:
    return len(self._prefixes)

  def clear(self) -> None:
    self._prefixes.clear()

  def positions(self) -> int:
    """Positions the kept prefixes hold (each its prefill bucket's)."""
    layout = self.engine.cache_layout
    return sum(slot_cache.prefix_len(p, layout) for p in self._prefixes.values())

  def trim(self, keep=()) -> None:
    """Drops the least recently used prefixes (but those of ``keep``'s tokens) until at most
    ``SIZE`` of at most ``max_positions`` positions are left."""
    keep = {tuple(int(t) for t in ts) for ts in keep}
    positions, layout = self.positions() + self.held_beside(), self.engine.cache_layout
    for key in [k for k in self._prefixes if k not in keep]:
      if len(self._prefixes) <= self.SIZE and positions <= self.max_positions:
        break
      positions -= slot_cache.prefix_len(self._prefixes.pop(key), layout)

  def get(self, params, tokens: list[int]):
    """KV prefix of ``tokens`` under ``params`` (from the memo, else prefilled now)."""
    key = tuple(int(t) for t in tokens)
    if key not in self._prefixes:
      self.fill(params, [tokens])
    self._prefixes.move_to_end(key)
    return self._prefixes[key]

  def put(self, tokens: list[int], prefix) -> None:
    """Keeps ``prefix``, the KV prefix of ``tokens`` under the weights in use, prefilled
    elsewhere (in chunks), as the most recently used (``trim`` bounds the memo later)."""
    key = tuple(int(t) for t in tokens)
    self._prefixes[key] = prefix
    self._prefixes.move_to_end(key)

  def fill(self, params, token_lists: list[list[int]]) -> None:
    """Puts the prefixes of ``token_lists`` in the memo, prefilling those not there yet in batched
    calls; the others are trimmed (``trim``) around them."""
    keys = [tuple(int(t) for t in ts) for ts in token_lists]
    todo = [k for k in dict.fromkeys(keys) if k not in self._prefixes]
    self.stats["prefix_hits"] += len(keys) - len(todo)
    for key in keys:
      if key in self._prefixes:
        self._prefixes.move_to_end(key)
    self.trim(keep=keys)  # (room for the new ones first)
    for key, prefix in zip(todo, self.engine.prefill_batch(params, [list(k) for k in todo])):
      self._prefixes[key] = prefix
      self.stats["prefills"] += 1
    self.trim(keep=keys)


def windows(engine, token_lists: list[list[int]]) -> list[list[int]]:
  """``token_lists``' indices, in order, cut into windows whose prefixes hold at most the
  engine's largest planned prefill call's positions (``prefill_positions_to_plan``; a prompt's
  prefix is as long as the longest prompt's bucket it is prefilled with), one prompt at least:
  what a caller prefills and inserts before the next window, so that no more prefixes are held
  at once than the sampler's memory plan counts."""
  most, out, window, longest = engine.prefill_positions_to_plan(), [], [], 0
  for i, tokens in enumerate(token_lists):
    bucket = engine.prefill_bucket(max(len(tokens), 1))
    if window and (len(window) + 1) * max(longest, bucket) > most:
      out.append(window)
      window, longest = [], 0
    window.append(i)
    longest = max(longest, bucket)
  return out + ([window] if window else [])
