"""The learner's memory plan: does the train step fit in device memory, and with which micro-batch.

Before the first step, the learner's device functions are compiled on abstract shapes (the
training state and a micro-batch as ``jax.ShapeDtypeStruct``s: no weights needed) and XLA's memory
analysis gives, per device, the bytes of arguments, outputs (less those aliased to donated
arguments) and temporaries. What else is resident while a function runs is added: the optimizer
state during the gradient accumulation and the proximal forward, the frozen reference parameters
(``kl_coef > 0``) throughout, and with LoRA the frozen base (an argument of the accumulation and
the forward, resident during the update). The planned peak is the largest of the three functions:

  accumulate = opt state + ref + args (params, gradient sums, micro-batch) + out - aliased + temp
  forward    = opt state + ref + args (params, micro-batch) + out + temp
  update     = ref + frozen base + args (training state, gradients) + out - aliased + temp
  publish    = opt state + ref + frozen base + args (params) + out + temp   (when given)

``publish`` is the program a run applies to the parameters between steps to publish a version (the
cast to the sampler's compute dtype: ``runtime.weight_transfer.caster``): the gradients are gone
by then, and its copy lives until the version has left the devices.

The budget is ``mesh.memory_fraction`` x ``mesh.device_memory_gib`` (default: the memory the
device reports, and never more than it reports; on CPU, where devices report none, each device's
share of the host memory available: ``host_budget``), less what a colocated sampler keeps on the same devices
(``reserved``: ``runtime.engines.build_planned``). The configured ``actor.micro_batch_tokens``
either fits, or the largest halving of it that fits is used, or the plan stops with a message
naming what to change (``DoesNotFit``, with the smallest micro-batch's plan). Figures are those of the backend the
plan compiles for (XLA:CPU's fusion and buffer assignment differ somewhat from TPU's or GPU's); a
program a TPU's compiler refuses for want of memory does not fit (``program_memory``).

The micro-batch is compiled with the learner's own shardings: rows split over data x fsdp and each
row's positions over ``mesh.learner.context``, so a device's activations are its block of
``1 / context`` of each row's positions, and the parameters, gradients and optimizer state are
split over fsdp x context (``sharding.DEFAULT_RULES``' ``"embed"``); the plan's figures are the
compiled program's, collectives' buffers included.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from areal_jax import host_memory, program_memory, sharding
from areal_jax.learner import packing

GIB = 1024**3
_INT_FIELDS = ("tokens", "positions", "segment_ids")


@dataclasses.dataclass
class Plan:
  """A micro-batch setting and its planned per-device peak (bytes), with the parts behind it."""
  micro_batch_tokens: int
  row_len: int
  micro_rows: int
  peak_bytes: int
  budget_bytes: int | None
  parts: dict  # bytes per device: state, opt, ref, and each function's peak
  update_cost: dict | None = None  # the update's compiled cost (``step_peak``'s to reuse)

  @property
  def peak_gib(self) -> float:
    return self.peak_bytes / GIB

  @property
  def fits(self) -> bool:
    return self.budget_bytes is None or self.peak_bytes <= self.budget_bytes


def shape(learner, micro_batch_tokens: int) -> tuple[int, int]:
  """``(row_len, micro_rows)`` of the largest micro-batch ``micro_batch_tokens`` allows: rows of
  the sequence budget (``max_seq_len``, else the token budget) bucketed, or twice that when it
  fits (``packing.plan`` may double rows), as many rows as fit, a multiple of the data-parallel
  size and at least one per data-parallel device. A budget under one row of the longest sequence
  still trains that sequence in a row of its own (``packing.plan`` never cuts one): rows are never
  planned shorter than ``max_seq_len``."""
  multiple = learner.context  # (a row's positions split over the context axis)
  row_len = packing.row_bucket(learner.max_seq_len or micro_batch_tokens, multiple)
  longer = packing.row_bucket(2 * row_len, multiple)
  if learner.opts.pack_sequences and longer <= micro_batch_tokens:
    row_len = longer
  dp = learner.dp
  return row_len, dp * max(1, micro_batch_tokens // row_len // dp)


class DoesNotFit(MemoryError):
  """Not even the smallest micro-batch fits; ``smallest``: its ``Plan``."""

  def __init__(self, message: str, smallest: Plan):
    super().__init__(message)
    self.smallest = smallest


def kept_bytes(learner) -> dict:
  """Per-device bytes the learner keeps between steps (no compilation): ``params``, ``opt``
  (optimizer state), ``ref`` (frozen reference parameters, ``kl_coef > 0``) and ``frozen`` (with
  LoRA, the frozen base)."""
  state = learner.abstract_state()
  params = sharding.device_bytes(state["params"])
  return dict(params=params, opt=sharding.device_bytes(state["opt"]),
              ref=params if learner.opts.kl_coef else 0,
              frozen=sum(sharding.device_bytes(f) for f in learner._frozen_args))  # noqa: SLF001


def step_peak(learner, row_len: int, micro_rows: int, update_cost: dict | None = None) -> dict:
  """Per-device bytes of the train step on ``micro_rows`` rows of ``row_len``: ``peak`` and its
  parts (see the module docstring). ``update_cost``: the update's compiled cost, if known (it does
  not depend on the micro-batch)."""
  state = learner.abstract_state()
  opts = learner.opts
  rows = lambda dtype: jax.ShapeDtypeStruct((micro_rows, row_len), dtype,
                                            sharding=learner.row_sharding)
  batch = {f: rows(jnp.int32 if f in _INT_FIELDS else jnp.float32) for f in packing.FIELDS}
  if opts.kl_coef:
    batch["ref_logp"] = rows(jnp.float32)
  acc = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                     jax.eval_shape(learner._zeros), learner._acc_shardings)
  n_tokens = jax.ShapeDtypeStruct((), jnp.float32, sharding=learner.replicated)
  params = state["params"]
  frozen = learner._frozen_args  # with LoRA: the frozen base, an argument of the step's functions
  parts = dict(kept_bytes(learner), grads=sharding.device_bytes(acc))
  opt_b, ref_b, frozen_b = parts["opt"], parts["ref"], parts["frozen"]
  peak_of = lambda c, resident: resident + c["args"] + c["out"] - c["alias"] + c["temp"]
  # The first update's proximal logprobs come from its own forward (no old_logp) unless a
  # separate forward runs (kl_coef, or more minibatches: then the other variant is planned too).
  self_prox = opts.recompute_logprobs and not opts.kl_coef
  variants = [(learner._acc_self_fn, batch)] if self_prox else []
  if not self_prox or opts.ppo_n_minibatches > 1:
    variants.append((learner._acc_fn, dict(batch, old_logp=rows(jnp.float32))))
  cost = lambda fn, *args: program_memory.cost(fn.lower(*args), args)  # noqa: E731
  parts["accumulate"] = max(peak_of(cost(fn, params, acc, b, n_tokens, *frozen), opt_b + ref_b)
                            for fn, b in variants)
  if not self_prox or opts.ppo_n_minibatches > 1 or opts.kl_coef:
    ref = [params] if opts.kl_coef else []
    plain = {f: batch[f] for f in packing.FIELDS}
    parts["forward"] = peak_of(cost(learner._logp_fn, params, plain, *ref, *frozen),
                               opt_b + (0 if opts.kl_coef else ref_b))
  if update_cost is None:
    grads = acc["grads"]
    loss = jax.ShapeDtypeStruct((), jnp.float32, sharding=learner.replicated)
    update_cost = cost(learner._apply_fn, state, grads, loss)
  parts["update"] = peak_of(update_cost, ref_b + frozen_b)
  parts["update_cost"] = update_cost
  parts["peak"] = max(parts[k] for k in ("accumulate", "forward", "update") if k in parts)
  return parts


def publish_peak(learner, publish) -> int:
  """Per-device bytes while ``publish`` (a jitted function of the parameters) runs between steps:
  what the learner keeps, and the program's own arguments, outputs and temporaries."""
  kept = kept_bytes(learner)
  params = learner.abstract_state()["params"]
  c = program_memory.cost(publish.lower(params), (params,))
  return kept["opt"] + kept["ref"] + kept["frozen"] + c["args"] + c["out"] - c["alias"] + c["temp"]


def device_budget(mesh_config, devices) -> int | None:
  """Bytes per device a process may use: ``memory_fraction`` of ``device_memory_gib``, or of the
  smallest memory the devices report when that is less or ``device_memory_gib`` is 0 (a GPU
  reports the pool JAX's allocator took: by default 75% of its memory, see JAX's
  XLA_PYTHON_CLIENT_MEM_FRACTION). CPU devices report none: their memory is the host's, and with
  ``device_memory_gib`` 0 the budget is ``host_budget``'s share of each device. None when no size
  is known (no check)."""
  gib = float(mesh_config.device_memory_gib)
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
  if limits and all(limits):
    gib = min(limits) / GIB if gib <= 0 else min(gib, min(limits) / GIB)
  elif gib <= 0:
    host = host_budget(mesh_config) if devices and all(
        d.platform == "cpu" for d in devices) else None
    return None if host is None else int(mesh_config.memory_fraction * host)
  return int(mesh_config.memory_fraction * gib * GIB)


def host_budget(mesh_config) -> int | None:
  """Bytes per CPU device of the host's memory: what the machine has available now
  (``host_memory.available_bytes``) and what this process's JAX arrays already hold (the plans
  count those themselves: a learner built before its plan), shared evenly by the devices of this
  process the run's meshes use (``mesh.learner_devices``, and ``mesh.sampler_devices`` unless
  colocated): on CPU every device's buffers are this host's memory. What no plan counts (Python,
  XLA's executables and compilations) takes the rest, ``1 - mesh.memory_fraction``. None where
  the system says nothing of its memory."""
  available = host_memory.available_bytes()
  if available is None:
    return None
  n = mesh_config.learner_devices + (0 if mesh_config.colocated else mesh_config.sampler_devices)
  n = max(1, min(n, jax.local_device_count()))
  return (available + host_memory.live_array_bytes()) // n


def plan(learner, budget_bytes: int | None, beside: str = "", publish=None) -> Plan:
  """The configured micro-batch if it fits ``budget_bytes`` (or there is no budget), else the
  largest halving of ``actor.micro_batch_tokens`` that fits; raises ``DoesNotFit`` naming the keys
  to change when even the smallest micro-batch (one row of the longest sequence per data-parallel
  device) does not (``beside``: what else the budget leaves room for, said in the message).
  ``publish``: the jitted function a published version runs through (``publish_peak``), or None."""
  mbt = int(learner.opts.micro_batch_tokens)
  tried, update_cost = [], None
  published = {} if publish is None else {"publish": publish_peak(learner, publish)}
  while True:
    row_len, rows = shape(learner, mbt)
    parts = dict(step_peak(learner, row_len, rows, update_cost), **published)
    parts["peak"] = max(parts["peak"], parts.get("publish", 0))
    update_cost = parts.pop("update_cost")
    p = Plan(mbt, row_len, rows, parts["peak"], budget_bytes, parts, update_cost)
    if p.fits:
      return p
    tried.append(p)
    smaller = mbt // 2
    if shape(learner, smaller) == (row_len, rows) or smaller < 1:
      break
    mbt = smaller
  first = tried[0]
  opts, mesh = learner.opts, learner.mesh
  raise DoesNotFit(
      f"learner memory plan: the train step does not fit: {first.peak_gib:.2f} GiB per device "
      f"planned for actor.micro_batch_tokens={first.micro_batch_tokens} "
      f"({first.micro_rows} rows x {first.row_len}), {p.peak_gib:.2f} GiB even at "
      f"{p.micro_batch_tokens} ({p.micro_rows} rows x {p.row_len}), budget "
      f"{budget_bytes / GIB:.2f} GiB (mesh.memory_fraction x mesh.device_memory_gib{beside}); "
      f"of which "
      f"parameters {p.parts['params'] / GIB:.2f}, optimizer state {p.parts['opt'] / GIB:.2f}, "
      f"gradients {p.parts['grads'] / GIB:.2f} GiB"
      + (f"; a published version's cast peaks at {p.parts['publish'] / GIB:.2f} GiB (the "
         f"sampler's compute dtype, model.dtype)" if "publish" in p.parts else "")
      + ". Lower actor.micro_batch_tokens, set "
      f"actor.remat (now {opts.remat!r}; 'full' keeps least) with {_layers_advice(mesh)} and "
      f"actor.logits_chunk, split long rows' positions over mesh.learner.context or their heads "
      f"and MLP over mesh.learner.tensor, or shard "
      f"over more devices (mesh.learner.* = {dict(mesh.shape)}, mesh.learner_devices)", p)


def _layers_advice(mesh) -> str:
  """Which ``actor.scan_layers`` keeps less on ``mesh``'s platform: XLA:CPU rematerialises only
  under the scan; libtpu, compiling for a v5e chip, kept less with the layers unrolled (the
  default recipe at rows of 24576: 11.36 GiB unrolled, 16.85 scanned;
  bench/results/plan-flash-2026-11-29-df89801)."""
  if mesh.devices.flat[0].platform == "cpu":
    return "actor.scan_layers=True (XLA:CPU rematerialises only under the scan)"
  return "actor.scan_layers=False (the scan keeps more: a stacked copy of the weights)"


def fit(learner, mesh_config, reserved: int = 0, beside: str = "", publish=None) -> Plan | None:
  """Plans the learner against the budget of ``mesh_config`` (``device_budget``) less
  ``reserved`` bytes per device (what ``beside`` names, e.g. a colocated sampler's resident part);
  lowers ``learner.opts.micro_batch_tokens`` to the plan's when it had to. None when there is no
  budget. ``publish``: as ``plan``'s."""
  # this process's devices (with jax.distributed only those report their memory)
  budget = device_budget(mesh_config, [d for d in learner.mesh.devices.flat
                                       if d.process_index == jax.process_index()])
  if budget is None:
    return None
  p = plan(learner, budget - reserved, beside, publish)
  if p.micro_batch_tokens != learner.opts.micro_batch_tokens:
    print(f"learner memory plan: actor.micro_batch_tokens={learner.opts.micro_batch_tokens} does "
          f"not fit {(budget - reserved) / GIB:.2f} GiB per device{beside}; using "
          f"{p.micro_batch_tokens} ({p.peak_gib:.2f} GiB planned)", flush=True)
    learner.opts.micro_batch_tokens = p.micro_batch_tokens
  return p
