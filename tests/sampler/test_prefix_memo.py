"""The prefix memo and the windows prompts are prefilled in: never more prefixes held at once than
the sampler's memory plan counts (the largest planned prefill call's positions)."""

import collections

from areal_jax.sampler import prefix_memo
from areal_jax.sampler.engine import DecodeEngine, EngineConfig

from .conftest import tiny_model


def _engine():
  # buckets 16, 32, 63; at most 64 tokens a call: 4 rows of 16, 2 of 32, 1 of 63
  return DecodeEngine(tiny_model(0), EngineConfig(num_slots=8, max_len=64, prefill_buckets=(16, 32),
                                                  max_prefill_tokens=64))


def test_windows_keep_the_order_and_the_planned_positions():
  eng = _engine()
  assert eng.prefill_positions_to_plan() == 64
  lengths = [5, 5, 5, 5, 5, 20, 3, 60, 2]
  windows = prefix_memo.windows(eng, [[1] * n for n in lengths])
  assert windows == [[0, 1, 2, 3], [4, 5], [6], [7], [8]]
  for w in windows:  # each prompt's prefix is as long as the longest bucket it is prefilled with
    assert len(w) == 1 or len(w) * max(eng.prefill_bucket(lengths[i]) for i in w) <= 64


def test_the_memo_keeps_a_fill_until_trimmed_then_what_the_plan_counts():
  eng = _engine()
  stats = collections.Counter()
  memo = prefix_memo.PrefixMemo(eng, stats)
  assert memo.max_positions == 64
  prompts = [[i + 1] * 5 for i in range(6)]  # 6 prefixes of 16 positions: 96
  memo.fill(eng.params, prompts)
  assert len(memo) == 6 and memo.positions() == 96  # all of them until inserted
  memo.trim()
  assert len(memo) == 4 and memo.positions() == 64  # the most recent: the last four
  before = stats["prefills"]
  memo.get(eng.params, prompts[-1])
  assert stats["prefills"] == before  # kept: no prefill
  memo.get(eng.params, prompts[0])  # dropped: prefilled again, the oldest other one goes
  assert stats["prefills"] == before + 1 and len(memo) <= 4 and memo.positions() <= 64
  long = [7] * 60  # a prefix longer than the bound alone: kept while it is asked for
  memo.get(eng.params, long)
  assert len(memo) == 1 and memo.positions() == 63
