"""Sequence packing: alignment of the per-token arrays, row assignment, micro-batch layout."""

import numpy as np
import pytest

from areal_jax.learner import packing


def seq(prompt, completion, adv=1.0):
  return packing.Seq(list(prompt) + list(completion), len(prompt),
                     [-0.1 * (i + 1) for i in range(len(completion))], adv)


def test_alignment_segments_positions():
  seqs = [seq([5, 6, 7], [8, 9], 2.0), seq([1], [2, 3, 4], -1.0)]
  p = packing.pack(seqs, 12, rows=[[0, 1]])
  np.testing.assert_array_equal(p.tokens[0], [5, 6, 7, 8, 9, 1, 2, 3, 4, 0, 0, 0])
  np.testing.assert_array_equal(p.positions[0], [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0, 0])
  np.testing.assert_array_equal(p.segment_ids[0], [1, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0])
  # Position t scores token t+1: the last prompt token scores the first completion token.
  np.testing.assert_array_equal(p.mask[0], [0, 0, 1, 1, 0, 1, 1, 1, 0, 0, 0, 0])
  np.testing.assert_allclose(p.behav_logp[0][[2, 3]], [-0.1, -0.2])
  np.testing.assert_allclose(p.behav_logp[0][[5, 6, 7]], [-0.1, -0.2, -0.3])
  np.testing.assert_allclose(p.adv[0], [0, 0, 2, 2, 0, -1, -1, -1, 0, 0, 0, 0])
  scored = p.tokens[0][1:][p.mask[0][:-1] > 0]
  np.testing.assert_array_equal(scored, [8, 9, 2, 3, 4])
  np.testing.assert_array_equal(p.seq[0], [-1, -1, 0, 0, -1, 1, 1, 1, -1, -1, -1, -1])
  assert p.real_tokens == 9 and p.efficiency == 9 / 12


def test_pack_errors():
  with pytest.raises(ValueError, match="longer than the row length"):
    packing.pack([seq([1, 2], [3, 4, 5])], 4)
  with pytest.raises(ValueError, match="behaviour logprobs"):
    packing.pack([packing.Seq([1, 2, 3], 1, [0.0], 1.0)], 8)
  with pytest.raises(ValueError, match="rows needed"):
    packing.pack([seq([1], [2]), seq([1], [2])], 2, num_rows=1)


def test_first_fit_decreasing_fills_rows():
  rng = np.random.default_rng(0)
  lengths = rng.integers(5, 60, 200).tolist()
  rows = packing.assign_rows(lengths, 64)
  assert sorted(i for r in rows for i in r) == list(range(200))
  assert all(sum(lengths[i] for i in r) <= 64 for r in rows)
  assert sum(lengths) / (len(rows) * 64) > 0.9


def test_bucket():
  assert [packing.bucket(n) for n in (1, 16, 17, 25, 33, 49, 100, 200)] == \
      [16, 16, 24, 32, 48, 64, 128, 256]
  assert [packing.bucket(n, 1) for n in (1, 2, 3, 4, 5, 7, 9)] == [1, 2, 3, 4, 6, 8, 12]


def gsm8k_like_lengths(n, seed=0):
  """Prompt ~ 60-200 tokens, completion long-tailed (lognormal, median ~180, capped at 512)."""
  rng = np.random.default_rng(seed)
  prompt = rng.integers(60, 200, n)
  completion = np.minimum(rng.lognormal(np.log(180), 0.5, n).astype(int) + 1, 512)
  return (prompt + completion).tolist()


@pytest.mark.parametrize("dp,n_mb", [(1, 1), (4, 2), (2, 4)])
def test_plan_covers_every_sequence_once(dp, n_mb):
  lengths = gsm8k_like_lengths(256)
  layout = packing.plan(lengths, n_mb, 8192, dp=dp, min_row_len=768)
  assert layout.row_len == 768 and layout.micro_rows % dp == 0
  assert layout.micro_rows * layout.row_len <= max(8192, dp * layout.row_len)
  seen = []
  for k, mbs in enumerate(layout.minibatches):
    for mb in mbs:
      assert len(mb) == layout.micro_rows
      for row in mb:
        assert sum(lengths[i] for i in row) <= layout.row_len
        seen += row
    part = sorted(i for mb in mbs for row in mb for i in row)
    assert len(part) in (256 // n_mb, 256 // n_mb + 1)
  assert sorted(seen) == list(range(256))
  # GSM8K-like lengths pack into rows at > 90% occupancy.
  assert sum(lengths) / (layout.used_rows * layout.row_len) > 0.9


def test_plan_unpacked_is_one_sequence_per_row():
  layout = packing.plan([10, 20, 30], 1, 64, dp=2, packed=False)
  rows = [row for mb in layout.minibatches[0] for row in mb if row]
  assert rows == [[0], [1], [2]] and layout.row_len == 32 and layout.micro_rows == 2


def test_plan_few_shapes():
  """Batches of similar sequences land on few (row_len, micro_rows) shapes."""
  shapes = set()
  for seed in range(30):
    layout = packing.plan(gsm8k_like_lengths(64, seed), 1, 8192, dp=4, min_row_len=768)
    shapes.add((layout.row_len, layout.micro_rows))
  assert len(shapes) <= 2, shapes


def test_plan_doubles_rows_only_when_packing_gains():
  """Sequences under half the row length share doubled rows; near-full ones keep their rows."""
  rng = np.random.default_rng(0)
  short = rng.integers(86, 138, 32).tolist()  # the CPU demo's lengths, budget 176 -> rows of 192
  layout = packing.plan(short, 1, 4096, min_row_len=176)
  assert layout.row_len == 384
  assert layout.used_rows < 24 and sum(short) / layout.computed_tokens > 0.7
  single = packing.plan(short, 1, 4096, min_row_len=176, packed=False)
  assert single.row_len == 192  # without packing, longer rows are only padding
  full = rng.integers(170, 177, 32).tolist()  # one per row of 192 already
  assert packing.plan(full, 1, 4096, min_row_len=176).row_len == 192
  assert packing.plan(short, 1, 300, min_row_len=176).row_len == 192  # 384 > micro_batch_tokens
  for seed in range(10):  # GSM8K-like batches pack well into rows of 768 already
    assert packing.plan(gsm8k_like_lengths(64, seed), 1, 8192, min_row_len=768).row_len == 768


def test_plan_errors():
  with pytest.raises(ValueError, match="no sequences"):
    packing.plan([], 1, 64)
  with pytest.raises(ValueError, match="ppo_n_minibatches"):
    packing.plan([3, 4], 3, 64)


def test_plan_reuses_a_known_shape_within_its_cost():
  """A new shape is avoided when a known one holds the batch for at most REUSE_COST x the tokens;
  a much costlier known shape (or one whose rows are too short) is not taken."""
  lengths = [100] * 6  # alone: rows of 128, 6 rows -> micro_rows bucket 6
  fresh = packing.plan(lengths, 1, 4096)
  assert (fresh.row_len, fresh.micro_rows) == (128, 6)
  reused = packing.plan(lengths, 1, 4096, known={(128, 8)})
  assert (reused.row_len, reused.micro_rows) == (128, 8)
  assert sorted(i for mb in reused.minibatches for m in mb for r in m for i in r) == list(range(6))
  assert packing.plan(lengths, 1, 4096, known={(128, 16)}).micro_rows == 6  # 2.7x the tokens
  assert packing.plan(lengths, 1, 4096, known={(64, 8)}).row_len == 128  # rows too short
  assert packing.plan(lengths, 1, 4096, known={(128, 6), (128, 8)}).micro_rows == 6


def test_reuse_counts_the_attention_of_longer_rows():
  """A known shape of rows twice as long computes the same tokens (reused when only tokens count)
  but costs more attention per token: with the tiny model's attention cost it is not reused."""
  from areal_jax import models  # pylint: disable=import-outside-toplevel

  lengths = [700, 650, 600, 500, 60, 100, 150, 200]  # 4 rows of 768, or 2 of 1536
  fresh = packing.plan(lengths, 1, 4096)
  assert fresh.row_len == 768
  assert fresh.micro_rows == 4
  known = {(1536, 2)}
  assert packing.plan(lengths, 1, 4096, known=known).row_len == 1536  # tokens only: same count
  attn = packing.attention_cost(models.load("tiny")[0].cfg)
  assert 2e-3 < attn < 4e-3
  layout = packing.plan(lengths, 1, 4096, known=known, attn=attn)
  assert layout.row_len == 768
  assert layout.cost(attn) < layout.computed_tokens * (1 + attn * 768)  # causal: half the pairs
  assert packing.plan(lengths, 1, 4096, known=known, attn=attn / 10).row_len == 1536  # cheap attention
