"""runtime.engines: a backend that needs full weights gets LoRA adapters merged into its base."""

import jax
import pytest
import numpy as np
from flax import nnx

from areal_jax.models import ModelConfig, Transformer, lora
from areal_jax.runtime.engines import MergingEngine


class FakeEngine:
  def __init__(self):
    self.updates = []

  def update_params(self, params, version):
    self.updates.append((params, version))

  def poll(self, timeout=0.0):
    return ["sample"]


def test_merging_engine_hands_merged_weights_and_passes_the_rest_through():
  model = Transformer(ModelConfig(vocab_size=32), nnx.Rngs(0))
  base = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  lcfg = lora.LoraConfig(rank=2, alpha=4.0, targets=("up_proj",))
  ad = lora.init_adapters(base, lcfg, jax.random.key(0))
  ad = jax.tree.map(lambda x: x + 0.5, ad)
  inner = FakeEngine()
  engine = MergingEngine(inner, model, lcfg)
  engine.update_params(ad, 3)
  merged, version = inner.updates[-1]
  assert version == 3 and not lora.is_adapters(merged)
  want = lora.merge(base, ad, lcfg)
  np.testing.assert_array_equal(merged["layers"][1]["mlp"]["up"], want["layers"][1]["mlp"]["up"])
  assert np.abs(np.asarray(merged["layers"][1]["mlp"]["up"] - base["layers"][1]["mlp"]["up"])).max() > 0
  engine.update_params(base, 4)  # full weights go through untouched
  assert inner.updates[-1] == (base, 4)
  assert engine.poll() == ["sample"]


@pytest.fixture(scope="module")
def tiny():
  """What the colocated tests only read, built once for the module: the tiny model's config, its
  weights and tokenizer, and the one-device meshes of the sampler and the learner."""
  import dataclasses

  from areal_jax import sharding
  from areal_jax.models import tokenizer as tok_lib

  cfg = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=32,
                    d_ff=256)
  model = Transformer(dataclasses.replace(cfg), nnx.Rngs(0))
  return dict(cfg=cfg, model=model, tokenizer=tok_lib.byte_tokenizer(),
              mesh=sharding.make_mesh({}, jax.devices()[:1]),
              learner_mesh=sharding.make_mesh(dict(fsdp=1), jax.devices()[:1]))


def _colocated(tiny, slots=16, micro_batch_tokens=2048):
  """A colocated tiny recipe on one CPU device: its config, model, tokenizer, abstract learner
  (the config and the learner fresh: the tests and the plans change them)."""
  from areal_jax import config as config_lib
  from areal_jax.learner import Learner

  c = config_lib.base_config()
  c.mesh.colocated, c.mesh.memory_fraction = True, 1.0
  c.rollout.num_slots, c.rollout.n_samples = slots, 2
  c.rollout.prefill_buckets, c.rollout.max_new_tokens, c.rollout.max_prompt_len = (16,), 496, 16
  c.actor.micro_batch_tokens = micro_batch_tokens
  learner = Learner.abstract(tiny["cfg"], c.actor, tiny["learner_mesh"], max_seq_len=512)
  return c, tiny["model"], tiny["tokenizer"], tiny["mesh"], learner


@pytest.mark.slow
def test_colocated_the_sampler_keeps_its_slots_and_the_learner_plans_beside_them(capsys, tiny):
  """Colocated, the two take turns on one device and each keeps its resident part while the other
  runs: the learner's micro-batch is planned beside what the sampler keeps, not the sampler
  squeezed into what a greedy learner plan left (which starved it: the shipped qwen3_lora recipe's
  learner took 9.54 of its 9.6 GiB on a 16 GiB chip, leaving the sampler's 5.8 GiB no room)."""
  from areal_jax.learner import memory as learner_memory
  from areal_jax.runtime import engines
  from areal_jax.sampler import memory as sampler_memory

  c, model, tokenizer, mesh, learner = _colocated(tiny)
  sampler = sampler_memory.plan(engines.build(c, model, tokenizer, mesh).engine, None)
  kept = sum(learner_memory.kept_bytes(learner).values())
  big = learner_memory.plan(learner, None)
  smallest = learner_memory.step_peak(learner, *learner_memory.shape(learner, 1))["peak"]
  assert big.micro_batch_tokens == 2048 and smallest < big.peak_bytes
  # the learner alone fits at its configured micro-batch; beside the sampler's 16 slots it does not
  budget = big.peak_bytes + sampler.resident_bytes // 2
  assert kept + sampler.peak_bytes <= budget
  c.mesh.device_memory_gib = budget / learner_memory.GIB
  engine = engines.build_planned(c, model, tokenizer, mesh, learner)
  out = capsys.readouterr().out
  assert engine.num_slots == 16 and engine.memory_plan.resident_bytes == sampler.resident_bytes
  assert 0 < learner.opts.micro_batch_tokens < 2048, out
  assert "the colocated sampler keeps" in out and "rollout.num_slots=16" in out
  plan = learner_memory.plan(learner, None)
  assert plan.peak_bytes + sampler.resident_bytes <= budget  # training beside the sampler
  assert kept + engine.memory_plan.peak_bytes <= budget  # generating beside the learner


def test_colocated_the_sampler_yields_slots_when_the_learner_cannot_fit_beside_it(capsys,
                                                                                 monkeypatch, tiny):
  from areal_jax.learner import memory as learner_memory
  from areal_jax.runtime import engines
  from areal_jax.sampler import memory as sampler_memory

  c, model, tokenizer, mesh, learner = _colocated(tiny)
  sampler = sampler_memory.plan(engines.build(c, model, tokenizer, mesh).engine, None)
  kept = sum(learner_memory.kept_bytes(learner).values())
  budget = kept + 2 * sampler.peak_bytes  # room for the sampler's peak beside what the learner keeps
  # a learner whose smallest train step needs all but a third of the sampler's KV cache
  need = budget - sampler.resident_bytes + sampler.state // 3
  planned = []

  def learner_plan(learner, budget_bytes, beside="", publish=None):
    p = learner_memory.Plan(256, 256, 1, need, budget_bytes, {})
    planned.append(budget_bytes)
    if budget_bytes is not None and need > budget_bytes:
      raise learner_memory.DoesNotFit(f"learner memory plan: does not fit{beside}", p)
    return p

  monkeypatch.setattr(learner_memory, "plan", learner_plan)
  c.mesh.device_memory_gib = budget / learner_memory.GIB
  engine = engines.build_planned(c, model, tokenizer, mesh, learner)
  out = capsys.readouterr().out
  assert "rebuilding the sampler with fewer slots" in out and "num_slots=16 does not fit" in out
  assert 2 <= engine.num_slots < 16 and planned[0] == budget - sampler.resident_bytes
  assert need + engine.memory_plan.resident_bytes <= budget == planned[-1] + engine.memory_plan.resident_bytes
  # not even rollout.n_samples slots leave the learner room: the run stops, naming the sampler
  c.rollout.n_samples = 16
  with pytest.raises(MemoryError, match="at least 16 needed: rollout.n_samples"):
    engines.build_planned(c, model, tokenizer, mesh, learner)


def test_colocated_continuation_rows_take_only_what_the_learners_step_leaves(capsys,
                                                                            monkeypatch, tiny):
  """Multi-turn episodes on a row cache keep turns' rows (one a slot where there is room);
  colocated, the learner's micro-batch is planned first, beside the sampler without them, and
  the rows get what its step leaves."""
  from areal_jax.learner import memory as learner_memory
  from areal_jax.runtime import engines
  from areal_jax.sampler import memory as sampler_memory

  c, model, tokenizer, mesh, learner = _colocated(tiny)
  c.rollout.workflow = "multi_turn"
  sampler = sampler_memory.plan(engines.build(c, model, tokenizer, mesh).engine, None)
  kept = sum(learner_memory.kept_bytes(learner).values())
  row = sampler.row_bytes
  budget = kept + sampler.peak_bytes + 20 * row  # the sampler's side: room for all 16 rows
  need = budget - sampler.resident_bytes - 5 * row - row // 2  # the learner's: room for 5
  planned = []

  def learner_plan(learner, budget_bytes, beside="", publish=None):
    planned.append(budget_bytes)
    return learner_memory.Plan(256, 256, 1, need, budget_bytes, {})

  monkeypatch.setattr(learner_memory, "plan", learner_plan)
  c.mesh.device_memory_gib = budget / learner_memory.GIB
  engine = engines.build_planned(c, model, tokenizer, mesh, learner)
  out = capsys.readouterr().out
  assert "16 continuation rows" in out and "5 continuation rows (of 16)" in out, out
  assert planned == [budget - sampler.resident_bytes]  # the learner beside no rows
  assert engine.num_slots == 16 and engine.memory_plan.kept_rows == 5
  assert engine._continued.capacity == 5
  assert need + engine.memory_plan.resident_bytes <= budget  # training beside the rows
  assert kept + engine.memory_plan.peak_bytes <= budget  # generating beside the learner


def test_sampler_budget_colocated_leaves_what_the_learner_keeps(monkeypatch, tiny):
  from areal_jax import host_memory
  from areal_jax.learner import memory as learner_memory
  from areal_jax.runtime import engines

  c, _, _, mesh, learner = _colocated(tiny)
  c.mesh.device_memory_gib, c.mesh.memory_fraction = 1.0, 0.5
  kept = learner_memory.kept_bytes(learner)
  assert kept["params"] > 0 and kept["opt"] > kept["params"] and kept["ref"] == kept["frozen"] == 0
  # a swap's version arrives in the sampler's compute dtype (device_put casts before its copy),
  # while the sampler decodes unless colocated (paused while the learner trains and publishes)
  c.model.dtype = "bfloat16"
  swap = {"incoming_dtype": "bfloat16", "swap_while_decoding": True}
  c.mesh.colocated = False  # disjoint devices: all of theirs
  assert engines.sampler_budget(c, mesh, learner) == {"budget_bytes": 2**29, **swap}
  c.mesh.colocated = True  # its peak beside what the learner keeps; its resident part beside a peak
  assert engines.sampler_budget(c, mesh, learner) == {
      "budget_bytes": 2**29 - sum(kept.values()), "shared_base": False, **swap,
      "swap_while_decoding": False}
  assert engines.sampler_budget(c, mesh, learner, 2**28)["resident_budget"] == 2**29 - 2**28
  assert engines.sampler_budget(c, mesh) == {"budget_bytes": 2**29, **swap}  # no learner (serve)
  c.weights.transfer = "orbax"  # Orbax versions are cast before they are written, too
  assert engines.sampler_budget(c, mesh)["incoming_dtype"] == "bfloat16"
  c.actor.lora.rank = 4  # adapters arrive as the learner holds them
  assert engines.sampler_budget(c, mesh)["incoming_dtype"] == "float32"
  c.actor.lora.rank = 0
  c.mesh.device_memory_gib = 0.0  # CPU reports no size, and neither does the host: no check
  monkeypatch.setattr(host_memory, "available_bytes", lambda: None)
  assert engines.sampler_budget(c, mesh, learner) is None


def test_device_memory_gib_never_exceeds_what_the_devices_report():
  """A GPU reports the pool JAX's allocator took (75% of its memory by default): a plan for the
  card's full size would run out of memory."""
  import types

  from areal_jax import config as config_lib
  from areal_jax.learner import memory as learner_memory

  gib = learner_memory.GIB
  gpu = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": 60 * gib})
  m = config_lib.base_config().mesh
  m.memory_fraction = 0.5
  assert learner_memory.device_budget(m, [gpu]) == 30 * gib  # 0: as reported
  m.device_memory_gib = 80.0
  assert learner_memory.device_budget(m, [gpu]) == 30 * gib  # never more than reported
  m.device_memory_gib = 40.0
  assert learner_memory.device_budget(m, [gpu]) == 20 * gib  # less: as configured
  assert learner_memory.device_budget(m, jax.devices()[:1]) == 20 * gib  # CPU reports none


def test_the_learner_plans_beside_the_version_jax_transfer_offers(capsys, tiny):
  """In ray mode with weights.transfer="jax_transfer" the learner's first device keeps the newest
  version, whole, for the workers to pull (in the sampler's compute dtype): the learner's plan
  leaves it that room; with Orbax nothing stays on a device."""
  from areal_jax.learner import memory as learner_memory
  from areal_jax.runtime import engines, weight_transfer

  c, _, _, _, learner = _colocated(tiny)
  c.mesh.colocated, c.runtime.mode, c.model.dtype = False, "ray", "bfloat16"
  shapes = jax.tree.leaves(learner.abstract_state()["params"])
  params = sum(x.size for x in shapes)
  c.weights.transfer = "orbax"
  assert engines.offered_bytes(c, learner) == 0
  c.weights.transfer = "jax_transfer"
  offered = engines.offered_bytes(c, learner)
  norms = sum(x.size for x in shapes if x.ndim == 1)
  assert offered == 2 * params + 2 * norms  # bfloat16, the norm scales float32
  assert weight_transfer.version_bytes(learner.abstract_state()["params"], None) == 4 * params
  alone = learner_memory.plan(learner, None)
  c.mesh.device_memory_gib = (alone.peak_bytes + offered // 2) / learner_memory.GIB
  plan = engines.plan_learner(c, learner)
  out = capsys.readouterr().out
  assert "the version jax_transfer offers" in out and "does not fit" in out
  # the run's plan also counts the cast each version makes (bfloat16, after the step)
  assert plan.parts["publish"] >= plan.parts["params"] + plan.parts["opt"] + offered // 2
  assert plan.peak_bytes + offered <= alone.peak_bytes + offered // 2  # room left for it
  assert learner.opts.micro_batch_tokens < 2048
