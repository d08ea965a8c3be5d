"""Learner throughput: trained tokens/s, model-FLOPs utilization, and packing efficiency.

  python bench/learner.py [--quick] [--only ROWS] [--json PATH]
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/learner.py --plan [--json PATH]
  python bench/learner.py --plan --target v5e:2x4 [--only default,qwen3_lora]  # compiled for a TPU
  python bench/learner.py --depth [--json PATH]

Workload: GRPO batches with GSM8K-like lengths (prompt 60..200 tokens, completion log-normal with
median ~180, capped at 512), random tokens, random rewards and behaviour logprobs. One timed
``Learner.train_step`` = recompute the proximal logprobs (one forward) + ``ppo_n_minibatches``
updates over packed micro-batches. A first, untimed step compiles (for the 30-layer model on a
2-prompt batch of the same micro-batch shape); compilations in timed steps are counted
(``compiles_timed``) and their seconds taken out of the timed wall time (steady state: a shape
compiles once).
The full run trains SmolLM2-135M on 64 sequences a step (16 prompts x 4 samples), a small RL batch
(packing 32 sequences into rows of 768 leaves ~12% padding, 64 ~7%: see ``packing_efficiency``).

  tokens/s  = real (non-padding) tokens of the batch / train_step wall time
  mfu       = 6 x params x tokens / time / measured float32 matmul FLOP/s
  (with ppo_n_minibatches = 1 there is no separate proximal forward: the update's own forward
  provides the proximal logprobs; with more minibatches the extra forward is not credited).
The full run adds ``smollm2-135m-short``: the CPU demo's lengths (prompt ~80, answers 16-48
tokens, 32 sequences per step; JSON ``mfu_short``). Attention is causal-blocked over each packed
row (``transformer.causal_attention``), so long rows (GSM8K-like, 768) still spend uncredited time on
attention masked between segments; short rows hardly do.
``remat`` rows run the same workload with ``actor.remat`` (layers under one ``lax.scan``, the LM
head 1024 tokens at a time); every row gives ``plan_peak_gib``, the memory plan's peak per device
for its micro-batch shape (``areal_jax/learner/memory.py``: the compiled step's memory analysis).
LoRA rows (``-lora16``: ``actor.lora`` rank 16, alpha 32, on every attention and MLP projection)
train adapters on the frozen base, side by side with full fine-tuning of the same shape and batch.
Their MFU credits 4 x params per token (forward + activation gradients: no weight gradients);
``plan_peak_gib`` counts the frozen base (an argument of the step). Per row also:
  publish s    one weight version as the runtime publishes it: ``params()`` (LoRA: the adapters)
               copied with ``jax.device_put`` to a second device (best of 3); ``pub MiB`` the bytes
               moved; ``merge s`` the sampler's merge of the adapters into its base
               (``DecodeEngine.put_params``' jitted merge, LoRA only); ``orbax s`` /
               ``orbax MiB`` the same version saved with Orbax (``weights.transfer=orbax``) and
               its size on disk. Run with 2+ devices (XLA_FLAGS) for a real copy between devices.
``--only ROWS`` runs the named rows only (comma-separated).
``--quick`` uses SmolLM2-135M layer shapes with 6 of the 30 layers (the 30-layer compile alone
takes minutes on 2 cores) and a single timed step.

The matmul throughput is measured on the spot (best of several square float32 matmuls on the same
device), so MFU is relative to what this machine actually does, not a datasheet figure. Packing
efficiency = real tokens / (rows used x row length) over many GSM8K-like batches; the step's
padding efficiency also counts the padding rows that round micro-batches up to a bucketed shape.
``--depth`` compiles the train forward and backward (``remat="full"``, 2 rows of 768) of SmolLM2
shapes at 2, 8 and 30 layers, unrolled and under the scan, and prints the compile seconds.
``--plan`` times nothing: it prints the memory plan of the shipped recipes (configs/gsm8k.py, the
default on 4 FSDP devices of 16 GiB, ``:qwen7b`` on 8 80 GB GPUs, which report 60 GiB under JAX's
allocator, ``:qwen3`` as the default, ``:qwen3_lora`` on one of 16 GiB) for Qwen2.5-1.5B and -7B and
Qwen3-1.7B shapes,
compiled on abstract shapes for fake CPU devices. A colocated recipe's learner is planned beside
what its sampler keeps (``sampler_resident``: weights and KV cache, from shapes), as a run plans
it; with ``--target`` and a model under 3B parameters the sampler's own plan is compiled for the
target too (``aot_decode.sampler_plan``: its decode and prefill programs, random weights built on
this CPU) and checked beside the learner, and a row cache's continuation rows for multi-turn
episodes (``sampler_kept_rows``) are what the learner's step leaves, as the run keeps them;
with ``--target`` for the accelerator's own compiler on a machine without one (in a venv with
``jax[tpu]`` or ``jax[cuda12]``, as bench/aot_decode.py):
  python bench/learner.py --plan --target v5e:2x4                  # a TPU v5e-8's chips
  python bench/learner.py --plan --only qwen7b --target h100 --devices 8
  python bench/learner.py --plan --only qwen3_32k_v5p --target v5p:2x2x1   # thinking at 32k
  python bench/learner.py --plan --target v5e:2x4 --only default \
      --set rollout.max_new_tokens=8192 [--set actor.attention=dense]   # long rows, either attention
(the train step's attention is the target's flash kernel unless ``actor.attention`` says dense;
a program the target's compiler refuses for want of memory counts as not fitting.)
XLA:CPU keeps float32 copies of bfloat16 matmul weights that a TPU or GPU multiplies as they are,
so its figures run higher than the target's; run on an accelerator, the plan compiles for it.
Runs on one device (all cores); set XLA_FLAGS as you like, only ``jax.devices()[0]`` is used.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import tempfile
import time

import jax
import numpy as np
from flax import nnx
from jax._src import monitoring  # unregistering a listener is not public API

from areal_jax import config as config_lib
from areal_jax import sharding
from areal_jax.learner import Learner, memory, packing
from areal_jax.models import ModelConfig, Transformer
from areal_jax.models import lora as lora_lib
from areal_jax.rollout_api import Sample
from areal_jax.runtime import engines, weight_transfer
from areal_jax.sampler import memory as sampler_memory
from common import (QWEN3_1P7B, QWEN25_1P5B, QWEN25_7B, SMOLLM2, TINY, Hardware, machine,
                    override_all)

# (name, preset, shape, GiB per device the recipe is written for; 80 GB GPUs report 60: JAX's
# allocator takes 75% of a GPU by default, XLA_PYTHON_CLIENT_MEM_FRACTION)
RECIPES = (("qwen2.5-1.5b", "default", QWEN25_1P5B, 16.0), ("qwen2.5-7b", "qwen7b", QWEN25_7B, 60.0),
           ("qwen3-1.7b", "qwen3", QWEN3_1P7B, 16.0), ("qwen3-1.7b", "qwen3_lora", QWEN3_1P7B, 16.0),
           # thinking at 32k, each with --only and its --target (a v5p chip: 95 GB = 88.5 GiB)
           ("qwen3-1.7b", "qwen3_32k_v5p", QWEN3_1P7B, 88.0),
           ("qwen3-1.7b", "qwen3_32k_h100", QWEN3_1P7B, 60.0))

def gsm8k_lengths(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
  prompt = rng.integers(60, 200, n)
  completion = np.minimum(rng.lognormal(np.log(180), 0.5, n).astype(int) + 1, 512)
  return prompt, completion


def short_lengths(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
  """The CPU demo's lengths (configs/arithmetic.py): chat prompt ~80 tokens, one-sentence answers."""
  return rng.integers(70, 90, n), rng.integers(16, 49, n)


LENGTHS = {"gsm8k": gsm8k_lengths, "short": short_lengths}


def make_batch(rng, groups: int, n: int, vocab: int, lengths: str = "gsm8k"):
  prompts, completions = LENGTHS[lengths](rng, groups * n)
  out, rewards = [], []
  for g in range(groups):
    prompt = rng.integers(0, vocab, prompts[g * n]).tolist()
    samples = []
    for i in range(n):
      c = int(completions[g * n + i])
      samples.append(Sample(g, i, prompt, rng.integers(0, vocab, c).tolist(),
                            rng.normal(-3.0, 0.3, c).tolist(), [0] * c, "eos"))
    out.append(samples)
    rewards.append(rng.integers(0, 2, n).astype(float).tolist())
  return out, rewards


def packing_efficiency(batches: int, groups: int, n: int, row_len: int) -> float:
  rng = np.random.default_rng(1)
  real = slots = 0
  for _ in range(batches):
    prompts, completions = gsm8k_lengths(rng, groups * n)
    lengths = (prompts + completions).tolist()
    layout = packing.plan(lengths, 1, 1 << 30, min_row_len=row_len)
    real += sum(lengths)
    slots += layout.used_rows * layout.row_len
  return real / slots


def bench_model(name: str, cfg: ModelConfig, groups: int, n: int, steps: int, peak: float,
                micro_batch_tokens: int, max_seq_len: int = 768, lengths: str = "gsm8k",
                warmup_groups: int | None = None, remat: str = "none",
                lora_rank: int = 0) -> dict:
  """``warmup_groups``: prompt groups of the untimed compile step (default ``groups``); fewer
  save minutes on big models when they give the same micro-batch shape (checked: a compilation in a
  timed step is counted and reported). ``remat`` other than "none": that policy with the layers
  scanned and the LM head in chunks of 1024 tokens. ``lora_rank`` > 0: LoRA adapters of that rank
  (alpha 2 x rank) on a frozen base."""
  opts = config_lib.base_config().actor
  opts.micro_batch_tokens = micro_batch_tokens
  if remat != "none":
    opts.remat, opts.scan_layers, opts.logits_chunk = remat, True, 1024
  opts.lora.rank, opts.lora.alpha = lora_rank, 2.0 * lora_rank
  mesh = sharding.make_mesh({}, jax.devices()[:1])
  model = Transformer(cfg, nnx.Rngs(0))
  learner = Learner(model, opts, mesh, temperature=1.0, max_seq_len=max_seq_len)
  del model
  rng = np.random.default_rng(0)
  t = time.perf_counter()
  learner.train_step(*make_batch(rng, warmup_groups or groups, n, cfg.vocab_size, lengths))  # compile
  compile_s = time.perf_counter() - t
  times, tokens, metrics, compiles = [], [], {}, []
  count = lambda event, duration, **_: compiles.append(duration) if "backend_compile" in event else None
  monitoring.register_event_duration_secs_listener(count)
  for _ in range(steps):
    groups_, rewards = make_batch(rng, groups, n, cfg.vocab_size, lengths)
    t = time.perf_counter()
    metrics = learner.train_step(groups_, rewards)
    jax.block_until_ready(learner.params())
    times.append(time.perf_counter() - t)
    tokens.append(metrics["tokens"])
  monitoring.unregister_event_duration_listener(count)
  if compiles:
    print(f"{name}: {len(compiles)} compilations ({sum(compiles):.1f} s) inside timed steps, "
          f"not counted")
  plan = memory.step_peak(learner, metrics["row_len"], metrics["micro_rows"])
  busy_s = sum(times) - sum(compiles)
  tok_s = sum(tokens) / busy_s
  p = learner.num_params if learner.frozen is None else _nbytes(learner.frozen, elements=True)
  flops_per_token = (6 if learner.frozen is None else 4) * p
  return dict(model=name, remat=remat, plan_peak_gib=plan["peak"] / memory.GIB, lengths=lengths,
              params=p, trained_params=learner.num_params, lora_rank=lora_rank,
              flops_per_token=flops_per_token, **publish_figures(learner),
              sequences=groups * n, tokens_per_step=float(np.mean(tokens)),
              step_s=busy_s / len(times), compile_s=compile_s, tokens_per_s=tok_s,
              mfu=flops_per_token * tok_s / peak,
              padding_efficiency=metrics["padding_efficiency"],
              packing_efficiency=metrics["packing_efficiency"], row_len=metrics["row_len"],
              micro_rows=metrics["micro_rows"], micro_batches=metrics["micro_batches"],
              compiles_timed=len(compiles), compile_s_timed=float(sum(compiles)))


def _nbytes(tree, elements: bool = False) -> int:
  return sum(int(np.prod(x.shape)) * (1 if elements else x.dtype.itemsize)
             for x in jax.tree.leaves(tree))


def publish_figures(learner: Learner, reps: int = 3) -> dict:
  """Seconds and bytes to publish one version to a second device (and with Orbax to disk)."""
  devices = jax.devices()
  target = jax.sharding.SingleDeviceSharding(devices[1 if len(devices) > 1 else 0])
  params = learner.params()
  shardings = jax.tree.map(lambda _: target, params)
  transfer = weight_transfer.DevicePutTransfer(shardings)
  merge = None
  if learner.lora is not None:  # the sampler's merge, as DecodeEngine.put_params runs it
    base = jax.device_put(learner.frozen, target)
    merge = jax.jit(functools.partial(lora_lib.merge, lcfg=learner.lora))
    jax.block_until_ready(merge(base, jax.device_put(params, target)))  # compile
  times, merge_times = [], []
  for v in range(reps):
    t = time.perf_counter()
    out = transfer.send(params, v)
    times.append(time.perf_counter() - t)
    if merge is not None:
      t = time.perf_counter()
      jax.block_until_ready(merge(base, out))
      merge_times.append(time.perf_counter() - t)
  with tempfile.TemporaryDirectory() as tmp:
    publisher = weight_transfer.OrbaxPublisher(tmp, keep=1)
    orbax_s = min(publisher.publish(params, v) for v in range(2))
    publisher.close()
    disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp) for f in fs)
  return dict(publish_s=min(times), publish_mib=_nbytes(params) / 2**20,
              merge_s=min(merge_times) if merge_times else 0.0, orbax_s=orbax_s,
              orbax_mib=disk / 2**20)


def sampler_resident(cfg: ModelConfig, c, devices: int) -> dict:
  """What a colocated recipe's JAX sampler keeps per device between its turns (the part of
  ``sampler.memory.SamplerPlan.resident_bytes`` the learner plans beside), from shapes alone: its
  weights in the compute dtype ``model.dtype``, norm scales and biases float32 (one copy per device: the recipes' sampler meshes
  are data-parallel, an engine per device; with LoRA the merged copy, its base the learner's) and
  the dense KV cache of ``rollout.num_slots / devices`` slots of ``max(prefill_buckets) +
  max_new_tokens`` positions in that dtype (a paged pool that follows the slots holds the same
  positions rounded up to pages). Bytes: ``weights``, ``state`` and ``slots`` (per device)."""
  from areal_jax.sampler import slot_cache
  cfg = dataclasses.replace(cfg, dtype=c.model.dtype)
  params = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), nnx.Param)
  weights = sum(x.size * (4 if x.ndim == 1 else cfg.compute_dtype.itemsize)  # (norms, biases:
                for x in jax.tree.leaves(params))                           # float32)
  slots = c.rollout.num_slots // devices
  max_len = max(c.rollout.prefill_buckets) + c.rollout.max_new_tokens
  cache = jax.eval_shape(lambda: slot_cache.make(cfg, slots, max_len, cfg.compute_dtype,
                                                 slot_cache.STACKED))
  return dict(weights=weights, state=sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)),
              slots=slots)


SAMPLER_PROGRAMS_MAX_PARAMS = 3e9  # its random weights are built on this CPU: 7B's would not fit


def target_sampler_plan(device, cfg: ModelConfig, c, slots: int, budget_bytes: int | None = None,
                        fit: bool = False):
  """The recipe ``c``'s sampler plan on ``device`` (one engine of ``slots`` slots, random weights
  of ``cfg`` in ``model.dtype``), its decode and prefill programs compiled by the target's
  compiler (``aot_decode.sampler_plan``), a weight swap planned as the run plans it
  (``runtime.engines.sampler_budget``: LoRA adapters merged into the learner's frozen base, or
  whole weights in the dtype the transfer delivers; paused while colocated). ``fit``: the plan
  the run settles on where those slots do not fit (``aot_decode.sampler_fit``:
  ``sampler.memory.fit``, at least ``rollout.n_samples`` slots)."""
  import aot_decode  # noqa: PLC0415
  from areal_jax.models import lora as lora_lib
  from areal_jax.sampler.engine import EngineConfig
  model = Transformer(dataclasses.replace(cfg, dtype=c.model.dtype), nnx.Rngs(0))
  lcfg = lora_lib.LoraConfig.from_config(c.actor.get("lora"))
  swap = dict(engines.swap_plan(c, beside_learner=True),
              weight_swap=engines.weight_swap(c),
              shared_base=lcfg is not None and c.mesh.colocated and c.actor.dtype == c.model.dtype)
  config = EngineConfig(**engines.engine_settings(c, slots))
  if fit:
    return aot_decode.sampler_fit(device, model, config, lora=lcfg, min_slots=c.rollout.n_samples,
                                  budget_bytes=budget_bytes, **swap)
  return aot_decode.sampler_plan(device, model, config, lora=lcfg, budget_bytes=budget_bytes,
                                 **swap)


def disjoint_sampler_plan(c, cfg: ModelConfig, devices, budget: int, preset: str) -> dict:
  """A recipe's sampler on devices of its own (``mesh.colocated`` False): one engine's plan per
  device (``rollout.data_parallel="replicas"``: ``rollout.num_slots`` split over them) compiled
  for the target, against the whole budget, a weight swap beside its decode calls; where the
  configured slots do not fit, the plan the run would settle on (``sampler.memory.fit``: the swap
  paused, a paged pool sized to the budget, or fewer slots)."""
  from areal_jax.runtime import meshes
  r = c.rollout
  sampler_mesh = meshes.build(c.mesh, devices)[1]
  data = sampler_mesh.shape.get("data", 1)  # (a target's hosts: engines.replica_meshes's split)
  if sampler_mesh.size > 1 and (data != sampler_mesh.size
                                or r.get("data_parallel", "replicas") != "replicas"):
    return {}  # (one engine over several devices: not compiled here)
  slots = r.num_slots // data
  device = sampler_mesh.devices.flat[0]
  try:
    programs, fits = target_sampler_plan(device, cfg, c, slots, budget, fit=True), True
  except MemoryError as e:  # (not even a group's slots: the plan at the configured ones)
    print(f"{preset}: {e}", flush=True)
    programs, fits = target_sampler_plan(device, cfg, c, slots, budget), False
  programs = programs.with_rows(engines.turns_kept(c, programs.num_slots))
  print(f"{preset}: sampler memory plan compiled for {device.device_kind} (an engine a device, "
        f"{slots} slots configured): {programs.summary()}; "
        f"{'fits' if fits else 'does not fit'}", flush=True)
  return dict(sampler_configured_slots=slots, sampler_slots=programs.num_slots,
              sampler_fits=fits, sampler_kv_pages=programs.kv_pages,
              sampler_swap_pauses=programs.swap_pauses, sampler_kept_rows=programs.kept_rows,
              **{f"sampler_{k}_gib": getattr(programs, k) / memory.GIB for k in (
                  "weights", "state", "incoming", "generate_temp", "prefill", "resident_bytes",
                  "peak_bytes", "memo")})


def colocated_rows(c, programs, learner_plan, budget_bytes: int) -> int:
  """Continuation rows a colocated run's row cache keeps (``runtime.engines.build_planned``): as
  many as its own plan has room for (``budget_bytes``: what the learner keeps leaves), at most what
  the learner's step leaves."""
  programs = dataclasses.replace(programs, budget_bytes=budget_bytes)
  rows = programs.with_rows(engines.turns_kept(c, programs.num_slots)).kept_rows
  return engines.rows_beside_learner(rows, programs.row_bytes, learner_plan)


def plan_recipes(target: str = "", count: int = 1, only: tuple[str, ...] = (),
                 overrides: list[str] = ()) -> list[dict]:
  """The memory plan of each shipped recipe (``only``: those presets) on its learner mesh
  (abstract shapes), over this process's devices, or compiled for ``target``'s devices
  (``aot_decode.target_devices``: a TPU topology, or ``count`` GPUs of a target file). A colocated
  recipe's learner is planned beside what its sampler keeps (``sampler_resident``), as
  ``runtime.engines.build_planned`` plans it; when not even its smallest micro-batch fits there,
  the row says how many slots per device leave it room (the run's sampler takes that many)."""
  import pathlib
  from areal_jax.runtime import meshes
  devices = None
  if target:
    import aot_decode  # noqa: PLC0415 (its compile-only devices)
    devices = aot_decode.target_devices(target, count)
  rows = []
  for name, preset, cfg, gib in RECIPES:
    if only and preset not in only:
      continue
    c = config_lib.load(f"{pathlib.Path(__file__).parents[1] / 'configs/gsm8k.py'}:{preset}")
    override_all(c, overrides)
    mesh = meshes.build(c.mesh, devices)[0]
    learner = Learner.abstract(cfg, c.actor, mesh, max_seq_len=c.rollout.max_prompt_len +
                               c.rollout.max_new_tokens)
    budget = int(c.mesh.memory_fraction * gib * memory.GIB)
    sampler = sampler_resident(cfg, c, mesh.size) if c.mesh.colocated else None
    reserved = sampler["weights"] + sampler["state"] if sampler else 0
    programs = None  # the sampler's plan, its programs compiled for the target
    if sampler and target and cfg.num_params() < SAMPLER_PROGRAMS_MAX_PARAMS:
      programs = target_sampler_plan(devices[0], cfg, c, sampler["slots"])
      reserved = programs.resident_bytes
    t = time.perf_counter()
    try:
      p, fits = memory.plan(learner, budget - reserved,
                            publish=weight_transfer.version_caster(c)), True
    except memory.DoesNotFit as e:  # report the smallest micro-batch's plan and that it does not fit
      print(f"{preset}: {e}")
      p, fits = e.smallest, False
    print(f"{preset}: learner memory plan {p.peak_gib:.2f} GiB per device at its peak for "
          f"{p.micro_rows} x {p.row_len} tokens, budget {budget / memory.GIB:.2f} GiB", flush=True)
    row = dict(recipe=f"configs/gsm8k.py:{preset}", model=name, devices=dict(mesh.shape),
               target=target or "this process's devices",
               device_kind=mesh.devices.flat[0].device_kind,
               device_gib=gib, memory_fraction=c.mesh.memory_fraction,
               micro_batch_tokens=p.micro_batch_tokens, row_len=p.row_len,
               micro_rows=p.micro_rows, remat=c.actor.remat,
               logits_chunk=c.actor.logits_chunk, plan_s=time.perf_counter() - t, fits=fits,
               lora_rank=c.actor.lora.rank,
               **{f"{k}_gib": v / memory.GIB for k, v in p.parts.items()})
    if sampler:  # the slots that leave the learner's smallest step room, as the run's plan says
      room = sampler_memory.SamplerPlan(
          weights=sampler["weights"], lora_base=0, state=sampler["state"], generate_temp=0,
          prefill=0, num_slots=sampler["slots"], budget_bytes=None,
          resident_budget=budget - p.peak_bytes)
      row.update(sampler_weights_gib=sampler["weights"] / memory.GIB,
                 sampler_cache_gib=sampler["state"] / memory.GIB,
                 sampler_slots=sampler["slots"] if fits else room.slots_that_fit())
    if programs:  # its peak beside what the learner keeps, at the slots the run would take
      if not fits and row["sampler_slots"] >= c.rollout.n_samples:
        programs = target_sampler_plan(devices[0], cfg, c, row["sampler_slots"])
      kept = sum(memory.kept_bytes(learner).values())
      row.update({f"sampler_{k}_gib": getattr(programs, k) / memory.GIB for k in (
                     "weights", "state", "generate_temp", "prefill", "resident_bytes",
                     "peak_bytes")},
                 sampler_program_slots=programs.num_slots, sampler_kv_pages=programs.kv_pages,
                 sampler_swap_pauses=programs.swap_pauses,
                 sampler_kept_rows=colocated_rows(c, programs, p, budget - kept),
                 sampler_fits=programs.peak_bytes <= budget - kept
                 and programs.resident_bytes + p.peak_bytes <= budget)
      print(f"{preset}: sampler memory plan compiled for {row['device_kind']}: "
            f"{programs.summary()}; {row['sampler_fits'] and 'fits' or 'does not fit'} beside "
            f"the learner ({kept / memory.GIB:.2f} GiB kept, {p.peak_gib:.2f} GiB at its peak) "
            f"in {budget / memory.GIB:.2f} GiB"
            + (f"; {row['sampler_kept_rows']} continuation rows of "
               f"{programs.row_bytes / 2**20:.1f} MiB in what its step leaves"
               if programs.row_bytes and engines.turns_kept(c, 1) else ""), flush=True)
    elif target and cfg.num_params() < SAMPLER_PROGRAMS_MAX_PARAMS:  # on devices of its own
      row.update(disjoint_sampler_plan(c, cfg, devices, budget, preset))
    row["overrides"] = list(overrides)
    rows.append(row)
  print(f"{'recipe':<30}{'model':<14}{'mesh':>24}{'tokens':>8}{'params':>8}{'opt':>7}{'grads':>7}"
        f"{'acc':>7}{'update':>8}{'publish':>9}{'peak GiB':>10}{'sampler':>9}{'budget':>8}")
  for r in rows:
    mesh = ",".join(f"{k}={v}" for k, v in r["devices"].items())
    sampler = (f"{r['sampler_weights_gib'] + r['sampler_cache_gib']:.2f}"
               if "sampler_cache_gib" in r else "-")  # kept beside the learner, configured slots
    note = "" if r["fits"] else "  does not fit" + (
        f" beside the sampler's slots; {r['sampler_slots']} slots per device leave room"
        if "sampler_cache_gib" in r else "")
    print(f"{r['recipe']:<30}{r['model']:<14}{mesh:>24}{r['micro_rows'] * r['row_len']:>8}"
          f"{r['params_gib']:>8.2f}{r['opt_gib']:>7.2f}{r['grads_gib']:>7.2f}"
          f"{r['accumulate_gib']:>7.2f}{r['update_gib']:>8.2f}"
          f"{r['publish_gib'] if 'publish_gib' in r else float('nan'):>9.2f}{r['peak_gib']:>10.2f}"
          f"{sampler:>9}"
          f"{r['memory_fraction'] * r['device_gib']:>8.1f}{note}")
  return rows


def compile_depth() -> list[dict]:
  """Compile seconds of the train forward + backward by depth, unrolled vs scanned layers."""
  import jax.numpy as jnp
  from areal_jax.models import train_forward
  rows = []
  for n_layers in (2, 8, 30):
    for scan in (False, True):
      cfg = dataclasses.replace(SMOLLM2, n_layers=n_layers)
      graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
      tokens = jax.ShapeDtypeStruct((2, 768), jnp.int32)
      loss = lambda p, t: jnp.sum(train_forward.hidden(nnx.merge(graphdef, p), t, remat="full",
                                                       scan=scan))
      t0 = time.perf_counter()
      lowered = jax.jit(jax.grad(loss)).lower(params, tokens)
      t1 = time.perf_counter()
      lowered.compile()
      rows.append(dict(layers=n_layers, scan=scan, lower_s=t1 - t0,
                       compile_s=time.perf_counter() - t1))
      print(f"{n_layers:>3} layers {'scanned' if scan else 'unrolled':>9}: lower "
            f"{rows[-1]['lower_s']:5.1f} s, compile {rows[-1]['compile_s']:5.1f} s", flush=True)
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="reduced run (< 2 minutes)")
  ap.add_argument("--json", default=None, help="write results to this path")
  ap.add_argument("--plan", action="store_true", help="only the recipes' memory plans")
  ap.add_argument("--depth", action="store_true", help="only compile time by depth")
  ap.add_argument("--only", default="", help="comma-separated row names to run (default: all); "
                  "with --plan, recipe presets (default, qwen7b, qwen3, qwen3_lora; "
                  "qwen3_32k_v5p, _h100 with their --target)")
  ap.add_argument("--target", default="", help="--plan compiled for this TPU topology (v5e:2x4) "
                  "or GPU under bench/aot_targets (h100), on a machine without one")
  ap.add_argument("--devices", type=int, default=8, help="GPUs of a --target GPU (one host)")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="--plan: override a key of every recipe (e.g. actor.logits_chunk=1024)")
  args = ap.parse_args()
  if args.target:  # the target's compiler only: this machine's CPU stays JAX's backend
    jax.config.update("jax_platforms", "cpu")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # (the CUDA plugin's driver check)
  if args.plan or args.depth:
    only = tuple(filter(None, args.only.split(",")))
    rows = (plan_recipes(args.target, args.devices, only, args.set) if args.plan
            else compile_depth())
    if args.json:
      with open(args.json, "w") as f:
        json.dump(dict(machine=machine(), load_avg=os.getloadavg()[0],
                       **{"plans" if args.plan else "depth": rows}), f, indent=1)
    return
  info, hw = machine(), Hardware()
  peak = hw.probe(5).figures()["matmul_GFLOPps"] * 1e9
  print(f"machine: {info['cpu']}, {info['cores']} cores, {info['devices']}, jax {info['jax']}, "
        f"load avg {info['load_avg']:.1f}")
  print(f"measured float32 matmul: {peak / 1e9:.1f} GFLOP/s")
  if args.quick:  # SmolLM2-135M layer shapes, 6 of its 30 layers (compiles in a fraction)
    six = dataclasses.replace(SMOLLM2, n_layers=6)
    smol = ("smollm2-135m-6L", six, 2, 2, 1, 1536)
    runs = [("tiny", TINY, 4, 4, 1, 8192), smol,
            ("smollm2-135m-6L-full",) + smol[1:] + (768, "gsm8k", None, "full"),
            ("smollm2-135m-6L-dots",) + smol[1:] + (768, "gsm8k", None, "dots"),
            ("smollm2-135m-6L-lora16",) + smol[1:] + (768, "gsm8k", None, "none", 16)]
  else:
    runs = [("tiny", TINY, 16, 4, 3, 8192), ("smollm2-135m", SMOLLM2, 16, 4, 1, 1536, 768, "gsm8k", 2),
            ("smollm2-135m-full", SMOLLM2, 16, 4, 1, 1536, 768, "gsm8k", 2, "full"),
            ("smollm2-135m-lora16", SMOLLM2, 16, 4, 1, 1536, 768, "gsm8k", 2, "none", 16),
            ("smollm2-135m-short", SMOLLM2, 4, 8, 2, 2048, 176, "short"),
            ("smollm2-135m-short-lora16", SMOLLM2, 4, 8, 2, 2048, 176, "short", None, "none", 16)]
  if args.only:
    names = [r[0] for r in runs]
    unknown = sorted(set(args.only.split(",")) - set(names))
    if unknown:
      ap.error(f"--only: unknown rows {unknown}; rows of this run: {names}")
    runs = [r for r in runs if r[0] in args.only.split(",")]
  rows = [bench_model(*r[:5], peak, *r[5:]) for r in runs]
  # The machine is shared: keep the best matmul figure seen (MFU is then conservative).
  peak = hw.probe(5).figures()["matmul_GFLOPps"] * 1e9
  for r in rows:
    r["mfu"] = r["flops_per_token"] * r["tokens_per_s"] / peak
  pack = packing_efficiency(20 if args.quick else 100, 64, 4, 768)
  print(f"best measured float32 matmul: {peak / 1e9:.1f} GFLOP/s")
  print(f"\n{'model':<26}{'remat':>6}{'trained':>12}{'tokens/step':>12}{'step s':>8}{'tokens/s':>10}"
        f"{'MFU':>7}{'pad eff':>8}{'compile s':>10}{'plan GiB':>9}{'publish s':>10}{'pub MiB':>9}"
        f"{'merge s':>8}{'orbax s':>8}{'orbax MiB':>10}")
  for r in rows:
    print(f"{r['model']:<26}{r['remat']:>6}{r['trained_params']:>12,}{r['tokens_per_step']:>12.0f}"
          f"{r['step_s']:>8.2f}{r['tokens_per_s']:>10.0f}{r['mfu']:>7.1%}"
          f"{r['padding_efficiency']:>8.1%}{r['compile_s']:>10.1f}{r['plan_peak_gib']:>9.3f}"
          f"{r['publish_s']:>10.3f}{r['publish_mib']:>9.1f}{r['merge_s']:>8.3f}{r['orbax_s']:>8.2f}"
          f"{r['orbax_mib']:>10.1f}")
  print(f"\npacking efficiency (GSM8K-like lengths, 64 x 4 sequences per batch, rows of 768): "
        f"{pack:.1%}")
  smol = next((r for r in rows if r["model"].startswith("smollm2") and r["remat"] == "none"
               and not r["lora_rank"]), {"mfu": None})
  short = next((r for r in rows if r["model"] == "smollm2-135m-short"), None)
  result = dict(machine=info, matmul_flops=peak, mfu=smol["mfu"], packing_efficiency=pack,
                mfu_short=short["mfu"] if short else None,
                quick=args.quick, models=rows)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
