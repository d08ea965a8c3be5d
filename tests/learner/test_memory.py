"""The learner's memory plan: fits / lowers the micro-batch / stops with the keys to change, and
the shipped Qwen2.5-1.5B recipe's planned peak on 4 FSDP devices (abstract shapes, no weights)."""

import copy
import dataclasses
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

from areal_jax import config as config_lib
from areal_jax import sharding
from areal_jax.learner import Learner, memory
from areal_jax.models.transformer import cast_weights

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(ROOT / "bench"))
from common import QWEN25_1P5B  # noqa: E402
from learner_helpers import CFG, actor  # noqa: E402

GIB = 2**30


def fsdp(n):
  return sharding.make_mesh(dict(fsdp=n), jax.devices()[:n])


def small_learner(**kw):
  cfg = dataclasses.replace(CFG, vocab_size=512, d_model=64, d_ff=256)
  return Learner.abstract(cfg, actor(micro_batch_tokens=4096, **kw), fsdp(2), max_seq_len=256)


def test_shape_follows_the_token_budget():
  learner = small_learner()
  assert memory.shape(learner, 4096) == (512, 8)  # rows of 256 doubled, 8 of them (2 per device)
  assert memory.shape(learner, 512) == (512, 2)
  assert memory.shape(learner, 256) == (256, 2)  # at least one row per data-parallel device
  assert memory.shape(learner, 64) == (256, 2)  # a sequence of max_seq_len still fills a row


def test_the_planned_shape_holds_every_micro_batch_the_packer_makes():
  """Whatever the lengths, ``packing.plan``'s micro-batches (rows x row length) are never larger
  than the plan's shape: the plan's peak bounds the step's (a 256-token budget once planned rows
  of 256 while a 1500-token sequence trained in a row of 1536)."""
  import numpy as np

  from areal_jax.learner import packing
  learner = small_learner()
  rng = np.random.default_rng(0)
  for mbt in (64, 128, 256, 512, 1024, 4096):
    row_len, rows = memory.shape(learner, mbt)
    for lengths in ([256] * 8, [256, 17, 90], list(rng.integers(1, 257, 40)), [33] * 64):
      layout = packing.plan([int(n) for n in lengths], 1, mbt, dp=learner.dp,
                            min_row_len=min(256, mbt))
      assert layout.micro_rows * layout.row_len <= rows * row_len, (mbt, lengths)
      assert layout.row_len <= row_len, (mbt, lengths)


@pytest.mark.slow
def test_planner_keeps_lowers_or_stops():
  learner = small_learner()
  roomy = memory.plan(learner, None)
  assert roomy.fits and roomy.micro_batch_tokens == 4096
  parts = roomy.parts
  assert 0 <= parts["grads"] - parts["params"] < 64  # float32 gradient sums (+ metric sums)
  assert 0 <= parts["opt"] - 2 * parts["params"] < 64  # AdamW moments and step counters
  assert parts["peak"] == max(parts["accumulate"], parts["update"]) > parts["params"] + parts["opt"]
  # what it keeps between steps, known without compiling (a colocated sampler's budget)
  assert memory.kept_bytes(learner) == {k: parts[k] for k in ("params", "opt", "ref", "frozen")}
  # A budget between the smallest and the configured micro-batch's peak: a halving that fits.
  smallest = memory.step_peak(learner, *memory.shape(learner, 256))["peak"]
  budget = (smallest + roomy.peak_bytes) // 2
  p = memory.plan(learner, budget)
  assert p.peak_bytes <= budget and 256 <= p.micro_batch_tokens < 4096
  mesh_cfg = config_lib.base_config().mesh
  mesh_cfg.device_memory_gib, mesh_cfg.memory_fraction = budget / GIB, 1.0
  assert memory.fit(learner, mesh_cfg).micro_batch_tokens == p.micro_batch_tokens
  assert learner.opts.micro_batch_tokens == p.micro_batch_tokens  # lowered for the run
  with pytest.raises(MemoryError) as e:
    memory.plan(learner, smallest - 1)
  for key in ("actor.micro_batch_tokens", "actor.remat", "mesh.learner", "mesh.device_memory_gib"):
    assert key in str(e.value)


@pytest.mark.slow
def test_a_micro_batch_the_compiler_refuses_is_halved(monkeypatch):
  """A TPU's compiler refuses a train step that does not fit the chip (libtpu raises
  RESOURCE_EXHAUSTED at compile time): the plan takes it as not fitting and tries the next
  halving, rather than stopping the run."""
  learner = small_learner()
  compile_ = jax.stages.Lowered.compile
  refused = []

  def compile(self, *args, **kwargs):  # refuses programs over micro-batches above 1024 tokens
    rows = [a for a in jax.tree.leaves(self.args_info) if len(a.shape) == 2 and
            a.dtype == jnp.int32 and a.shape[0] * a.shape[1] > 1024]  # the micro-batch's tokens
    if rows:
      refused.append(rows[0].shape)
      raise jax.errors.JaxRuntimeError(
          "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
          "temporaries (23.91G) exceeds available HBM (15.75G).")
    return compile_(self, *args, **kwargs)
  monkeypatch.setattr(jax.stages.Lowered, "compile", compile)
  p = memory.plan(learner, 20 * GIB)
  assert refused and p.fits and p.micro_rows * p.row_len <= 1024 < 4096


@pytest.mark.slow
def test_lora_plan_counts_the_frozen_base_and_adapter_state_only():
  full = memory.plan(small_learner(), None).parts
  # the same shapes with rank-4 adapters on every projection
  opts = actor(micro_batch_tokens=4096)
  opts.lora.rank, opts.lora.alpha = 4, 8.0
  cfg = dataclasses.replace(CFG, vocab_size=512, d_model=64, d_ff=256)
  lora = memory.plan(Learner.abstract(cfg, opts, fsdp(2), max_seq_len=256), None).parts
  assert lora["frozen"] == full["params"]  # float32 compute: the base as the model holds it
  assert full["frozen"] == 0
  assert lora["params"] < full["params"] / 3  # the adapters (replicated) are what trains
  assert 0 <= lora["opt"] - 2 * lora["params"] < 64 and 0 <= lora["grads"] - lora["params"] < 64
  assert lora["peak"] >= lora["frozen"] + lora["params"] + lora["opt"] + lora["grads"]


@pytest.mark.slow
def test_a_published_versions_cast_is_planned_beside_what_the_learner_keeps():
  """A run casts each published version to the sampler's compute dtype on the learner's devices
  (runtime.weight_transfer.version_caster) between steps: the gradients are gone then, the cast
  copy is new. The plan counts it, and stops naming it when it is what does not fit."""
  learner = small_learner()
  params = learner.abstract_state()["params"]
  cast = jax.jit(functools.partial(cast_weights, dtype=jnp.bfloat16))
  parts = memory.plan(learner, None, publish=cast).parts
  copy_bytes = cast.lower(params).compile().memory_analysis().output_size_in_bytes  # per device
  assert parts["params"] / 2 <= copy_bytes < parts["params"]  # matmuls halved, norms float32
  kept = parts["params"] + parts["opt"]
  assert kept + copy_bytes <= parts["publish"] < kept + copy_bytes + 64 * 1024
  # it fits in the room the step's float32 gradients leave: the step still sets the peak
  assert parts["publish"] < parts["accumulate"] == parts["peak"]
  assert memory.plan(learner, None).parts.keys() == parts.keys() - {"publish"}

  # a program that makes n float32 copies, more than the step's peak: the step alone would fit
  n = parts["peak"] // parts["params"] + 2
  copies = jax.jit(lambda p: jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)) + 1, p))
  big = memory.plan(learner, None, publish=copies).parts
  assert big["peak"] == big["publish"] >= kept + n * parts["params"] > big["accumulate"]
  step_only = max(big["accumulate"], big["update"])
  assert memory.plan(learner, step_only).fits
  with pytest.raises(memory.DoesNotFit, match="a published version's cast peaks at"):
    memory.plan(learner, step_only, publish=copies)


def test_no_budget_no_check_on_cpu(monkeypatch):
  """CPU devices report no memory: with ``mesh.device_memory_gib`` unset the budget is the host's
  (tests/runtime/test_host_memory.py), and none (no check) where the system does not say either;
  a configured size is planned against as configured."""
  from areal_jax import host_memory

  monkeypatch.setattr(host_memory, "available_bytes", lambda: None)
  assert memory.device_budget(config_lib.base_config().mesh, jax.devices()[:1]) is None
  mesh_cfg = config_lib.base_config().mesh
  mesh_cfg.device_memory_gib = 16.0
  assert memory.device_budget(mesh_cfg, jax.devices()[:1]) == int(0.9 * 16 * GIB)


@pytest.mark.slow
def test_qwen_1p5b_recipe_fits_16_gib_per_chip_only_with_remat():
  """The shipped recipe (configs/gsm8k.py) on its 4 FSDP learner devices: under 16 GiB per
  device as shipped, far above it with neither remat nor a chunked head (the real depth: the
  layers compile once, under the scan)."""
  c = config_lib.load(str(ROOT / "configs/gsm8k.py"))
  assert (c.actor.remat, c.actor.scan_layers) == ("full", True)
  budget = int(c.mesh.memory_fraction * 16 * GIB)
  max_seq = c.rollout.max_prompt_len + c.rollout.max_new_tokens
  shipped = Learner.abstract(QWEN25_1P5B, copy.deepcopy(c.actor), fsdp(4), max_seq_len=max_seq)
  p = memory.plan(shipped, budget)
  assert p.micro_batch_tokens == c.actor.micro_batch_tokens and p.peak_bytes < 16 * GIB
  plain = copy.deepcopy(c.actor)
  plain.remat, plain.logits_chunk = "none", 0
  learner = Learner.abstract(QWEN25_1P5B, plain, fsdp(4), max_seq_len=max_seq)
  # (the optimizer update is the same program with or without remat: its cost is reused)
  no_remat = memory.step_peak(learner, p.row_len, p.micro_rows, p.update_cost)["peak"]
  assert no_remat > 16 * GIB
  print(f"planned peak per device: {p.peak_gib:.2f} GiB shipped, {no_remat / GIB:.2f} without")
