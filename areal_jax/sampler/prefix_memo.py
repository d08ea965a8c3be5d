"""KV prefixes by token sequence under the weights in use: samples of one prompt submitted as
separate requests (``n=1`` with per-sample budgets) share one prefill, and the prompts of the
groups admitted in one round are prefilled together (``DecodeEngine.prefill_batch``). Least
recently used first out, at least ``SIZE`` kept; cleared by a weight swap."""

from __future__ import annotations

import collections


class PrefixMemo:

  SIZE = 8

  def __init__(self, engine, stats: collections.Counter):
    self.engine, self.stats = engine, stats  # counts "prefills" and "prefix_hits"
    self._prefixes: collections.OrderedDict = collections.OrderedDict()  # tokens -> KV prefix

  def __len__(self) -> int:
    return len(self._prefixes)

  def clear(self) -> None:
    self._prefixes.clear()

  def get(self, params, tokens: list[int]):
    """KV prefix of ``tokens`` under ``params`` (from the memo, else prefilled now)."""
    key = tuple(int(t) for t in tokens)
    if key not in self._prefixes:
      self.fill(params, [tokens])
    self._prefixes.move_to_end(key)
    return self._prefixes[key]

  def fill(self, params, token_lists: list[list[int]]) -> None:
    """Puts the prefixes of ``token_lists`` in the memo, prefilling those not there yet in batched
    calls."""
    keys = [tuple(int(t) for t in ts) for ts in token_lists]
    todo = [k for k in dict.fromkeys(keys) if k not in self._prefixes]
    self.stats["prefix_hits"] += len(keys) - len(todo)
    for key in keys:
      if key in self._prefixes:
        self._prefixes.move_to_end(key)
    for key, prefix in zip(todo, self.engine.prefill_batch(params, [list(k) for k in todo])):
      self._prefixes[key] = prefix
      self.stats["prefills"] += 1
    while len(self._prefixes) > max(self.SIZE, len(set(keys))):
      self._prefixes.popitem(last=False)
