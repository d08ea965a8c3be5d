"""The service's paging policy: admission cost (prompt pages shared, one call's growth each),
growth before a call, preemption of the latest admitted until the rest fit, resumption order."""

import types

from areal_jax.sampler.pages import PageTable
from areal_jax.sampler.paging import Paging


def _seq(slot, length, end, admitted):
  return types.SimpleNamespace(slot=slot, length=length, end=end, admitted=admitted)


def test_admission_cost_and_growth():
  p = Paging(PageTable(num_slots=4, num_pages=12, page_size=4, max_len=32), steps_per_call=3)
  # prompt of 10: KV of 9 positions = 2 full shared pages + 1 own each; the first call writes up
  # to position 12 (pages_for(12) = 3): no more pages
  assert p.admission_cost(2, 10, 32) == 2 + 2
  assert p.admission_cost(2, 9, 32) == 2 + 2 * 1  # 8 positions, then 8..11: one page each
  a, b = _seq(0, 10, 32, 1), _seq(1, 10, 32, 2)
  assert p.table.share([0, 1], 9)
  assert p.written(a, 2) == 15 and p.grow([a, b], 2) and p.table.held(0) == 4


def test_preemption_takes_the_latest_admitted_and_resumes_the_earliest():
  p = Paging(PageTable(num_slots=3, num_pages=6, page_size=4, max_len=24), steps_per_call=4)
  seqs = [_seq(s, 5, 24, admitted) for s, admitted in ((0, 3), (1, 1), (2, 2))]
  for s in seqs:
    assert p.table.share([s.slot], 4)
  for s in seqs:
    s.length = 13  # the next call writes up to 16: 4 pages each, 12 > 6
  assert not p.grow(seqs, 1)
  out = p.preempt_until_fit(seqs)
  assert [s.admitted for s in out] == [3, 2] and [s.admitted for s in p.preempted] == [2, 3]
  assert p.table.held(1) == 4 and p.table.free_pages == 2
  assert p.resumable() is None  # KV of 12 positions (3 pages) + growth to 16: 4 pages
  p.table.release(1)
  assert p.resumable() is p.preempted[0]
