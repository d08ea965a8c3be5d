"""The paged cache's host-side page table: shared prompt pages with reference counts, growth,
release, moves, the trash page for what a slot does not hold, and all-or-nothing failures."""

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


def test_pages_are_never_handed_out_twice():
  rng = np.random.default_rng(0)
  t = PageTable(num_slots=6, num_pages=20, page_size=4, max_len=24)
  for _ in range(300):
    s = int(rng.integers(6))
    op = rng.integers(3)
    if op == 0 and t.held(s) == 0:
      group = [x for x in range(6) if t.held(x) == 0][:int(rng.integers(1, 4))]
      t.share(group, int(rng.integers(1, 24)))
    elif op == 1 and t.held(s):
      t.grow(s, int(rng.integers(1, 25)))
    elif op == 2:
      t.release(s)
    owners = {}
    for x in range(6):
      for page in t.table[x, :t.held(x)]:
        owners.setdefault(int(page), set()).add(x)
    in_use = set(owners)
    assert not in_use & set(t._free) and len(in_use) + t.free_pages == 20
    for page, holders in owners.items():
      assert t._refs[page] == len(holders)
