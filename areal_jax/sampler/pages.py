"""Host side of the sampler's paged KV cache (``EngineConfig.kv_pages``): which pages of the pool
each decode slot holds.

The device keeps K/V in a pool of ``num_pages`` pages of ``page_size`` positions (plus one trash
page); slot ``s``'s position ``p`` lives in page ``table[s, p // page_size]`` at offset
``p % page_size``. Slots take pages as they grow, so memory follows the tokens the live sequences
hold, not ``num_slots x max_len``. A group's samples share the pages their common prompt fills
(reference-counted); the prompt's last, partly filled page is copied per sample, since each writes
its own tokens after it. Entries a slot does not hold point at the trash page, which takes the
writes of padding rows and of slots that hold no page there and is never read by a live slot.

A finished sequence's pages can be kept (``keep``: a multi-turn conversation's KV for its next
turn, ``sampler.continuation``) instead of going back: they stay in the pool, held by no slot,
until ``drop``. Kept pages are the first to go: ``free_pages`` counts the pages only kept ones
hold, and when ``share`` or ``grow`` needs more pages than are free it calls ``evict`` (the
keeper drops its least recently kept) until they are, before saying no.

Every method either does all it was asked or nothing (False), so the caller can preempt and retry.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def check(slots_split: bool, config) -> None:
  """Raises ValueError when a ``DecodeEngine`` (``config``: its ``EngineConfig``; ``slots_split``:
  whether its slots are split over devices) cannot hold a paged cache."""
  if slots_split:
    raise ValueError("a paged KV cache is not split over slots: with a data axis use an engine "
                     "per data index (rollout.data_parallel='replicas', sampler/replicas.py), or "
                     "give the mesh no data (or fsdp) axis, or kv_pages=0")
  if config.kv_pages * config.page_size < config.max_len:
    raise ValueError(f"kv_pages={config.kv_pages} pages of {config.page_size} positions cannot "
                     f"hold one sequence of max_len={config.max_len} positions")


class PageTable:
  """Pages of a pool of ``num_pages`` (trash page: ``num_pages``) over ``num_slots`` slots."""

  def __init__(self, num_slots: int, num_pages: int, page_size: int, max_len: int):
    if page_size < 1 or num_pages * page_size < max_len:
      raise ValueError(f"kv_pages={num_pages} pages of {page_size} positions cannot hold one "
                       f"sequence of max_len={max_len} positions")
    self.page_size, self.num_pages, self.trash = page_size, num_pages, num_pages
    self.per_slot = -(-max_len // page_size)  # table entries per slot
    self.table = np.full((num_slots, self.per_slot), self.trash, np.int32)
    self._held: list[list[int]] = [[] for _ in range(num_slots)]
    self._refs = np.zeros((num_pages,), np.int32)
    self._kept = np.zeros((num_pages,), np.int32)  # of a page's refs, those of kept page lists
    self._free = list(range(num_pages - 1, -1, -1))  # popped from the end: low ids first
    # drops the least recently kept page list (``drop``); False when none is kept: set by the
    # keeper (``continuation.Continuations``)
    self.evict: Callable[[], bool] | None = None

  @property
  def free_pages(self) -> int:
    """Pages free, and those only kept page lists hold (``share`` and ``grow`` evict them)."""
    return len(self._free) + int(np.sum((self._refs > 0) & (self._refs == self._kept)))

  @property
  def kept_pages(self) -> int:
    """Pages kept page lists hold (shared with a slot or not)."""
    return int(np.sum(self._kept > 0))

  def _room(self, need: int) -> bool:
    """Whether ``need`` pages are free, evicting kept page lists until they are (none when
    evicting them all would not make room)."""
    if need > self.free_pages:
      return False
    while need > len(self._free) and self.evict is not None and self.evict():
      pass
    return need <= len(self._free)

  def keep(self, slot: int) -> list[int]:
    """``slot``'s pages, kept (held by no slot) until ``drop``; the slot holds nothing."""
    pages = self._held[slot]
    self._kept[np.asarray(pages, np.int64)] += 1
    self._set(slot, [])
    return pages

  def drop(self, pages: list[int]) -> None:
    """Lets go of kept ``pages`` (``keep``'s): each goes back once nothing else holds it."""
    self._kept[np.asarray(pages, np.int64)] -= 1
    self._unref(pages)

  def pages_for(self, length: int) -> int:
    """Pages that hold positions ``[0, length)``."""
    return min(-(-length // self.page_size), self.per_slot)

  def held(self, slot: int) -> int:
    return len(self._held[slot])

  def share_cost(self, n: int, length: int) -> int:
    """Free pages ``share`` takes for ``n`` slots over ``length`` positions."""
    full, part = divmod(length, self.page_size)
    return full + (n if part else 0)

  def share(self, slots: list[int], length: int) -> bool:
    """Gives ``slots`` (holding nothing) the pages of positions ``[0, length)``: the full pages
    shared by all of them, the last partial page each slot's own."""
    if any(self._held[s] for s in slots):
      raise ValueError(f"slots {[s for s in slots if self._held[s]]} still hold pages")
    if not self._room(self.share_cost(len(slots), length)):
      return False
    full = length // self.page_size
    shared = [self._take(len(slots)) for _ in range(full)]
    for s in slots:
      own = [self._take(1)] if length % self.page_size else []
      self._set(s, shared + own)
    return True

  def grow(self, slot: int, length: int) -> bool:
    """Gives ``slot`` its own pages so that it holds positions ``[0, length)``."""
    need = self.pages_for(length) - len(self._held[slot])
    if need <= 0:
      return True
    if not self._room(need):
      return False
    self._set(slot, self._held[slot] + [self._take(1) for _ in range(need)])
    return True

  def release(self, slot: int) -> None:
    """Returns ``slot``'s pages (a shared page once its last holder lets it go)."""
    self._unref(self._held[slot])
    self._set(slot, [])

  def _unref(self, pages: list[int]) -> None:
    for page in pages:
      self._refs[page] -= 1
      if self._refs[page] == 0:
        self._free.append(page)

  def move(self, src: list[int], dst: list[int]) -> None:
    """Slots ``src``'s pages go to the free slots ``dst`` (the device's cache does not move)."""
    for s, d in zip(src, dst):
      if self._held[d]:
        raise ValueError(f"slot {d} still holds pages")
      pages = self._held[s]
      self._set(s, [])
      self._set(d, pages)

  def reset(self) -> None:
    for s in range(len(self._held)):
      self._set(s, [])
    self._refs[:] = 0
    self._kept[:] = 0  # (the keeper forgets its page lists: ``Continuations.clear``)
    self._free = list(range(self.num_pages - 1, -1, -1))

  def _take(self, refs: int) -> int:
    page = self._free.pop()
    self._refs[page] = refs
    return page

  def padded(self, pages: list[int]) -> np.ndarray:
    """A table row holding ``pages``, the trash page after them."""
    row = np.full((self.per_slot,), self.trash, np.int32)
    row[:len(pages)] = pages
    return row

  def _set(self, slot: int, pages: list[int]) -> None:
    self._held[slot] = pages
    self.table[slot] = self.padded(pages)
