"""``bench/learner.py``'s figure of what a colocated recipe's sampler keeps per device, from shapes
alone, against the memory plan of the engine the run builds."""

import dataclasses
import pathlib
import sys
import types

import jax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import learner as bench_learner  # noqa: E402

from areal_jax import config as config_lib  # noqa: E402
from areal_jax import sharding  # noqa: E402
from areal_jax.models import ModelConfig, Transformer  # noqa: E402
from areal_jax.models import tokenizer as tok_lib  # noqa: E402
from areal_jax.runtime import engines  # noqa: E402
from areal_jax.sampler import memory  # noqa: E402


@pytest.mark.slow
def test_sampler_resident_is_what_the_engine_plans_per_device():
  from flax import nnx
  cfg = ModelConfig(vocab_size=384, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                    d_ff=128)
  c = config_lib.base_config()
  c.model.dtype = "bfloat16"  # weights and cache held in the compute dtype
  c.rollout.num_slots, c.rollout.n_samples = 8, 2
  c.rollout.prefill_buckets, c.rollout.max_new_tokens = (16, 32), 48
  model = Transformer(dataclasses.replace(cfg, dtype="bfloat16"), nnx.Rngs(0))
  mesh = sharding.make_mesh({"data": 2}, jax.devices()[:2])  # a replica per device, 4 slots each
  engine = engines.build(c, model, tok_lib.byte_tokenizer(), mesh, memory_budget=2**40)
  plan = memory.plan(engine.engine, None)
  want = bench_learner.sampler_resident(cfg, c, devices=2)
  assert want["slots"] == plan.num_slots == 4
  assert want["weights"] == plan.weights
  # the plan's state adds each slot's small vectors (position, sampling settings, stop tokens)
  assert 0 <= plan.state - want["state"] < 4 * 128
  assert engine.memory_plan.resident_bytes == plan.resident_bytes


def test_colocated_rows_are_what_the_run_keeps():
  """A colocated row cache's continuation rows in the target plans: one a slot for multi-turn
  episodes, at most what the sampler's budget has room for and what the learner's step leaves;
  none for single-turn episodes."""
  c = config_lib.base_config()
  mb = 2**20
  programs = memory.SamplerPlan(weights=100 * mb, lora_base=0, state=50 * mb, generate_temp=10 * mb,
                                prefill=20 * mb, num_slots=8, budget_bytes=None, row_bytes=mb)
  c.rollout.workflow = "multi_turn"
  room = programs.peak_bytes + 100 * mb
  assert bench_learner.colocated_rows(c, programs, learner_plan(400 * mb, 100 * mb), room) == 8
  assert bench_learner.colocated_rows(c, programs, learner_plan(400 * mb, 397 * mb), room) == 3
  assert bench_learner.colocated_rows(c, programs, learner_plan(400 * mb, 100 * mb),
                                      programs.peak_bytes + 5 * mb) == 5
  # a paged cache keeps turns as pages of its pool: its capacity is one a slot, no bytes beside
  paged = dataclasses.replace(programs, row_bytes=0, kv_pages=64)
  assert bench_learner.colocated_rows(c, paged, learner_plan(400 * mb, 397 * mb), room) == 8
  c.rollout.workflow = "single_turn"
  assert bench_learner.colocated_rows(c, programs, learner_plan(400 * mb, 100 * mb), room) == 0


def learner_plan(budget_bytes: int, peak_bytes: int):
  """The two fields of a learner memory plan the rows are sized by."""
  return types.SimpleNamespace(budget_bytes=budget_bytes, peak_bytes=peak_bytes)
