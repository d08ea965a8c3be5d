"""The paged cache's host-side page table: shared prompt pages with reference counts, growth,
release, moves, the trash page for what a slot does not hold, and all-or-nothing failures."""

import collections

import numpy as np
import pytest

from areal_jax.sampler.pages import PageTable


def test_a_group_shares_its_full_prompt_pages_and_owns_its_last_partial_one():
  t = PageTable(num_slots=4, num_pages=10, page_size=4, max_len=16)
  assert t.per_slot == 4 and t.trash == 10 and (t.table == 10).all()
  assert t.share_cost(3, 9) == 2 + 3 and t.share([0, 2, 3], 9)  # 2 full pages + 3 own
  assert t.free_pages == 10 - 5
  rows = t.table[[0, 2, 3]]
  assert (rows[:, :2] == rows[0, :2]).all() and len(set(rows[:, 2])) == 3  # shared, then own
  assert (rows[:, 3] == t.trash).all() and (t.table[1] == t.trash).all()
  t.release(2)  # the shared pages stay with the other two
  assert t.free_pages == 6 and (t.table[2] == t.trash).all()
  t.release(0)
  t.release(3)
  assert t.free_pages == 10
  assert t.share([1], 8) and t.free_pages == 8  # a whole number of pages: nothing partial


def test_growth_moves_and_all_or_nothing_failures():
  t = PageTable(num_slots=3, num_pages=5, page_size=4, max_len=12)
  assert t.share([0], 4) and t.share([1], 1)  # slot 0: one full page; slot 1: one own page
  assert t.free_pages == 3 and t.grow(0, 8) and t.held(0) == 2 and t.free_pages == 2
  assert t.grow(0, 5)  # already held
  assert t.grow(0, 40) and t.held(0) == 3 and t.free_pages == 1  # capped at max_len's pages
  assert not t.grow(1, 12) and t.held(1) == 1 and t.free_pages == 1  # needs 2: none taken
  assert not t.share([2], 9) and (t.table[2] == t.trash).all()
  row = t.table[1].copy()
  t.move([1], [2])
  assert (t.table[2] == row).all() and (t.table[1] == t.trash).all() and t.held(1) == 0
  with pytest.raises(ValueError, match="still hold"):
    t.share([2], 3)
  t.reset()
  assert t.free_pages == 5 and (t.table == t.trash).all()


def test_a_pool_that_cannot_hold_one_sequence_is_refused():
  with pytest.raises(ValueError, match="kv_pages=3 pages of 4 positions cannot hold one sequence"):
    PageTable(num_slots=2, num_pages=3, page_size=4, max_len=16)


def _keeper(t: PageTable) -> list:
  """The page lists a keeper holds (least recently kept first), evicted oldest first when ``t``
  needs pages."""
  kept = []

  def evict():
    if not kept:
      return False
    t.drop(kept.pop(0))
    return True

  t.evict = evict
  return kept


@pytest.mark.parametrize("keeping", [False, True], ids=["slots", "slots and kept lists"])
def test_pages_are_never_handed_out_twice(keeping):
  """Random shares, growths and releases (and page lists kept from slots, dropped, evicted):
  no page is both free and held, each page's count is its holders', and ``free_pages`` is the
  free pages and those only kept lists hold."""
  rng = np.random.default_rng(int(keeping))
  t = PageTable(num_slots=6, num_pages=20, page_size=4, max_len=24)
  kept = _keeper(t)
  for _ in range(400):
    s = int(rng.integers(6))
    op = rng.integers(5 if keeping else 3)
    if op == 0 and t.held(s) == 0:
      group = [x for x in range(6) if t.held(x) == 0][:int(rng.integers(1, 4))]
      t.share(group, int(rng.integers(1, 24)))
    elif op == 1 and t.held(s):
      t.grow(s, int(rng.integers(1, 25)))
    elif op == 2:
      t.release(s)
    elif op == 3 and t.held(s):
      kept.append(t.keep(s))
    elif op == 4 and kept:
      t.drop(kept.pop(int(rng.integers(len(kept)))))
    by_slots = [int(p) for x in range(6) for p in t.table[x, :t.held(x)]]
    holders = collections.Counter(by_slots + [p for pages in kept for p in pages])
    assert not set(holders) & set(t._free) and len(holders) + len(t._free) == 20
    for page, n in holders.items():
      assert t._refs[page] == n
    only_kept = set(holders) - set(by_slots)
    assert t.free_pages == len(t._free) + len(only_kept)


def test_kept_pages_stay_until_dropped_and_go_first_when_pages_run_short():
  t = PageTable(num_slots=3, num_pages=6, page_size=4, max_len=12)
  kept = _keeper(t)
  assert t.share([0, 1], 6)  # one shared page, one own page each
  shared, own = int(t.table[0, 0]), int(t.table[0, 1])
  kept.append(t.keep(0))  # slot 0's pages kept: the slot holds none, the pages stay taken
  assert t.held(0) == 0 and (t.table[0] == t.trash).all() and kept[0] == [shared, own]
  assert t.kept_pages == 2 and shared not in t._free and own not in t._free
  # its own page is only kept (it would come back); the shared one slot 1 still holds
  assert len(t._free) == 3 and t.free_pages == 4
  assert t.share([2], 12)  # needs 3: free, nothing evicted
  assert kept and t.free_pages == 1
  assert not t.share([0], 12) and kept  # 3 needed, 1 to be had: nothing evicted for nothing
  assert t.grow(2, 13) and t.held(2) == 3  # (capped: held already)
  assert t.grow(1, 9) and t.held(1) == 3 and not kept  # needed one more: the kept list went
  assert t.kept_pages == 0 and t._refs[shared] == 1  # the shared page: slot 1's alone now
  assert not t.grow(0, 4)  # nothing left to evict: all or nothing as before
  t.release(1)
  t.release(2)
  assert t.free_pages == 6 and len(t._free) == 6
