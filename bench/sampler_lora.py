"""LoRA in the JAX sampler: adapters merged once per version vs a low-rank side path every step.

  python bench/sampler_lora.py [--quick] [--json PATH]

The learner publishes rank-``r`` adapters (SmolLM2-135M shape, random weights, every attention and
MLP projection adapted). The sampler can either merge them into its base weights once per version
(``DecodeEngine.put_params``: ``W + scale * a @ b`` per target, cast to the compute dtype) and
decode at full-model speed, or keep the base and run ``x @ W + scale * (x @ a) @ b`` in every decode
step. Both rows decode the same slots on the same (accelerator) path: dense decode attention,
XLA's matmuls, unrolled layers, 16 steps per call. Reported: ``merge_ms`` (one version's merge),
``step_ms`` per row, and ``breakeven_steps``: decode steps per version above which merging is
cheaper (``merge_ms / (side step_ms - merged step_ms)``; an RL version spans hundreds of steps).
The shipped sampler merges; this is the measurement behind that choice.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.update({"AREAL_JAX_DECODE_ATTENTION": "dense", "AREAL_JAX_DECODE_MATMUL": "xla",
                   "AREAL_JAX_DECODE_LAYERS": "unrolled"})

import jax  # noqa: E402
import numpy as np  # noqa: E402

from areal_jax.models import lora  # noqa: E402
from areal_jax.sampler import sampling  # noqa: E402
from areal_jax.sampler.engine import DecodeEngine, EngineConfig  # noqa: E402
from common import SMOLLM2, finish, machine  # noqa: E402
from sampler import make_model  # noqa: E402

STEPS = 16


def step_ms(dev, params, slots, context, reps) -> float:
  """Best per-step time of ``reps`` calls of ``STEPS`` decode steps over ``slots`` active slots."""
  end = context + STEPS * (reps + 2)
  state = dev.init_state()
  keys = np.stack([np.asarray(sampling.slot_key(0, i)) for i in range(slots)])
  state = dev.insert(state, None, list(range(slots)), token=[1] * slots, pos=[context] * slots,
                     end=[end] * slots, keys=keys, temperature=1.0, top_k=0, top_p=1.0,
                     greedy=False, stop_ids=[])
  times = []
  for i in range(reps + 1):
    t0 = time.perf_counter()
    state, out = dev.generate(params, state, end)
    jax.block_until_ready(out)
    if i:  # the first call compiles
      times.append((time.perf_counter() - t0) / STEPS)
  return min(times) * 1e3


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="6 layers, 3 repetitions")
  ap.add_argument("--rank", type=int, default=16)
  ap.add_argument("--slots", type=int, default=64)
  ap.add_argument("--context", type=int, default=128)
  ap.add_argument("--json", default=None, help="write results to this path")
  args = ap.parse_args()
  t_start = time.perf_counter()
  on_cpu = jax.default_backend() == "cpu"
  cfg = dataclasses.replace(SMOLLM2, dtype="float32" if on_cpu else "bfloat16",
                            n_layers=6 if args.quick else SMOLLM2.n_layers)
  reps = 3 if args.quick else 5
  info = machine()
  print(f"machine: {info['cpu']}, {info['cores']} cores, jax {info['jax']} ({info['devices']})")
  lcfg = lora.LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
  dev = DecodeEngine(make_model(cfg), EngineConfig(
      num_slots=args.slots, max_len=args.context + STEPS * (reps + 2), prefill_buckets=(16,),
      kv_buckets=(args.context + STEPS * (reps + 2),), steps_per_call=STEPS,
      decode_projections="separate"), lora=lcfg)  # the side path wraps the model's own weights
  adapters = lora.init_adapters(jax.device_get(dev.weights.lora_base), lcfg, jax.random.key(0))
  adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # b != 0: a trained adapter

  merge_times = []
  for _ in range(reps + 1):
    t0 = time.perf_counter()
    merged = jax.block_until_ready(dev.put_params(adapters))
    merge_times.append(time.perf_counter() - t0)
  merge_ms = min(merge_times[1:]) * 1e3  # the first call compiles the merge
  merged_ms = step_ms(dev, merged, args.slots, args.context, reps)
  del merged
  # The side path: the base weights with LoraWeight leaves (their own low-rank forward).
  side = lora.wrap(dev.weights.lora_base, jax.tree.map(lambda x: x.astype(cfg.compute_dtype), adapters),
                   lcfg)
  dev.held_shardings = dev.held_formats = None  # a different parameter tree: let jit place it
  side_ms = step_ms(dev, side, args.slots, args.context, reps)
  extra = side_ms - merged_ms
  breakeven = merge_ms / extra if extra > 0 else float("inf")
  rows = {"merged": {"step_ms": merged_ms}, "side_path": {"step_ms": side_ms}}
  print(f"SmolLM2-135M shape, {cfg.n_layers} layers, rank {args.rank}, {args.slots} slots, "
        f"context {args.context}, {cfg.dtype}")
  print(f"{'row':<10} {'step_ms':>9} {'vs merged':>10}")
  for name, r in rows.items():
    print(f"{name:<10} {r['step_ms']:9.2f} {r['step_ms'] / merged_ms:10.2f}")
  print(f"merge per version: {merge_ms:.1f} ms; merging pays off above {breakeven:.1f} decode "
        "steps per version")
  result = {"machine": info, "quick": args.quick, "backend": jax.default_backend(),
            "rank": args.rank, "slots": args.slots, "context": args.context,
            "n_layers": cfg.n_layers, "merge_ms": merge_ms, "rows": rows,
            "side_over_merged": side_ms / merged_ms, "breakeven_steps": breakeven,
            "load_avg": os.getloadavg(), "bench_s": time.perf_counter() - t_start}
  finish(result, args.json, t_start)


if __name__ == "__main__":
  main()
