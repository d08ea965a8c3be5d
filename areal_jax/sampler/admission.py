"""Which waiting groups the sampler admits now: first in, first out, except that a later group
that fits may overtake a head group that does not, at most ``max_bypass`` times per head group
(then what frees up is kept for the head, so a big group is never starved by a stream of small
ones). A group fits when its samples fit the free slots and its pages (a paged cache) the free
pages."""

from __future__ import annotations

import collections
from typing import Callable


def pick(waiting: collections.deque, free_slots: int, free_pages: int, max_bypass: int,
         pages: Callable = lambda group: 0) -> list:
  """Removes the groups to admit from ``waiting`` (each with ``request.n`` samples and a
  ``bypassed`` count, raised when a later group overtakes it) and returns them in order;
  ``pages(group)``: the free pages it takes."""
  admitted = []
  fits = lambda g: g.request.n <= free_slots and pages(g) <= free_pages  # noqa: E731
  while waiting and free_slots:
    head = waiting[0]
    if fits(head):
      group = waiting.popleft()
    elif head.bypassed < max_bypass:
      group = next((g for g in waiting if fits(g)), None)
      if group is None:
        break
      waiting.remove(group)
      head.bypassed += 1
    else:
      break
    admitted.append(group)
    free_slots -= group.request.n
    free_pages -= pages(group)
  return admitted
