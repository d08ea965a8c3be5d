"""Builds the rollout engine named by ``rollout.backend`` on the sampler mesh.

With LoRA (``actor.lora.rank > 0``) the learner publishes adapters only. The JAX sampler merges
them into its own copy of the base weights once per version; the in-process vLLM engine loads them
with vLLM's own LoRA support (a PEFT directory per version); the vLLM server engine gets merged
weights from ``MergingEngine`` (a host-side merge before each reload).

A sampler mesh with a data axis gets one JAX engine per data index (``sampler.replicas``), each
with ``rollout.num_slots / data`` slots on its own devices, unless ``rollout.data_parallel`` is
``"sharded"`` (one engine, its slots split over the data axis).
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from areal_jax import sharding
from areal_jax.learner import memory as learner_memory
from areal_jax.models import lora as lora_lib
from areal_jax.rollout_api import RolloutEngine
from areal_jax.runtime import weight_transfer

DATA_PARALLEL = ("replicas", "sharded")  # rollout.data_parallel: the JAX sampler over a data axis


def swap_plan(config, beside_learner: bool) -> dict:
  """How the sampler's memory plan counts a weight swap (``sampler.memory.plan``'s keywords): the
  version arriving in ``weight_transfer.version_dtype`` (float32 where that is None), beside decode
  calls unless colocated with a learner in this process (the sampler is paused while it trains and
  publishes)."""
  return {"incoming_dtype": weight_transfer.version_dtype(config) or "float32",
          "swap_while_decoding": not (config.mesh.colocated and beside_learner)}


def weight_swap(config) -> str:
  """``rollout.weight_swap`` as the JAX sampler takes it: "auto" is "pause" colocated (the sampler
  is idle during a swap anyway), else left to the memory plan (``sampler.memory.fit``)."""
  mode = config.rollout.get("weight_swap", "auto")
  return "pause" if mode == "auto" and config.mesh.colocated else mode


def sampler_budget(config, sampler_mesh, learner=None, learner_peak: int | None = None
                   ) -> dict | None:
  """``build``'s ``memory_budget`` for the JAX sampler: the memory of this process's sampler
  devices (``learner.memory.device_budget``: ``mesh.memory_fraction`` of ``mesh.device_memory_gib``
  or of what they report). Colocated (learner and sampler alternate on the same devices) with the
  ``learner`` of this process: the sampler's peak beside what the learner keeps between steps
  (``learner.memory.kept_bytes``), and with ``learner_peak`` (bytes per device of its smallest
  train step) its resident part beside that. Without a learner (the serve runtime, a learner
  group) the sampler alone is checked against the devices (on CPU, the host's memory:
  ``learner.memory.host_budget``). None where no size is known: no check. A weight swap is
  planned as ``swap_plan``."""
  budget = learner_memory.device_budget(config.mesh, [
      d for d in sampler_mesh.devices.flat if d.process_index == jax.process_index()])
  if budget is None:
    return None
  swap = swap_plan(config, learner is not None)
  if not config.mesh.colocated or learner is None:
    return {"budget_bytes": budget, **swap}
  kept = learner_memory.kept_bytes(learner)
  # LoRA: the sampler merges into the learner's frozen base itself when both use one dtype
  shared = kept["frozen"] > 0 and config.actor.dtype == config.model.dtype
  out = {"budget_bytes": budget - sum(kept.values()), "shared_base": shared, **swap}
  if learner_peak is not None:
    out["resident_budget"] = budget - learner_peak
  return out


def build_planned(config, model, tokenizer, sampler_mesh, learner=None) -> RolloutEngine:
  """``build`` with the memory plans of the sampler and of this process's ``learner`` (None: a
  learner group, which plans in its own processes). On disjoint devices each is planned against
  its own devices, the learner first. Colocated, the two take turns on the same
  devices and each keeps its resident part while the other runs: the sampler is planned first
  (its peak beside what the learner keeps; ``rollout.num_slots`` lowered only if that does not
  fit), then the learner's micro-batch beside what the sampler keeps (weights, KV cache). When not
  even the learner's smallest micro-batch fits there, the sampler is rebuilt with the slots that
  leave it room (printed), or the run stops naming both. A row cache's continuation rows
  (``turns_kept``) come last: the learner is planned beside the sampler without them, and they
  get what its step leaves (printed when fewer than the sampler's plan gave them)."""
  if learner is not None and not config.mesh.colocated:  # each on devices of its own
    plan_learner(config, learner)
    learner = None
  budget = sampler_budget(config, sampler_mesh, learner)
  engine = build(config, model, tokenizer, sampler_mesh, memory_budget=budget)
  if learner is None:
    return engine
  sampler = getattr(engine, "memory_plan", None)
  if sampler is None:  # (no budget: nothing to check)
    plan_learner(config, learner)
    return engine
  rows = sampler.kept_rows
  sampler = dataclasses.replace(sampler, kept_rows=0)  # (the learner's micro-batch comes first)
  try:
    learner_plan = plan_learner(config, learner, sampler)
  except learner_memory.DoesNotFit as e:
    print(f"learner memory plan: not even {e.smallest.micro_batch_tokens} tokens a micro-batch "
          f"({e.smallest.peak_gib:.2f} GiB) fit beside the "
          f"{sampler.resident_bytes / learner_memory.GIB:.2f} "
          f"GiB the colocated sampler keeps ({sampler.num_slots} slots); rebuilding the sampler "
          "with fewer slots", flush=True)
    del engine  # its weights and programs go before the next engine places its own
    budget = sampler_budget(config, sampler_mesh, learner, e.smallest.peak_bytes)
    engine = build(config, model, tokenizer, sampler_mesh, memory_budget=budget)
    sampler = engine.memory_plan
    rows, sampler = sampler.kept_rows, dataclasses.replace(sampler, kept_rows=0)
    learner_plan = plan_learner(config, learner, sampler)
  if rows and learner_plan is not None:  # rows: what the learner leaves
    rows = rows_beside_learner(rows, sampler.row_bytes, learner_plan)
    if rows != engine.memory_plan.kept_rows:
      print(f"sampler memory plan: {rows} continuation rows (of {engine.memory_plan.kept_rows}) "
            "fit beside the colocated learner's step", flush=True)
  plan = dataclasses.replace(sampler, kept_rows=rows)
  for one in [engine, *getattr(engine, "replicas", [])]:
    one.memory_plan = plan
  return engine


def offered_bytes(config, learner) -> int:
  """Bytes of the newest version that ``jax_transfer``'s publisher keeps on the learner's first
  device for the rollout workers to pull (``runtime.mode="ray"``, ``weights.transfer=
  "jax_transfer"``): the trained parameters whole (with LoRA the adapters), in
  ``weight_transfer.version_dtype``; 0 for any other transfer."""
  if config.runtime.mode != "ray" or config.weights.transfer != "jax_transfer":
    return 0
  return weight_transfer.version_bytes(learner.abstract_state()["params"],
                                      weight_transfer.version_dtype(config))


def plan_learner(config, learner, sampler=None):
  """``learner.memory.fit`` (beside ``sampler``: a colocated sampler's ``SamplerPlan``, and a
  version ``jax_transfer`` offers from the first device, ``offered_bytes``: the plan is per device,
  its fullest; with the cast each published version makes, ``weight_transfer.version_caster``),
  printed."""
  beside = "" if sampler is None else (
      f", less {sampler.resident_bytes / learner_memory.GIB:.2f} GiB the colocated sampler keeps: "
      f"weights and KV cache of rollout.num_slots={sampler.num_slots}")
  offered = offered_bytes(config, learner)
  if offered:
    beside += (f", less {offered / learner_memory.GIB:.2f} GiB the version jax_transfer offers "
               "the rollout workers from the first device")
  plan = learner_memory.fit(learner, config.mesh,
                            (sampler.resident_bytes if sampler else 0) + offered, beside,
                            weight_transfer.version_caster(config))
  if plan is not None:
    print(f"learner memory plan: {plan.peak_gib:.2f} GiB per device of "
          f"{plan.budget_bytes / learner_memory.GIB:.2f} GiB{beside} (actor.micro_batch_tokens="
          f"{plan.micro_batch_tokens}: {plan.micro_rows} rows x {plan.row_len})", flush=True)
  return plan


def rows_beside_learner(rows: int, row_bytes: int, learner_plan) -> int:
  """Of ``rows`` continuation rows of ``row_bytes``, those that fit in what a colocated learner's
  step leaves of its budget (``learner_plan``: planned beside the sampler without rows); all of
  them for a paged cache's (``row_bytes`` 0: kept as pages of its pool)."""
  if not row_bytes:
    return rows
  return min(rows, max(0, learner_plan.budget_bytes - learner_plan.peak_bytes) // row_bytes)


def turns_kept(config, num_slots: int, keep_turns: bool = False) -> int:
  """Continuation rows a row cache's memory plan makes room for (``SamplerPlan.with_rows``): a
  finished turn's KV kept for the episode's next turn, one a slot, where the workflow runs
  episodes of several turns (``rollout.workflow``) or the caller keeps every turn (``keep_turns``:
  the server's chats, ``serve.keep_turns``); none for single-turn episodes."""
  multi_turn = config.rollout.get("workflow", "single_turn") != "single_turn"
  return num_slots if multi_turn or keep_turns else 0


def engine_settings(config, num_slots: int, kv_pages: int | None = None) -> dict:
  """The JAX sampler's ``EngineConfig`` fields the ``rollout`` section sets, for ``num_slots``
  slots (``kv_pages``: a pool that replaces ``rollout.kv_pages``, as a memory plan sizes it).
  One place, so the run (``build``) and the target plans (``bench/learner.py``) build one engine."""
  r = config.rollout
  return dict(
      num_slots=num_slots, max_len=max(r.prefill_buckets) + r.max_new_tokens,
      prefill_buckets=tuple(r.prefill_buckets), steps_per_call=r.steps_per_call,
      decode_attention=r.decode_attention, decode_matmul=r.decode_matmul,
      decode_layers=r.decode_layers, decode_projections=r.get("decode_projections", "auto"),
      kv_pages=r.get("kv_pages", -1) if kv_pages is None else kv_pages,
      page_size=r.get("page_size", 64), max_prefill_tokens=r.get("max_prefill_tokens", 0),
      prefill_attention=r.get("prefill_attention", "auto"),
      decode_tuning=r.get("decode_tuning", "auto"))


def build(config, model, tokenizer, sampler_mesh, memory_budget=None,
          keep_turns: bool = False) -> RolloutEngine:
  """``keep_turns``: the caller asks the sampler to keep finished turns whatever the workflow
  (``turns_kept``). ``memory_budget``: bytes per sampler device the JAX sampler may use, or a dict of
  ``sampler.memory.check``'s keyword arguments (``budget_bytes``, ``resident_budget``,
  ``shared_base``); its memory plan is checked against it before the decode state is allocated,
  with a paged cache's pool of the pages that fit, or fewer slots than ``rollout.num_slots``, when
  those do not fit (``sampler.memory.fit``; every replica as the first one's plan says), and kept
  as the JAX engine's ``memory_plan`` (per device; None without a budget)."""
  r = config.rollout
  lora = lora_lib.LoraConfig.from_config(config.actor.get("lora"))
  if r.backend == "jax":
    from areal_jax.sampler import memory, replicas
    from areal_jax.sampler.service import JaxRolloutEngine

    def make(num_slots, mesh=sampler_mesh, output=None, kv_pages=None):  # (None: the config's)
      settings = engine_settings(config, num_slots, kv_pages)
      return JaxRolloutEngine(model, mesh=mesh, continuation=r.continuation,
                              eos_token_ids=tuple(tokenizer.eos_token_ids), lora=lora,
                              output=output, weight_swap=swap,
                              prefill_chunk=r.get("prefill_chunk", -1), **settings)

    budget = memory_budget if isinstance(memory_budget, dict) or memory_budget is None \
        else {"budget_bytes": memory_budget}
    mode = weight_swap(config)  # (how a version lands; "auto": as the memory plan says)
    if budget is not None:
      budget = {**swap_plan(config, False), "weight_swap": mode, **budget}
    swap = "overlap" if mode == "auto" else mode  # (until a plan says it must pause)

    def decided(engine, plan):  # the plan's choice, also for the replicas built after it
      nonlocal swap
      if plan.swap_pauses:
        swap = engine.weight_swap = "pause"

    meshes = replica_meshes(sampler_mesh, r.get("data_parallel", "replicas"))
    if meshes is None:  # one engine (its slots split over the data axis, if any)
      if budget is None:
        engine, plan = make(r.num_slots), None
      else:
        engine, plan = memory.fit(make, r.num_slots, min_slots=r.n_samples, **budget)
        decided(engine, plan)
        plan = plan.with_rows(turns_kept(config, plan.num_slots, keep_turns))
        print(f"sampler memory plan: {plan.summary()}", flush=True)
      engine.memory_plan = plan  # (per device; None: unplanned)
      return engine
    slots = r.num_slots // len(meshes)  # per replica (the first one's memory plan may lower it)
    pages = None  # a paged pool the first one's plan sized to its memory, for all of them
    plans = []

    def make_replica(mesh, output):
      nonlocal slots, pages
      if budget is None or mesh is not meshes[0]:
        engine = make(slots, mesh, output, pages)
        engine.memory_plan = plans[0] if plans else None  # (the first one's: the same engine)
        return engine
      engine, plan = memory.fit(lambda s, **kw: make(s, mesh, output, **kw), slots,
                                min_slots=r.n_samples, **budget)
      decided(engine, plan)
      plan = plan.with_rows(turns_kept(config, plan.num_slots, keep_turns))
      engine.memory_plan = plan  # (the launch it times must fit it: JaxRolloutEngine.tune_launch)
      slots = plan.num_slots
      pages = None if plan.pool_follows_slots or not plan.kv_pages else plan.kv_pages
      plans.append(plan)
      print(f"sampler memory plan (each of {len(meshes)} replicas): {plan.summary()}", flush=True)
      return engine

    engine = replicas.ReplicatedRolloutEngine(make_replica, meshes)
    engine.memory_plan = plans[0] if plans else None  # (per device: each replica's)
    return engine
  if r.backend == "vllm":  # optional: needs vLLM (make install-vllm), raises a clear error without
    from areal_jax.vllm_rollout.factory import build as build_vllm

    engine = build_vllm(config, model, tokenizer, sampler_mesh)
    native = getattr(engine, "lora", None) is not None  # vLLM applies the adapters itself
    return engine if lora is None or native else MergingEngine(engine, model, lora)
  raise ValueError(f"rollout.backend={r.backend!r} is not one of ('jax', 'vllm')")


def replica_meshes(sampler_mesh, data_parallel: str):
  """The sub-meshes of the JAX sampler's replicas (``sampler.replicas``: one per index of the
  data axis), or None for one engine: ``rollout.data_parallel="sharded"``, no data axis, or a
  mesh with devices of other processes (a multi-process mesh runs one program on all of them)."""
  if data_parallel not in DATA_PARALLEL:
    raise ValueError(f"rollout.data_parallel={data_parallel!r} is not one of {DATA_PARALLEL}")
  local = all(d.process_index == jax.process_index() for d in sampler_mesh.devices.flat)
  if data_parallel == "sharded" or sampler_mesh.shape.get("data", 1) == 1 or not local:
    return None
  return sharding.split_mesh(sampler_mesh, "data")


class MergingEngine:
  """Wraps an engine that needs full weights: ``update_params`` with LoRA adapters hands it the
  base weights (those of ``model``) with the adapters merged; everything else passes through."""

  def __init__(self, engine, model, lora: lora_lib.LoraConfig):
    self.engine, self.lora = engine, lora
    self.base = nnx.to_pure_dict(nnx.state(model, nnx.Param))

  def update_params(self, params, version: int) -> None:
    if lora_lib.is_adapters(params):
      params = lora_lib.merge(self.base, jax.device_get(params), self.lora)
    self.engine.update_params(params, version)

  def __getattr__(self, name):
    return getattr(self.engine, name)
