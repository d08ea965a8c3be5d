"""Admission: first in, first out; a later group that fits may overtake a head group that does not
(slots or, with a paged cache, pages), a bounded number of times."""

import collections
import types

from areal_jax.sampler import admission


def _groups(*sizes):
  return collections.deque(types.SimpleNamespace(request=types.SimpleNamespace(n=n), bypassed=0,
                                                 name=i) for i, n in enumerate(sizes))


def test_fifo_then_bounded_overtaking():
  waiting = _groups(2, 4, 1, 1)
  # group 1 (4) does not fit the 2 slots left: group 2 overtakes it once, then it is kept for it
  assert [g.name for g in admission.pick(waiting, 4, 0, max_bypass=1)] == [0, 2]
  assert [g.name for g in waiting] == [1, 3] and waiting[0].bypassed == 1
  assert admission.pick(waiting, 1, 0, max_bypass=1) == [] and len(waiting) == 2
  assert [g.name for g in admission.pick(waiting, 4, 0, max_bypass=1)] == [1]  # its turn


def test_pages_are_a_second_budget():
  waiting = _groups(1, 1, 1)
  cost = {0: 5, 1: 2, 2: 2}
  got = admission.pick(waiting, 3, 4, max_bypass=8, pages=lambda g: cost[g.name])
  assert [g.name for g in got] == [1, 2] and [g.name for g in waiting] == [0]
