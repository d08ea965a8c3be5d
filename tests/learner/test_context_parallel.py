"""Context parallelism (``mesh.learner.context``): a train step whose rows' positions are split over
2 or 4 devices, alone or with data / FSDP / tensor axes, equals the one-device step (loss, metrics
and gradients within 1e-5, float32) on packed rows whose sequences cross the blocks' boundaries,
with the attention across devices as an all-to-all of heads (``ulysses``) and as a ring.

XLA compiles dominate: one reference learner for the module, one learner per case, and the
gradient of one minibatch (one compiled function) compared per case."""

import pathlib
import sys

import jax
import numpy as np
import pytest

from areal_jax import sharding
from areal_jax.learner import Learner, memory, packing

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from learner_helpers import actor, assert_trees_close, batch, mesh, model  # noqa: E402

ROW = 64  # row length (max_seq_len): blocks of 32 or 16 positions
# GSPO's sequence means and sequence-level behaviour weights reduce over segments that span
# blocks; the LM head in chunks takes positions from every block.
OPTS = dict(seq_level_ratio=True, behav_imp_weight_level="sequence", logits_chunk=96)
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def data():
  """A batch of 16 sequences of up to 29 tokens, and the one-device step's gradient and metrics
  (the dense attention)."""
  groups, rewards = batch(5, groups=4, n=4, max_prompt=10, max_new=20)
  ref = Learner(model(), actor(**OPTS), mesh(1), max_seq_len=ROW)
  return groups, rewards, ref.gradients(groups, rewards)


def crossing_segments(rows_packed, blocks: int) -> int:
  """Sequences of the packed rows that span a boundary between two of a row's ``blocks``."""
  n = 0
  for p in rows_packed:
    ids, width = p.segment_ids, p.segment_ids.shape[1] // blocks
    for edge in range(width, ids.shape[1], width):
      n += int(np.sum((ids[:, edge - 1] == ids[:, edge]) & (ids[:, edge] > 0)))
  return n


def check_case(data, monkeypatch, axes: dict, impl: str, **opts):
  groups, rewards, (g_ref, m_ref) = data
  packed = []
  pack = packing.pack
  monkeypatch.setattr(packing, "pack", lambda *a, **kw: packed.append(pack(*a, **kw)) or packed[-1])
  n = int(np.prod(list(axes.values())))
  learner = Learner(model(), actor(context_attention=impl, **OPTS, **opts), mesh(n, **axes),
                    max_seq_len=ROW)
  traced = []
  from areal_jax.kernels import context_attention as context_kernels
  for name in ("ring", "ulysses"):
    fn = getattr(context_kernels, name)
    monkeypatch.setattr(context_kernels, name,
                        lambda *a, fn=fn, name=name: traced.append(name) or fn(*a))
  g, m = learner.gradients(groups, rewards)
  assert set(traced) == {impl}
  assert crossing_segments(packed, axes["context"]) >= 2
  assert learner.row_sharding.spec[1] == "context"  # positions split over the axis, weights too
  assert any("context" in str(x.sharding.spec) for x in jax.tree.leaves(learner.params()))
  for k in ("loss", "pg_loss", "clip_frac", "entropy", "approx_kl", "behav_weight_mean"):
    np.testing.assert_allclose(m[k], m_ref[k], err_msg=k, **TOL)
  assert_trees_close(g, g_ref, **TOL)
  return learner


@pytest.mark.parametrize("axes,impl", [(dict(context=2), "ulysses"), (dict(context=4), "ring")])
def test_context_parallel_step_equals_one_device(data, monkeypatch, axes, impl):
  check_case(data, monkeypatch, axes, impl)


@pytest.mark.slow
@pytest.mark.parametrize("axes,impl,opts", [
    (dict(data=2, fsdp=2, context=2), "ring", dict(scan_layers=True, remat="full")),
    (dict(fsdp=2, context=4), "ulysses", {}),  # 4 heads over 4 devices: K/V heads repeated
    (dict(fsdp=2, context=2, tensor=2), "ulysses", {}),
    (dict(data=2, context=2, tensor=2), "ring", {}),
])
def test_context_parallel_with_data_fsdp_tensor_equals_one_device(data, monkeypatch, axes, impl,
                                                                   opts):
  check_case(data, monkeypatch, axes, impl, **opts)


def test_auto_picks_ulysses_where_heads_divide_and_rejects_it_where_not():
  from areal_jax.kernels import choice
  for axes, want in ((dict(context=2), "ulysses"), (dict(context=4), "ulysses"),
                     (dict(context=4, tensor=2), "ring"), (dict(context=8), "ring")):
    with sharding.use(mesh(int(np.prod(list(axes.values()))), **axes)):
      assert choice.context_attention("auto", 4, 64) == want, axes
  with sharding.use(mesh(8, context=8)):
    with pytest.raises(ValueError, match="ulysses.*4 query heads.*tensor x mesh.learner.context"):
      choice.context_attention("ulysses", 4, 64)


def test_rows_are_a_multiple_of_the_context_axis():
  layout = packing.plan([5, 7, 40], 1, 4096, multiple=3)
  assert layout.row_len % 3 == 0 and layout.row_len >= 40
  learner = Learner.abstract(model().cfg, actor(), mesh(8, fsdp=2, context=4), max_seq_len=30)
  row_len, rows = memory.shape(learner, 4096)
  assert row_len % 4 == 0 and rows % 2 == 0


@pytest.mark.slow
def test_the_memory_plan_counts_the_context_axis():
  """The plan compiles the step with each row's positions split: with context 2 beside FSDP 2, a
  device holds half the weights (split over fsdp x context) and its step of rows whose
  activations dominate needs about half as much (measured: 0.54 of it)."""
  plans = {}
  for n, axes in ((2, dict(fsdp=2)), (4, dict(fsdp=2, context=2))):
    learner = Learner.abstract(model().cfg, actor(), mesh(n, **axes), max_seq_len=64)
    plans[n] = memory.step_peak(learner, *memory.shape(learner, 128))
  assert plans[4]["params"] < 0.55 * plans[2]["params"]
  assert plans[4]["accumulate"] < 0.6 * plans[2]["accumulate"], plans


@pytest.mark.slow
def test_ulysses_around_the_flash_kernel_equals_one_device(data, monkeypatch):
  """On GPU and TPU Ulysses runs the platform's flash kernel per head group: the Pallas GPU
  kernel (interpret mode on these CPU devices) under ``shard_map`` with the heads split over
  tensor x context trains as the one-device dense step."""
  from areal_jax.kernels import causal_attention
  traced, attend = [], causal_attention.attend
  monkeypatch.setattr(causal_attention, "attend", lambda *a, **kw: traced.append(a[4]) or attend(
      *a, **kw))
  check_case(data, monkeypatch, dict(fsdp=2, context=2), "ulysses", attention="pallas_gpu")
  assert traced and set(traced) == {"pallas_gpu"}
