"""The temporaries of the decode call the sampler's memory plan counts (every slot, the largest kv
bucket) in its two programs on a GPU (``kernels.choice.truncation_on_host``): the one without the
sort (no slot truncates) and the one with it (some slot asks for top-k / top-p), compiled for an
H100 on a CPU machine (XLA's AOT with JAX's CUDA plugin; see bench/aot_decode.py for the venv).

  /tmp/cuda/bin/python bench/results/cpu-aot-h100-truncate-memory-2026-11-30-s45/truncate_memory.py \
      --model smollm2-135m
"""
import argparse
import dataclasses
import json
import sys
import time

sys.path.insert(0, "bench")
import aot_decode  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from areal_jax.kernels import choice  # noqa: E402
from areal_jax.models import Transformer  # noqa: E402
from areal_jax.sampler.engine import EngineConfig  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="smollm2-135m")
ap.add_argument("--steps", type=int, default=16)
ap.add_argument("--page-size", type=int, default=64)
ap.add_argument("--out", default="")
args = ap.parse_args()
cfg, slots, ctx = aot_decode.SHAPES[args.model]
cfg = dataclasses.replace(cfg, dtype="bfloat16")
device = aot_decode.target_device("h100")
model = Transformer(cfg, nnx.Rngs(0))
max_len = ctx + 16 * args.steps
eng = aot_decode.target_engine(device, model, EngineConfig(
    num_slots=slots, max_len=max_len, prefill_buckets=(16,),
    kv_buckets=(ctx + 4 * args.steps + 1,), steps_per_call=args.steps,
    decode_attention="pallas_gpu", decode_layers="unrolled", decode_matmul="blas",
    decode_projections="fused", kv_pages=slots * -(-max_len // args.page_size),
    page_size=args.page_size))
eng.truncation_on_host = True  # as on a GPU: a program with the sort and one without
rows = []
for matmul in ("blas", "xla"):
  eng.use_launch(choice.Launch(None, eng.launch.paged, "", matmul))
  for truncate in (False, True):
    t0 = time.time()
    with choice.lowering_for("cuda"):
      fn = eng._make_generate(eng.kv_buckets[-1], slots, truncate=truncate).__wrapped__  # noqa: SLF001
      fargs = (aot_decode.abstract(eng.params, device),
               aot_decode.abstract(eng.state_shapes(), device),
               aot_decode.abstract(jax.ShapeDtypeStruct((slots, eng.pages_per_slot), jnp.int32),
                                   device))
      options = choice.compiler_options(eng.decode_matmul) or None
      m = choice.lower(jax.jit(fn, donate_argnums=1, compiler_options=options), fargs, "cuda",
                       device.device_kind).compile().memory_analysis()
    rows.append(dict(matmuls=matmul, truncate=truncate,
                     temp_mib=round(m.temp_size_in_bytes / 2**20, 2),
                     args_mib=round(m.argument_size_in_bytes / 2**20, 1),
                     compile_s=round(time.time() - t0, 1)))
    print(rows[-1], flush=True)
vocab = cfg.vocab_size
print(f"\n{args.model}, {slots} slots, kv bucket {eng.kv_buckets[-1]}, {args.steps} steps a call, "
      f"H100 (compiled on CPU); one [slots, vocab] float32 array: "
      f"{slots * vocab * 4 / 2**20:.1f} MiB")
print(f"{'matmuls':8s} {'program':22s} {'temp MiB':>9s} {'ratio':>6s}")
for r in rows:
  base = next(x for x in rows if x["matmuls"] == r["matmuls"] and not x["truncate"])["temp_mib"]
  name = "with the sort (top-p)" if r["truncate"] else "without the sort"
  print(f"{r['matmuls']:8s} {name:22s} {r['temp_mib']:9.2f} {r['temp_mib'] / base:6.2f}")
if args.out:
  json.dump(dict(model=args.model, slots=slots, kv_len=eng.kv_buckets[-1], steps=args.steps,
                 vocab=vocab, target="h100 (AOT on CPU)", jax=jax.__version__, rows=rows),
            open(args.out, "w"), indent=1)
